"""Cache control on every engine replica: the ``/kvchat/...`` routes of ``backend/engine_server/control.py``.

NOTE: these calls go to each replica directly, never through vllm-router: the router forwards a path it does not
know to one worker of its choice *without the request's headers* (so without the secret or ``X-Session-ID``), which
is neither authenticated nor session-affine. Session-scoped actions are broadcast instead of routed by the session's
hash: after a failover (the ring changed) a session's blocks may sit on two replicas, its old one and its new one, and
a broadcast reaches both. A replica that holds nothing of the session answers zeros.

What a replica that cannot be reached means, per action:

- ``invalidate``, ``flush``, ``release``: logged and skipped (``EngineUnreachable`` if none answered); invalidate
  and flush name it in their result (``replica_report.py``). They free memory; a stale block left on an unreachable
  replica never changes an answer (a hit needs the exact tokens), and a restarted replica's memory tier is empty.
- ``erase``: the others are erased, and the result names the replica that failed (``replica_report.py``): an
  erasure that may be partial must not look done.
- pin and the cache settings: ``EngineUnreachable`` (every replica must hold the same pin and settings).
- stats and footprint: the replicas that answered (``EngineUnreachable`` if none did).

A replica that cannot be reached is logged once, as a warning, when it goes down, and once, as info, when it answers
again; the calls skipped meanwhile are debug lines (a dead replica would otherwise log a warning on every turn).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import httpx

from backend.engine_client.remote_errors import EngineProtocolError, EngineUnreachable
from backend.engine_client.remote_stream import error_of_response
from backend.engine_client.values import EngineError
from backend.engine_client.wire import WireError

log = logging.getLogger("kvchat.engine_client")
T = TypeVar("T")


class ReplicaSet:
    """Blocking JSON calls to each replica (called through ``asyncio.to_thread`` where the interface says so)."""

    def __init__(self, urls: Sequence[str], headers: dict[str, str], timeout_s: float, uds: str | None = None) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0))
        transport = httpx.HTTPTransport(uds=uds) if uds else None  # (the engine process's unix socket)
        self._http = httpx.Client(headers=headers, timeout=timeout, transport=transport)
        self.down: set[str] = set()  # the replicas whose last call did not reach them

    def close(self) -> None:
        self._http.close()

    def call(self, url: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One replica's JSON answer; else ``EngineUnreachable``, its engine error, or ``EngineProtocolError``."""
        response = self._request(url, method, path, body)
        where = f"the engine replica {url}"
        if response.status_code >= 400:
            raise error_of_response(response.status_code, response.content, where)
        try:
            return response.json()
        except ValueError:
            raise EngineProtocolError(f"{where} answered {path} with something that is not JSON") from None

    def status(self, url: str, method: str, path: str) -> int:
        """One replica's HTTP status for a call whose answer has no body to read (``EngineUnreachable`` if none)."""
        return self._request(url, method, path, None).status_code

    def _request(self, url: str, method: str, path: str, body: dict[str, Any] | None) -> httpx.Response:
        where = f"the engine replica {url}"
        try:
            response = self._http.request(method, url + path, json=body)
        except httpx.TimeoutException as exc:
            error = EngineUnreachable(f"{where} did not answer {path} in time ({type(exc).__name__})")
            self._went_down(url, error)
            raise error from None
        except httpx.HTTPError as exc:
            error = EngineUnreachable(f"{where} cannot be reached: {exc or type(exc).__name__}")
            self._went_down(url, error)
            raise error from None
        if url in self.down:
            self.down.discard(url)
            log.info("the engine replica %s answers again", url)
        return response

    def _went_down(self, url: str, error: EngineUnreachable) -> None:
        if url not in self.down:
            self.down.add(url)
            log.warning("%s; it is skipped until it answers again (logged once)", error)

    @staticmethod
    def log_skipped(path: str, failed: Sequence[tuple[str, EngineError]]) -> None:
        """The replicas a best-effort call skipped: an unreachable one at debug (its going down was logged once)."""
        for url, exc in failed:
            level = logging.DEBUG if isinstance(exc, EngineUnreachable) else logging.WARNING
            log.log(level, "%s on %s skipped: %s", path, url, exc)

    def each(
        self, method: str, path: str, body: dict[str, Any] | None, decode: Callable[[Any], T]
    ) -> tuple[list[T], list[tuple[str, EngineError]]]:
        """Every replica's decoded answer, and the replicas that failed (with why)."""
        answers: list[T] = []
        failed: list[tuple[str, EngineError]] = []
        for url in self.urls:
            try:
                answers.append(decode(self.call(url, method, path, body)))
            except WireError as exc:
                failed.append((url, EngineProtocolError(f"the engine replica {url} answered {path} oddly: {exc}")))
            except EngineError as exc:
                failed.append((url, exc))
        return answers, failed

    def best_effort(self, method: str, path: str, body: dict[str, Any], decode: Callable[[Any], T]) -> list[T]:
        """Every replica that answered; the others are logged (``EngineUnreachable`` when none answered)."""
        answers, failed = self.each(method, path, body, decode)
        self.log_skipped(path, failed)
        if failed and not answers:
            raise failed[0][1]
        return answers

    def everywhere(self, method: str, path: str, body: dict[str, Any] | None, decode: Callable[[Any], T]) -> list[T]:
        """Every replica's answer, or the first failure (after the other replicas were asked all the same)."""
        answers, failed = self.each(method, path, body, decode)
        if failed:
            exc = failed[0][1]
            if isinstance(exc, EngineUnreachable):
                reached = len(self.urls) - len(failed)
                raise EngineUnreachable(f"{path} reached {reached} of {len(self.urls)} replica(s); {exc}")
            raise exc
        return answers
