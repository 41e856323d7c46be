"""Drive a peer that lives in its own venv: a worker subprocess speaking JSON lines over stdin/stdout.

Requests (one JSON object a line): ``{"op": "start", ...}``, ``{"op": "generate", "id", "session", "prompt_ids",
"max_tokens"[, "sampling", "return_ids"]}``, ``{"op": "end_session", "session"}``, ``{"op": "close"}``.
Replies: ``{"event": "ready", "version", "details"}``, ``{"id", "event": "tokens", "n"}``, ``{"id", "event": "done",
"prompt_tokens", "cached_tokens", "output_tokens", "kv_bytes"}``, ``{"id", "event": "error", "error"}``,
``{"event": "kv", "bytes"}`` (KV in use, now and then),
``{"event": "fatal", "error"}``, ``{"event": "closed", "peak_rss_bytes"}``. Anything else the worker prints goes to
its stderr, which is kept in a log file so a failure can be reported with its cause.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench.runners.base import OnTokens, Runner, RunnerInfo, RunnerUnavailable, TurnOutcome, TurnRequest

_START_TIMEOUT_S = 600.0


class WorkerRunner(Runner):
    def __init__(
        self,
        name: str,
        python: Path,
        script: Path,
        start: dict[str, Any],
        env: Mapping[str, str] | None = None,
        log_path: Path | None = None,
    ) -> None:
        self.name = name
        self.python = python
        self.script = script
        self.start_args = start
        self.env = dict(env or {})
        self.log_path = log_path
        self._proc: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[str, tuple[OnTokens, asyncio.Future[dict[str, Any]]]] = {}
        self._control: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._ids = itertools.count()
        self._kv_bytes: int | None = None
        self._peak_rss = 0
        self._kv_capacity: int | None = None
        self._log: Any = None

    async def start(self) -> RunnerInfo:
        if not self.python.exists():
            raise RunnerUnavailable(f"{self.python} does not exist (run bench/peers/install.sh)")
        self._log = await asyncio.to_thread(self.log_path.open, "ab") if self.log_path else asyncio.subprocess.DEVNULL
        self._proc = await asyncio.create_subprocess_exec(
            str(self.python),
            str(self.script),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=self._log,
            env={**os.environ, **self.env},
            limit=2**24,
        )
        self._reader = asyncio.create_task(self._read_loop())
        await self._send({"op": "start", **self.start_args})
        reply = await asyncio.wait_for(self._control.get(), _START_TIMEOUT_S)
        if reply.get("event") != "ready":
            raise RunnerUnavailable(f"{self.name} failed to start: {reply.get('error', reply)}")
        details = dict(reply.get("details", {}))
        capacity = details.get("kv_capacity_bytes")
        self._kv_capacity = int(capacity) if capacity is not None else None
        return RunnerInfo(self.name, str(reply.get("version", "?")), details)

    async def _send(self, message: dict[str, Any]) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write((json.dumps(message) + "\n").encode())
        await self._proc.stdin.drain()

    async def _read_loop(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        while True:
            line = await self._proc.stdout.readline()
            if not line:
                break
            try:
                message = json.loads(line)
            except json.JSONDecodeError:
                continue  # NOTE: a library that prints to stdout must not break the protocol
            self._dispatch(message)
        error = f"the {self.name} worker exited (code {await self._proc.wait()}); see {self.log_path}"
        for _, future in self._pending.values():
            if not future.done():
                future.set_exception(RuntimeError(error))
        self._pending.clear()
        self._control.put_nowait({"event": "fatal", "error": error})

    def _dispatch(self, message: dict[str, Any]) -> None:
        pending = self._pending.get(str(message.get("id")))
        event = message.get("event")
        if event == "kv":
            self._kv_bytes = int(message["bytes"])
            return
        if pending is None:
            self._control.put_nowait(message)
            return
        on_tokens, future = pending
        if event == "tokens":
            on_tokens(int(message["n"]))
        elif event == "done":
            if message.get("kv_bytes") is not None:
                self._kv_bytes = int(message["kv_bytes"])
            del self._pending[str(message["id"])]
            if not future.done():  # NOTE: the driver may have given up on (cancelled) this turn
                future.set_result(message)
        elif event == "error":
            del self._pending[str(message["id"])]
            if not future.done():
                future.set_exception(RuntimeError(str(message.get("error"))))

    async def generate(
        self,
        session_id: str,
        prompt_ids: list[int],
        max_tokens: int,
        on_tokens: OnTokens,
        sampling: Mapping[str, Any] | None = None,
        return_ids: bool = False,
    ) -> dict[str, Any]:
        """One request; the worker's ``done`` message as it came (``sampling`` overrides the worker's greedy,
        EOS-ignoring default; ``return_ids`` asks for the token ids; a speculating worker adds its ``spec``)."""
        rid = f"r{next(self._ids)}"
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = (on_tokens, future)
        message: dict[str, Any] = {
            "op": "generate",
            "id": rid,
            "session": session_id,
            "prompt_ids": prompt_ids,
            "max_tokens": max_tokens,
        }
        if sampling:
            message["sampling"] = dict(sampling)
        if return_ids:
            message["return_ids"] = True
        await self._send(message)
        return await future

    async def run_turn(self, request: TurnRequest, on_tokens: OnTokens) -> TurnOutcome:
        done = await self.generate(request.session_id, request.prompt_ids, request.max_tokens, on_tokens)
        cached = done.get("cached_tokens")
        kv = done.get("kv_bytes")
        return TurnOutcome(
            int(done["prompt_tokens"]),
            int(cached) if cached is not None else None,
            int(done["output_tokens"]),
            int(kv) if kv is not None else None,
        )

    async def end_session(self, session_id: str) -> None:
        if self._proc is not None and self._proc.returncode is None:
            await self._send({"op": "end_session", "session": session_id})

    async def close(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.returncode is None:
            try:
                await self._send({"op": "close"})
                while True:
                    reply = await asyncio.wait_for(self._control.get(), 60)
                    if reply.get("event") in ("closed", "fatal"):
                        self._peak_rss = int(reply.get("peak_rss_bytes", 0))
                        break
            except (TimeoutError, ConnectionError):
                proc.kill()
        await proc.wait()
        if self._reader is not None:
            await self._reader
        if self._log not in (None, asyncio.subprocess.DEVNULL):
            self._log.close()

    def kv_bytes(self) -> int | None:
        return self._kv_bytes

    def kv_capacity_bytes(self) -> int | None:
        return self._kv_capacity

    def peak_rss_bytes(self) -> int:
        return self._peak_rss
