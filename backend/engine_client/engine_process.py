"""``KVCHAT_ENGINE_MODE=process``: one engine per machine, in its own process, for every ``kvchat serve`` worker.

The engine (``kvchat engine-serve --uds``) listens on a unix socket in one folder (``KVCHAT_ENGINE_PROCESS_DIR``, by
default ``<data dir>/engine``, mode 0700: only this user reaches it); every worker talks to it with the remote client
(``remote.py``), so the machine holds one model and one KV pool, and a session's cached prefix serves whichever
worker receives its next turn. Its step loop no longer shares a GIL, OpenMP threads or a GC with any event loop.

Supervision, without a manager process: the workers contend for an ``flock`` on ``engine.lock``; the one that holds
it (the first to start, then whichever takes over when it exits) starts the engine, and starts it again when it
exits or stops answering ``/health`` for longer than the start may take. Every worker checks ``/health`` every
``CHECK_S``: ``up`` is what ``/readyz`` reports. While the engine is down, a reply that was streaming breaks off
(``EngineUnreachable``: the chat stores it ``incomplete``), and a new one is refused after the client's retries.

NOTE: an engine whose supervising worker was killed (kill -9) keeps serving; the next lock holder finds it healthy
and adopts it. A worker that stops cleanly stops the engine it started; another worker then starts a new one.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from backend.engine_client.remote_errors import EngineUnreachable

log = logging.getLogger("kvchat.engine_process")
CHECK_S = 0.5  # how often every worker asks the engine whether it serves
MAX_SOCKET_PATH = 107  # bytes of a unix socket's path (Linux's sun_path holds 108, with the NUL)


class EngineProcess:
    """The machine's engine process, as one worker sees it: ``await start()`` returns once it serves."""

    def __init__(self, folder: Path, start_timeout_s: float = 300.0) -> None:
        self.folder = folder
        self.socket_path = folder / "engine.sock"
        self._start_timeout_s = start_timeout_s
        self._lock_fd: int | None = None
        self._child: subprocess.Popen[bytes] | None = None
        self._child_began = 0.0
        self._task: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None
        self.up = False
        self.restarts = 0

    @property
    def leads(self) -> bool:
        """This worker supervises the engine (it holds the lock)."""
        return self._lock_fd is not None

    async def start(self) -> None:
        """Join (or start) the machine's engine; ``EngineUnreachable`` if it does not serve within the start time."""
        if len(os.fsencode(self.socket_path)) > MAX_SOCKET_PATH:  # (the kernel's sun_path limit)
            raise EngineUnreachable(
                f"{self.socket_path} is too long for a unix socket: set a shorter KVCHAT_ENGINE_PROCESS_DIR"
            )
        self.folder.mkdir(parents=True, exist_ok=True)
        self.folder.chmod(0o700)
        transport = httpx.AsyncHTTPTransport(uds=str(self.socket_path))
        self._http = httpx.AsyncClient(transport=transport, base_url="http://engine", timeout=2.0)
        await self._check()
        self._task = asyncio.create_task(self._watch(), name="kvchat-engine-process")
        deadline = time.monotonic() + self._start_timeout_s
        while not self.up:
            if time.monotonic() > deadline:
                raise EngineUnreachable(f"the engine process did not serve within {self._start_timeout_s:g} s")
            await asyncio.sleep(CHECK_S / 5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self._child.wait, 30)
            except subprocess.TimeoutExpired:
                self._child.kill()
        if self._http is not None:
            await self._http.aclose()
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # (releases the lock: another worker takes over)
            self._lock_fd = None

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(CHECK_S)
            try:
                await self._check()
            except Exception:  # NOTE: the watch must outlive any one failure, or nothing restarts the engine
                log.exception("checking the engine process failed")

    async def _check(self) -> None:
        if not self.leads:
            self._try_lock()
        was_up, self.up = self.up, await self._healthy()
        if was_up != self.up:
            log.log(
                logging.INFO if self.up else logging.WARNING,
                "the engine process %s",
                "serves" if self.up else "is down",
            )
        if self.leads and not self.up:
            self._restart_if_gone()

    async def _healthy(self) -> bool:
        assert self._http is not None
        try:
            response = await self._http.get("/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    def _try_lock(self) -> None:
        fd = os.open(self.folder / "engine.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return
        self._lock_fd = fd
        log.info("this worker supervises the engine process (%s)", self.socket_path)

    def _restart_if_gone(self) -> None:
        """Start the engine when none runs: the one this worker started exited, or hangs past the start time."""
        child = self._child
        if child is not None and child.poll() is None:
            if time.monotonic() - self._child_began < self._start_timeout_s:
                return  # (still loading its model)
            log.warning("the engine process %d has not answered for %g s: killing it", child.pid, self._start_timeout_s)
            child.kill()
            child.wait()
        if child is not None:
            self.restarts += 1
            log.warning("the engine process exited (code %s); starting it again", child.returncode)
        self._spawn()

    def _spawn(self) -> None:
        log_file = (self.folder / "engine.log").open("ab")
        self._child = subprocess.Popen(
            [sys.executable, "-m", "backend.cli", "engine-serve", "--uds", str(self.socket_path)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # NOTE: a Ctrl-C to the worker's terminal is the worker's; it stops the engine
        )
        log_file.close()
        (self.folder / "engine.pid").write_text(f"{self._child.pid}\n")  # (for an operator, and the tests)
        self._child_began = time.monotonic()
        log.info("started the engine process %d (its log: %s)", self._child.pid, self.folder / "engine.log")
