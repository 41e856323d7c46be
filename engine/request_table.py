"""The requests in flight, keyed by id, and how each one ends: a sampled token becomes a delta, a finish releases its
blocks and reports its stats, an abort or a failure reaches its sink exactly once.

Every method runs under the engine's lock (the facade holds it). Ids pass through three states: *claimed* (being
registered: tokenized and checked, outside the lock), *in flight* (the scheduler knows it), gone. An ``abort`` of a
claimed id is remembered and applied the moment it is registered, so a caller may abort at any time after it handed
the id over, registration included.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.errors import EngineError, InvalidRequestError
from engine.kv.cache_control import CacheControl
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, RequestStats, TokenDelta
from engine.scheduler import Scheduler
from engine.sequence import Sequence as Seq
from engine.sequence import SequenceStatus

if TYPE_CHECKING:
    from engine.sampler import SamplerState
    from engine.tokenizer import IncrementalDetokenizer

Sink = Callable[[GenerationEvent | EngineError], None]

_STATUS = {
    FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
    FinishReason.ABORTED: SequenceStatus.FINISHED_ABORTED,
}


@dataclass(slots=True)
class Request:
    seq: Seq
    sampler_state: SamplerState
    detok: IncrementalDetokenizer
    sink: Sink
    first_token_time: float | None = None
    pieces: list[str] = field(default_factory=list)


@dataclass(slots=True)
class Counters:
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0
    drafted_tokens: int = 0  # suffix drafts verified (engine.spec)
    accepted_tokens: int = 0
    verify_steps: int = 0
    tokens_per_verify_step: dict[int, int] = field(default_factory=dict)  # tokens a verify step gave -> steps


class RequestTable:
    """The in-flight requests of one engine (every method under the engine lock)."""

    def __init__(self, scheduler: Scheduler, cache: CacheControl, max_model_len: int) -> None:
        self._scheduler = scheduler
        self._cache = cache
        self._max_model_len = max_model_len
        self._requests: dict[str, Request] = {}
        self._claimed: dict[str, bool] = {}  # ids being registered -> aborted meanwhile
        self._pending_aborts: set[str] = set()
        self.counters = Counters()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __getitem__(self, request_id: str) -> Request:
        return self._requests[request_id]

    def seqs(self) -> Iterator[Seq]:
        return (r.seq for r in self._requests.values())

    def ids(self) -> list[str]:
        return list(self._requests)

    # ------------------------------------------------------------------ registration

    def claim(self, request_ids: Sequence[str]) -> None:
        """Reserve ids for requests about to be registered. Raises ``InvalidRequestError`` for an id in use."""
        for rid in request_ids:
            if rid in self._requests or rid in self._claimed or request_ids.count(rid) > 1:
                raise InvalidRequestError(f"request id {rid!r} is already in flight")
        self._claimed.update(dict.fromkeys(request_ids, False))

    def unclaim(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._claimed.pop(rid, None)

    def add(self, requests: Sequence[Request]) -> None:
        """Hand claimed requests to the scheduler, all or none (``EngineBusy`` adds none); those aborted while they
        were being registered end before the next step."""
        added: list[str] = []
        try:
            for request in requests:
                self._scheduler.add(request.seq)
                self._requests[request.seq.request_id] = request
                added.append(request.seq.request_id)
        except EngineError:
            for rid in added:
                self._scheduler.abort(rid)
                del self._requests[rid]
            raise
        self._pending_aborts.update(rid for rid in added if self._claimed.get(rid))

    def abort(self, request_id: str) -> None:
        """Stop a request before the next step, wherever it is (a claimed one as soon as it is registered)."""
        if request_id in self._requests:
            self._pending_aborts.add(request_id)
        elif request_id in self._claimed:
            self._claimed[request_id] = True

    def apply_aborts(self) -> None:
        """Between steps: end the aborted requests (their blocks go back before the next schedule)."""
        now = time.monotonic()
        for rid in list(self._pending_aborts):
            req = self._requests.get(rid)
            if req is not None:
                self._scheduler.abort(rid)
                self.finish(req, FinishReason.ABORTED, now)
        self._pending_aborts.clear()

    # ------------------------------------------------------------------ tokens and endings

    def on_token(self, seq: Seq, token: int, now: float) -> None:
        """Append a sampled token, report it (one delta per token, even one with no text) and finish the request
        when it stops."""
        req = self._requests[seq.request_id]
        seq.append_token(token)
        if req.first_token_time is None:
            req.first_token_time = now
        reason: FinishReason | None = None
        text = ""
        if req.sampler_state.is_stop_token(token):
            reason = FinishReason.STOP  # NOTE: the stop token's own text is never emitted
        else:
            text = req.detok.push(token)
            if req.detok.stopped:
                reason = FinishReason.STOP
            elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self._max_model_len:
                reason = FinishReason.LENGTH
        # NOTE: every sampled token is reported in exactly one delta, even when its text is empty (held back, or a
        # stop token), so a stream's token ids always add up to the final event's.
        req.pieces.append(text)
        logprobs = req.sampler_state.logprobs[-1:] if seq.params.logprobs is not None else ()
        req.sink(TokenDelta(seq.request_id, (token,), text, tuple(logprobs)))
        if reason is not None:
            self.finish(req, reason, now)

    def finish(self, req: Request, reason: FinishReason, now: float) -> None:
        seq = req.seq
        tail = req.detok.flush() if reason is not FinishReason.ABORTED else ""
        if tail:
            req.pieces.append(tail)
            req.sink(TokenDelta(seq.request_id, (), tail))
        self._cache.record_finished(seq)  # NOTE: before the blocks are freed (it reads where publishing stopped)
        if not seq.is_finished:
            self._scheduler.finish(seq, _STATUS[reason])
        del self._requests[seq.request_id]
        self._pending_aborts.discard(seq.request_id)
        stats = request_stats(seq, req.first_token_time, now)
        c = self.counters
        c.finished += 1
        c.prompt_tokens += stats.prompt_tokens
        c.cached_tokens += stats.cached_tokens
        c.generated_tokens += stats.completion_tokens
        prompt_logprobs = None if seq.prompt_logprobs is None else tuple(seq.prompt_logprobs)
        logprobs = tuple(req.sampler_state.logprobs) if seq.params.logprobs is not None else None
        text = "".join(req.pieces)
        ids = tuple(seq.output_token_ids)
        req.sink(RequestFinished(seq.request_id, reason, text, ids, stats, prompt_logprobs, logprobs))

    def fail(self, request_id: str, error: EngineError, cause: BaseException | None = None) -> None:
        """End a request with ``error`` (its sink's last event), releasing its blocks."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        self._pending_aborts.discard(request_id)
        if not req.seq.is_finished:
            self._scheduler.abort(request_id)
        if cause is not None:
            error.__cause__ = cause
        with contextlib.suppress(Exception):  # NOTE: a sink that raises has nobody left to tell
            req.sink(error)

    def fail_all(self, error: Callable[[], EngineError]) -> None:
        for rid in list(self._requests):
            self.fail(rid, error())


class Collector:
    """A sink that keeps each request's final event and the errors (``LLMEngine.generate_sync``'s)."""

    def __init__(self) -> None:
        self.finished: dict[str, RequestFinished] = {}
        self.errors: list[EngineError] = []

    def __call__(self, event: GenerationEvent | EngineError) -> None:
        if isinstance(event, RequestFinished):
            self.finished[event.request_id] = event
        elif isinstance(event, EngineError):
            self.errors.append(event)

    def results(self, request_ids: Sequence[str]) -> list[RequestFinished]:
        """The final events of ``request_ids``, in order; raises the first error instead, if any."""
        if self.errors:
            raise self.errors[0]
        return [self.finished[rid] for rid in request_ids]


def request_stats(seq: Seq, first_token_time: float | None, now: float) -> RequestStats:
    ttft = (first_token_time - seq.arrival_time) if first_token_time is not None else 0.0
    decode_s = (now - first_token_time) if first_token_time is not None else 0.0
    n = seq.num_output_tokens
    queue_s = (seq.first_scheduled_time - seq.arrival_time) if seq.first_scheduled_time is not None else 0.0
    return RequestStats(
        prompt_tokens=seq.num_prompt_tokens,
        cached_tokens=seq.num_cached_tokens,
        prefilled_tokens=seq.num_prefilled_tokens,
        completion_tokens=n,
        ttft_s=ttft,
        decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        queue_s=queue_s,
        num_preemptions=seq.num_preemptions,
        prompt_tokens_by_type=seq.spans.tokens_by_type(0, seq.num_prompt_tokens),
        cached_tokens_by_type=seq.spans.tokens_by_type(0, seq.num_cached_tokens),
        cached_tokens_by_tier={
            "memory": seq.num_cached_tokens - seq.num_disk_cached_tokens,
            "disk": seq.num_disk_cached_tokens,
        },
        drafted_tokens=seq.num_drafted_tokens,
        accepted_tokens=seq.num_accepted_tokens,
    )
