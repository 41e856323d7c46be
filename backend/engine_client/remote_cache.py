"""``RemoteCacheControl``: the cache control half of ``RemoteEngine`` (invalidate, flush, release, erase, pin,
footprint, temperature, cache settings, stats) over every replica (``remote_control.py`` says why each call goes to
each replica directly, and what a replica that is down means); each result names what every replica did
(``replica_report.py``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, TypeVar

from pydantic import BaseModel

from backend.engine_client.messages import (
    CacheChanges,
    Erase,
    Flush,
    Invalidate,
    InvalidatePrefix,
    Pin,
    Released,
    SessionRef,
    Temperature,
    Unpin,
    Unpinned,
)
from backend.engine_client.remote_control import ReplicaSet
from backend.engine_client.replica_report import (
    ReplicaOutcome,
    ReplicaReport,
    ReplicaResult,
    ReportedErasure,
    ReportedInvalidation,
    ReportedPin,
)
from backend.engine_client.values import (
    CacheFootprint,
    CacheSettings,
    EngineError,
    EngineStats,
    ErasureResult,
    InvalidationResult,
    PinResult,
)
from backend.engine_client.wire import decode

log = logging.getLogger("kvchat.engine_client")
T = TypeVar("T")

VLLM_RESET = "/reset_prefix_cache?reset_running_requests=true"


class RemoteCacheControl:
    """The cache control calls of ``RemoteEngine`` (which sets these attributes at start)."""

    _replicas: ReplicaSet  # every replica
    _kvchat: ReplicaSet | None  # the replicas that are kvchat engines (vLLM ones have no control)
    _vllm: list[str]  # the replicas that are vLLM servers
    _background: set[asyncio.Task[None]]  # temperature hints in flight

    def invalidate(
        self,
        namespace: str,
        *,
        session: str | None = None,
        from_position: int | None = None,
        reason: str = "invalidated",
    ) -> ReportedInvalidation:
        body = Invalidate(namespace=namespace, session=session, from_position=from_position, reason=reason)
        return self._freed("/kvchat/invalidate", _json(body))

    def invalidate_prefix(
        self, namespace: str, token_ids: Sequence[int], from_position: int, reason: str = "invalidated"
    ) -> ReportedInvalidation:
        body = InvalidatePrefix(
            namespace=namespace, token_ids=list(token_ids), from_position=from_position, reason=reason
        )
        return self._freed("/kvchat/invalidate-prefix", _json(body))

    def flush_namespace(self, namespace: str, reason: str = "flushed") -> ReportedInvalidation:
        return self._freed("/kvchat/flush", _json(Flush(namespace=namespace, reason=reason)))

    def release_session(self, session: str) -> int:
        body = _json(SessionRef(session=session))
        return sum(r.blocks_freed for r in self._best_effort("/kvchat/sessions/release", body, _as(Released)))

    def erase_session(self, session: str, namespace: str) -> ReportedErasure:
        """Erase on every kvchat replica; the report names each replica where nothing was erased (a vLLM one, which
        has no per-session erase, or one that failed: the others are erased all the same)."""
        body = _json(Erase(session=session, namespace=namespace))
        answers, failed = self._each("POST", "/kvchat/sessions/erase", body, _as(ErasureResult))
        for url, exc in failed:
            log.warning("erasing session %s on %s failed: %s", session, url, exc)
        total = _summed(answers) if answers else ErasureResult(0, 0)
        report = self._report(failed, "vLLM has no per-session erase")
        return ReportedErasure(total.memory_blocks, total.disk_blocks, report)

    def reset_prefix_caches(self, replicas: Sequence[str]) -> ReplicaReport:
        """Reset the whole prefix cache of each of ``replicas`` (vLLM's ``POST /reset_prefix_cache``): the coarse
        erase, which takes every session's cached prefixes on that replica with it.

        NOTE: vLLM serves the route only in its dev mode (``VLLM_SERVER_DEV_MODE=1``): a 404 is ``UNSUPPORTED``.
        ``reset_running_requests`` preempts the requests running there (they are recomputed, not dropped) so the
        reset cannot be refused for blocks in use; a vLLM that predates the parameter ignores it, and its 200 does
        not say whether the reset happened (vLLM's API server does not check).
        """
        results = []
        for url in replicas:
            try:
                status = self._replicas.status(url, "POST", VLLM_RESET)
            except EngineError as exc:
                results.append(ReplicaResult(url, ReplicaOutcome.FAILED, str(exc)))
                continue
            if status == 200:
                result = ReplicaResult(url, ReplicaOutcome.CACHE_RESET, "its whole prefix cache, every session's")
            elif status == 404:
                detail = "no /reset_prefix_cache: vLLM serves it with VLLM_SERVER_DEV_MODE=1"
                result = ReplicaResult(url, ReplicaOutcome.UNSUPPORTED, detail)
            else:
                result = ReplicaResult(url, ReplicaOutcome.FAILED, f"/reset_prefix_cache answered {status}")
            results.append(result)
        return ReplicaReport(tuple(results))

    def session_footprint(self, session: str) -> CacheFootprint:
        body = _json(SessionRef(session=session))
        results = self._best_effort("/kvchat/sessions/footprint", body, _as(CacheFootprint))
        return _summed(results) if results else CacheFootprint(0, 0)

    def pin_prefix(self, namespace: str, token_ids: Sequence[int]) -> ReportedPin:
        report = self._report([], "vLLM has no pinning")
        if self._kvchat is None:
            return ReportedPin(0, 0, 0, report)
        body = _json(Pin(namespace=namespace, token_ids=list(token_ids)))
        results = self._kvchat.everywhere("POST", "/kvchat/pin", body, _as(PinResult))
        first = results[0]
        return ReportedPin(first.blocks, first.tokens, min(r.cached for r in results), report)

    def unpin(self, namespace: str) -> int:
        if self._kvchat is None:
            return 0
        body = _json(Unpin(namespace=namespace))
        return sum(r.blocks for r in self._kvchat.everywhere("POST", "/kvchat/unpin", body, _as(Unpinned)))

    def set_session_temperature(self, session: str, temperature: float) -> None:
        """Sent to every replica in the background (a hint for eviction: nothing waits on it, a failure is logged)."""
        body = _json(Temperature(session=session, temperature=temperature))
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._best_effort("/kvchat/sessions/temperature", body, lambda d: d)
            return
        task = loop.create_task(self._in_thread(self._best_effort, "/kvchat/sessions/temperature", body, _none))
        self._background.add(task)
        task.add_done_callback(_forget(self._background))

    def cache_settings(self) -> CacheSettings:
        if self._kvchat is None:
            return CacheSettings()
        return self._kvchat.best_effort("GET", "/kvchat/cache/settings", {}, _as(CacheSettings))[0]

    def configure_cache(self, **changes: object) -> CacheSettings:
        if self._kvchat is None:
            return CacheSettings().changed(**changes)
        body = _json(CacheChanges(changes=changes))
        return self._kvchat.everywhere("POST", "/kvchat/cache/settings", body, _as(CacheSettings))[0]

    def stats(self) -> EngineStats:
        """Every replica's stats, summed (the replicas that answered)."""
        if self._kvchat is None:
            return decode(EngineStats, _ZERO_STATS)
        return _summed(self._kvchat.best_effort("GET", "/kvchat/stats", {}, _as(EngineStats)))

    @staticmethod
    async def _in_thread(fn: Any, *args: Any) -> None:
        await asyncio.to_thread(fn, *args)

    def _best_effort(self, path: str, body: dict[str, Any], decode: Any) -> list[Any]:
        return [] if self._kvchat is None else self._kvchat.best_effort("POST", path, body, decode)

    def _freed(self, path: str, body: dict[str, Any]) -> ReportedInvalidation:
        """An invalidate or a flush: the sum over the kvchat replicas that answered (``EngineUnreachable`` when none
        did), with the report naming the others and the vLLM replicas (which have no such action)."""
        answers, failed = self._each("POST", path, body, _as(InvalidationResult))
        ReplicaSet.log_skipped(path, failed)
        if failed and not answers:
            raise failed[0][1]
        total = _summed(answers) if answers else InvalidationResult(0, 0, 0)
        report = self._report(failed, "vLLM has no per-session or per-namespace cache control")
        return ReportedInvalidation(total.blocks_freed, total.tokens_freed, total.deferred, report)

    def _each(
        self, method: str, path: str, body: dict[str, Any], decode: Callable[[Any], T]
    ) -> tuple[list[T], list[tuple[str, EngineError]]]:
        return ([], []) if self._kvchat is None else self._kvchat.each(method, path, body, decode)

    def _report(self, failed: Sequence[tuple[str, EngineError]], unsupported: str) -> ReplicaReport:
        """Every replica's outcome: a vLLM one ``UNSUPPORTED`` (``unsupported`` says why), a failed one ``FAILED``,
        the rest ``DONE``."""
        failures = dict(failed)
        results = []
        for url in self._replicas.urls:
            if url in self._vllm:
                results.append(ReplicaResult(url, ReplicaOutcome.UNSUPPORTED, unsupported))
            elif url in failures:
                results.append(ReplicaResult(url, ReplicaOutcome.FAILED, str(failures[url])))
            else:
                results.append(ReplicaResult(url, ReplicaOutcome.DONE))
        return ReplicaReport(tuple(results))


def _summed(values: Sequence[Any]) -> Any:
    """Field-wise sum of dataclasses (nested ones and mappings of numbers included): replicas' reports added up."""
    first = values[0]
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return type(first)(**{f.name: _summed([getattr(v, f.name) for v in values]) for f in dataclasses.fields(first)})
    if isinstance(first, Mapping):
        keys = dict.fromkeys(k for v in values for k in v)
        return MappingProxyType({k: _summed([v[k] for v in values if k in v]) for k in keys})
    if isinstance(first, int | float) and not isinstance(first, bool):
        return sum(values)
    return first


def _as(kind: type[T]) -> Callable[[Any], T]:
    """The decoder of a replica's answer of type ``kind``."""
    return functools.partial(decode, kind)


def _json(message: BaseModel) -> dict[str, Any]:
    body: dict[str, Any] = message.model_dump(mode="json")
    return body


def _none(_: Any) -> None:
    return None


def _forget(tasks: set[asyncio.Task[None]]) -> Any:
    def done(task: asyncio.Task[None]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("setting a session temperature failed: %s", task.exception())

    return done


_ZERO_STATS: dict[str, Any] = {
    "running": 0, "waiting": 0, "requests_finished": 0, "prompt_tokens": 0, "cached_tokens": 0,
    "generated_tokens": 0, "steps": 0,
    "kv": dict.fromkeys(("num_blocks", "num_free_blocks", "num_used_blocks", "num_cached_blocks",
                         "num_evictable_blocks", "num_query_tokens", "num_hit_tokens"), 0),
    "cache": {"num_lookups": 0, "num_lookups_hit": 0, "num_query_tokens": 0, "num_hit_tokens": 0,
              "query_tokens_by_type": {}, "hit_tokens_by_type": {}, "blocks_published": 0, "blocks_reused": 0,
              "cached_blocks_by_type": {}, "invalidations": {}},
    "tiers": dict.fromkeys(("memory_blocks_used", "memory_blocks_cached", "pinned_blocks", "disk_blocks",
                            "disk_bytes", "disk_writes", "disk_writes_refused", "disk_quarantined",
                            "promoted_blocks", "demoted_blocks", "expired_blocks"), 0),
}  # fmt: skip
