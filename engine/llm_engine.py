"""The engine's async facade: a background step loop plus ``generate`` / ``abort`` / ``stats``.

Threading model. One step-loop thread owns the model: it schedules, runs the forward pass (torch releases the GIL),
samples and detokenizes. Callers live on an asyncio loop; ``generate`` registers a request under ``_lock`` (so
``EngineBusy`` is raised to the caller synchronously) and receives its events through an ``asyncio.Queue`` fed with
``call_soon_threadsafe``. Aborts are queued and applied by the step thread between steps.

NOTE: applying aborts between steps (never during one) is what makes them safe: the forward pass writes K/V into the
blocks of every scheduled sequence, and those blocks must not return to the free queue — or be reallocated — while
it runs.

Failure isolation. One request must never fail the others in its batch. A forward pass that raises is re-run on
halves of the batch, down to single requests; only a request whose forward fails alone is failed. A row the sampler
cannot sample (non-finite logits) and a token that fails to detokenize fail that request alone. A failed request's
blocks written in the failed step are zeroed and freed, and never published to the prefix cache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.errors import (
    EmptyPromptError,
    EngineError,
    EngineStopped,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailed,
)
from engine.kv.block_hash import BlockHash, hash_chain, root_hash
from engine.kv.block_meta import GENERATED, UNTYPED, SpanMap, TokenSpan
from engine.kv.cache_stats import CacheStats
from engine.kv.eviction import WeightedChooser
from engine.kv.kv_cache_manager import CacheFootprint, InvalidationResult, KVCacheManager, KVCacheUsage
from engine.kv.session_index import SessionIndex
from engine.kv.tier_config import CacheSettings
from engine.kv.tiers import DiskTier, TierStats, memory_only_stats
from engine.openmp import release_thread_pool
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, RequestStats, TokenDelta
from engine.prompt import SegmentedPrompt, TokenizedPrompt, spans_from_owners
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from engine.sequence import Sequence as Seq
from engine.sequence import SequenceStatus

if TYPE_CHECKING:
    import torch

    from engine.model_runner import ModelRunner
    from engine.sampler import Sampler, SamplerState
    from engine.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("kvchat.engine")

_MAX_RELEASED_SESSIONS = 100_000
_MAX_TEMPERATURES = 100_000
_SWEEP_EVERY_S = 1.0  # how often the memory TTL is applied (with a disk tier)
_EXPIRE_EVERY_S = 60.0  # how often the disk TTL is applied
_SWEEP_MAX_BLOCKS = 256  # blocks one memory-TTL sweep demotes (the copy holds the step loop's lock)
_MAX_PENDING_BYTES = 256 * 1024 * 1024  # K/V copies waiting for the disk writer
RELEASE_REASON = "session_released"  # the invalidation reason release_session's blocks are counted under
ERASE_REASON = "session_erased"
_INTERNAL_ERROR = "internal engine error (see the server log)"

ChatMessages = Sequence[dict[str, str]]
Prompt = ChatMessages | Sequence[int] | str | SegmentedPrompt | TokenizedPrompt
Sink = Callable[[GenerationEvent | EngineError], None]


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Values derived at load time (never written back into ``EngineConfig``)."""

    model_path: str
    fingerprint: str
    architecture: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv: KVCacheUsage
    requests_finished: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    steps: int
    cache: CacheStats  # prefix-cache hits by block type, reuse depth, efficiency, invalidations by reason
    tiers: TierStats  # memory and disk tier occupancy, promotions, demotions, refused writes


@dataclass(frozen=True, slots=True)
class PinResult:
    blocks: int  # full blocks of the pinned prefix
    tokens: int
    cached: int  # of those, cached (and so pinned) right now; the rest are pinned as soon as they are computed


@dataclass(frozen=True, slots=True)
class ErasureResult:
    memory_blocks: int  # freed now, or unpublished and freed when the request holding them ends
    disk_blocks: int


@dataclass(slots=True)
class _Request:
    seq: Seq
    sampler_state: SamplerState
    detok: IncrementalDetokenizer
    sink: Sink
    session: str | None = None
    first_token_time: float | None = None
    pieces: list[str] = field(default_factory=list)


@dataclass(slots=True)
class _Counters:
    finished: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0


class LLMEngine:
    """Load once, ``await start()``, then ``generate`` from any number of coroutines."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._info: EngineInfo | None = None
        self._runner: ModelRunner | None = None
        self._tokenizer: Tokenizer | None = None
        self._sampler: Sampler | None = None
        self._kv: KVCacheManager | None = None
        self._scheduler: Scheduler | None = None
        self._requests: dict[str, _Request] = {}
        self._pending_aborts: set[str] = set()
        self._roots: dict[str, BlockHash] = {}
        self._sessions = SessionIndex()
        self._session_roots: dict[str, BlockHash] = {}  # the namespace root each recorded session's chain hangs from
        # NOTE: remembered (bounded) so a request that finishes after its session closed does not re-record it.
        self._released_sessions: dict[str, None] = {}
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._settings = self.config.cache_settings
        self._tier: DiskTier | None = None
        self._temperatures: dict[str, float] = {}  # session -> semantic temperature (eviction weighs it)
        self._pins: dict[str, list[BlockHash]] = {}  # namespace -> its pinned prefix's hashes
        self._last_sweep = self._last_expire = time.monotonic()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loaded: concurrent.futures.Future[EngineInfo] | None = None  # set while a loop thread exists
        self._counters = _Counters()

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> EngineInfo:
        """Resolve and load the model, size the KV pool (blocking; seconds)."""
        if self._info is not None:
            if self._tier is None and self._runner is not None and self._wants_disk_tier():
                self._tier = self._open_disk_tier(str(self.config.disk_cache_dir), self._runner)
            return self._info
        from engine.model.loader import fingerprint as model_fingerprint
        from engine.model_runner import ModelRunner
        from engine.sampler import Sampler
        from engine.tokenizer import Tokenizer

        runner = ModelRunner.from_config(self.config)
        self._runner = runner
        self._tokenizer = Tokenizer(runner.model_path)
        self._sampler = Sampler(runner.device)
        self._kv = KVCacheManager(runner.num_blocks, self.config.block_size, self.config.enable_prefix_caching)
        self._kv.pool.chooser = WeightedChooser(lambda: self._settings, self._temperature_of)
        self._scheduler = Scheduler(SchedulerConfig.from_engine_config(self.config), self._kv)
        max_len = min(runner.max_model_len, self.config.max_model_len or runner.max_model_len)
        self._info = EngineInfo(
            model_path=str(runner.model_path),
            fingerprint=runner.fingerprint or model_fingerprint(runner.model_path),
            architecture=runner.architecture,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            num_blocks=runner.num_blocks,
            block_size=self.config.block_size,
            kv_bytes_per_token=runner.kv_bytes_per_token,
            max_model_len=max_len,
            vocab_size=runner.vocab_size,
        )
        if self._wants_disk_tier():
            self._tier = self._open_disk_tier(str(self.config.disk_cache_dir), runner)
        log.info(
            "engine loaded: %s (%s, %s on %s), %d KV blocks of %d tokens",
            self._info.model_path,
            self._info.architecture,
            self._info.dtype,
            self._info.device,
            self._info.num_blocks,
            self._info.block_size,
        )
        release_thread_pool()  # loading ran parallel regions on this thread (engine/openmp.py)
        return self._info

    async def start(self) -> EngineInfo:
        """Start the step loop thread; it loads the model first (see ``engine.openmp`` for why on that thread).

        Concurrent calls share one load; cancelling a caller does not cancel the load (a later call picks it up).
        """
        if self._loaded is None:
            self._loaded = concurrent.futures.Future()
            self._stopping = threading.Event()  # NOTE: one per loop thread, so a stop() never races a new start()
            self._thread = threading.Thread(
                target=self._run_loop, args=(self._loaded, self._stopping), name="kvchat-engine", daemon=True
            )
            self._thread.start()
        loaded = self._loaded
        try:
            info = await asyncio.shield(asyncio.wrap_future(loaded))
        except asyncio.CancelledError:
            raise
        except BaseException:
            if self._loaded is loaded:  # the loop thread has ended: loading failed; a later start() retries
                self._loaded, self._thread = None, None
            raise
        if self._loaded is not loaded:
            raise EngineStopped("the engine was stopped while it was loading")
        return info

    async def stop(self) -> None:
        """Stop the step loop (after a load in progress finishes); requests still in flight end with EngineStopped."""
        thread, stopping = self._thread, self._stopping
        self._thread, self._loaded = None, None
        if thread is None:
            return
        stopping.set()
        self._wakeup.set()
        await asyncio.to_thread(thread.join)
        with self._lock:
            for request_id in list(self._requests):
                self._finish_with_error(request_id, EngineStopped("the engine stopped"))
        await asyncio.to_thread(self.close_disk_tier)

    def close_disk_tier(self) -> None:
        """Write what memory holds back to disk (so the next process starts warm) and close the tier; ``stop()``
        calls it. Blocks (the writes). A later ``start()`` or ``load()`` opens the tier again."""
        with self._lock:
            tier, self._tier = self._tier, None
            if tier is None:
                return
            tier.demote_all()
            if self._kv is not None:
                self._kv.pool.capture_evictions = False
                self._kv.pool.evicted.clear()
        tier.close()

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineStopped("the engine is not loaded")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise EngineStopped("the engine is not loaded")
        return self._tokenizer

    @property
    def is_running(self) -> bool:
        """The step loop is serving: started and its model loaded."""
        loaded = self._loaded
        return self._thread is not None and loaded is not None and loaded.done() and loaded.exception() is None

    # ------------------------------------------------------------------ requests

    def tokenize(self, prompt: Prompt) -> list[int]:
        """Chat messages → the model's chat template; a string → plain encoding; token ids pass through; a
        ``SegmentedPrompt`` → the chat template over its messages (the same ids as the joined messages)."""
        return self.tokenize_prompt(prompt).token_ids

    def prompt_token_floor(self, texts: Iterable[str]) -> int:
        """A lower bound of the tokens ``texts`` encode to, from their length alone (no tokenizing): a caller can
        refuse a prompt that can never fit before paying for its encoding."""
        return sum(len(t) for t in texts) // self.tokenizer.max_token_chars

    @property
    def prompt_limit(self) -> int:
        """The most tokens a request may hold (prompt and reply): the model's context or the KV pool, the smaller."""
        return min(self.info.max_model_len, self.info.num_blocks * self.info.block_size)

    def tokenize_prompt(self, prompt: Prompt) -> TokenizedPrompt:
        """``tokenize``, plus the token spans of a ``SegmentedPrompt``'s segments and template (none otherwise).

        A ``TokenizedPrompt`` (what this returned earlier, e.g. in a worker thread) passes through, its ids checked.
        """
        if isinstance(prompt, TokenizedPrompt):
            return TokenizedPrompt(self.tokenize_prompt(prompt.token_ids).token_ids, prompt.spans)
        if isinstance(prompt, SegmentedPrompt):
            if not prompt.messages:
                raise EmptyPromptError()
            parts = [(m.role, [s.text for s in m.segments]) for m in prompt.messages]
            ids, owners = self.tokenizer.apply_chat_template_segments(parts, prompt.add_generation_prompt)
            return TokenizedPrompt(ids, spans_from_owners(owners, prompt.segments))
        if isinstance(prompt, str):
            return TokenizedPrompt(self.tokenizer.encode(prompt))
        items: list[object] = list(prompt)
        if not items:
            raise EmptyPromptError()
        ids = [t for t in items if isinstance(t, int) and not isinstance(t, bool)]
        if len(ids) == len(items):
            bad = [t for t in ids if not 0 <= t < self.info.vocab_size]
            if bad:
                raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self.info.vocab_size})")
            return TokenizedPrompt(ids)
        messages = [m for m in items if isinstance(m, dict)]
        if len(messages) == len(items):
            return TokenizedPrompt(self.tokenizer.apply_chat_template(messages))
        raise InvalidRequestError("prompt must be chat messages, a string, or a list of token ids")

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "default",
        request_id: str | None = None,
        session: str | None = None,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Stream ``TokenDelta`` events (one per sampled token, then one with any text held back to the end), then one
        ``RequestFinished``. Closing the iterator early aborts the request.

        Raises ``EngineBusy`` (admission), ``InvalidRequestError`` subclasses, ``EngineStopped``.
        """
        if not self.is_running:
            raise EngineStopped("the engine is not running")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[GenerationEvent | EngineError] = asyncio.Queue()

        def sink(event: GenerationEvent | EngineError) -> None:
            # NOTE: the caller's loop may close before the step thread applies the abort its generator's finalizer
            # queued; an event nobody can receive is dropped, never raised into the step thread (which would fail
            # every other request in flight, or kill the thread).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(queue.put_nowait, event)

        rid = self.submit(prompt, params or SamplingParams(), namespace, sink, request_id, session)
        done = False
        try:
            while True:
                event = await queue.get()
                if isinstance(event, EngineError):
                    done = True
                    raise event
                yield event
                if isinstance(event, RequestFinished):
                    done = True
                    return
        finally:
            if not done:
                self.abort(rid)

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        namespace: str,
        sink: Sink,
        request_id: str | None = None,
        session: str | None = None,
    ) -> str:
        """Register a request whose events go to ``sink`` (called from the step thread). Returns its id.

        ``session`` (optional) names the conversation the request belongs to, so ``release_session`` can later free
        the blocks only that conversation uses.
        """
        return self.submit_many([(prompt, params, namespace, sink)], [request_id], session)[0]

    def submit_many(
        self,
        requests: Sequence[tuple[Prompt, SamplingParams, str, Sink]],
        request_ids: Sequence[str | None] | None = None,
        session: str | None = None,
    ) -> list[str]:
        """Register several requests at once: all or none, and the step loop sees them together (one batch)."""
        from engine.tokenizer import IncrementalDetokenizer

        if self._sampler is None or self._scheduler is None:
            raise EngineStopped("the engine is not loaded")
        ids = list(request_ids or [None] * len(requests))
        prepared: list[tuple[str, Seq, _Request]] = []
        for (prompt, params, namespace, sink), request_id in zip(requests, ids, strict=True):
            tokenized = self.tokenize_prompt(prompt)
            token_ids = tokenized.token_ids
            self._check_fits(len(token_ids), params.max_tokens)
            rid = request_id or uuid.uuid4().hex
            spans = SpanMap(tokenized.spans or (TokenSpan(0, len(token_ids), UNTYPED),), fill=GENERATED)
            seq = Seq(rid, token_ids, params, self._root(namespace), spans=spans, session=session)
            eos = self._tokenizer.eos_token_ids if self._tokenizer else ()
            state = self._sampler.new_state(params, eos, request_id=rid)
            detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop)
            prepared.append((rid, seq, _Request(seq, state, detok, sink, session)))
        with self._lock:
            rids = [rid for rid, _, _ in prepared]
            for rid in rids:
                if rid in self._requests or rids.count(rid) > 1:
                    raise InvalidRequestError(f"request id {rid!r} is already in flight")
            added: list[str] = []
            try:
                for rid, seq, request in prepared:
                    self._scheduler.add(seq)  # may raise EngineBusy
                    self._requests[rid] = request
                    added.append(rid)
                if self._tier is not None:
                    for _, seq, _ in prepared:
                        if not seq.params.prompt_logprobs:
                            self._tier.start_prefetch(seq)
            except EngineError:
                for rid in added:  # all or none
                    self._scheduler.abort(rid)
                    del self._requests[rid]
                raise
            if session is not None:
                self._released_sessions.pop(session, None)  # a reopened session is recorded again
        self._wakeup.set()
        return rids

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are released before the next step."""
        with self._lock:
            if request_id in self._requests:
                self._pending_aborts.add(request_id)
        self._wakeup.set()

    def release_session(self, session: str) -> int:
        """Free the cached blocks that only ``session`` used (never shared or in-use ones). Returns blocks freed."""
        assert self._kv is not None
        with self._lock:
            self._released_sessions[session] = None
            if len(self._released_sessions) > _MAX_RELEASED_SESSIONS:
                del self._released_sessions[next(iter(self._released_sessions))]
            self._session_roots.pop(session, None)
            self._temperatures.pop(session, None)
            hashes = self._sessions.release(session)
            if self._tier is not None:  # demoted, not dropped: a customer who comes back finds the session on disk
                self._tier.demote(self._kv.records(hashes))
            return self._kv.evict_cached(hashes, reason=RELEASE_REASON)

    def erase_session(self, session: str, namespace: str) -> ErasureResult:
        """Erasure: remove the session's blocks from every tier (a shared prefix another session wants stays).

        Memory: its recorded chain and every block a request of the session published, with their dependents; disk:
        the same, and every block the session owned there (also those of an earlier process).
        """
        if self._kv is None:
            raise EngineStopped("the engine is not loaded")
        root = self._root(namespace)
        with self._lock:
            chain = list(self._sessions.chain(session)) if self._session_roots.get(session) == root else []
            protected = self._protected_from(session)
            self._released_sessions[session] = None
            self._sessions.release(session)
            self._session_roots.pop(session, None)
            self._temperatures.pop(session, None)
            hashes = list(dict.fromkeys(chain + self._kv.owned_by(session, root)))
            result = self._kv.invalidate(hashes, root=root, protected=protected, reason=ERASE_REASON)
        disk = self._tier.erase_owner(session, hashes, root, protected) if self._tier is not None else 0
        return ErasureResult(result.blocks_freed + result.deferred, disk)

    # ------------------------------------------------------------------ cache settings, pinning, eviction hints

    def cache_settings(self) -> CacheSettings:
        return self._settings

    def configure_cache(self, **changes: object) -> CacheSettings:
        """Change cache settings while the engine runs (validated; ``InvalidRequestError`` names a bad one)."""
        with self._lock:
            settings = self._settings.changed(**changes)
            if (
                self._kv is not None
                and self._pinned_wanted(self._pins) > settings.pin_max_fraction * self._kv.num_blocks
            ):
                raise InvalidRequestError(
                    f"pin_max_fraction={settings.pin_max_fraction} is below the share pinned now; unpin first"
                )
            self._settings = settings
            if self._tier is not None:
                self._tier.store.set_limits(
                    max_bytes=settings.disk_max_bytes, min_free_bytes=settings.min_free_bytes, ttl_s=settings.disk_ttl_s
                )
        return settings

    def pin_prefix(self, namespace: str, token_ids: Sequence[int]) -> PinResult:
        """Pin the full blocks of ``token_ids`` (a prefix every prompt of ``namespace`` starts with: the system and
        policy text) in memory: never evicted nor demoted while pinned. Replaces the namespace's earlier pin.

        Raises ``InvalidRequestError`` when all pins together would exceed ``pin_max_fraction`` of the pool.
        """
        if self._kv is None:
            raise EngineStopped("the engine is not loaded")
        ids = self.tokenize_prompt(list(token_ids)).token_ids if token_ids else []
        root = self._root(namespace)
        hashes = hash_chain(root, ids, self.info.block_size)
        with self._lock:
            pins = {**self._pins, namespace: hashes}
            limit = int(self._settings.pin_max_fraction * self._kv.num_blocks)
            if self._pinned_wanted(pins) > limit:
                raise InvalidRequestError(
                    f"pinning {len(hashes)} blocks would exceed the pinned share of the pool ({limit} blocks, "
                    f"pin_max_fraction={self._settings.pin_max_fraction})"
                )
            old = self._pins.get(namespace, [])
            self._kv.unpin([h for h in old if h not in set(hashes)])
            self._pins[namespace] = hashes
            self._kv.pin(hashes)
            cached = self._kv.num_cached(hashes)
        return PinResult(len(hashes), len(hashes) * self.info.block_size, cached)

    def unpin(self, namespace: str) -> int:
        """Unpin the namespace's prefix (its blocks age out like any other). Returns blocks unpinned now."""
        if self._kv is None:
            raise EngineStopped("the engine is not loaded")
        with self._lock:
            return self._kv.unpin(self._pins.pop(namespace, []))

    def set_session_temperature(self, session: str, temperature: float) -> None:
        """The session's semantic temperature (0 cold .. 1 hot): eviction takes a cold topic's blocks first."""
        with self._lock:
            self._temperatures.pop(session, None)
            self._temperatures[session] = float(temperature)
            if len(self._temperatures) > _MAX_TEMPERATURES:
                del self._temperatures[next(iter(self._temperatures))]

    def _temperature_of(self, session: str | None) -> float | None:
        return None if session is None else self._temperatures.get(session)

    @staticmethod
    def _pinned_wanted(pins: dict[str, list[BlockHash]]) -> int:
        return len({h for hashes in pins.values() for h in hashes})

    def invalidate(
        self,
        namespace: str,
        *,
        session: str | None = None,
        from_position: int | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        reason: str = "invalidated",
    ) -> InvalidationResult:
        """Free cached blocks whose context changed, and every cached block that depends on them.

        Either ``session`` + ``from_position`` (the first token position of the session's conversation that changed:
        its recorded chain and its in-flight requests from the block holding that position on) or ``block_hashes``
        (those blocks; with ``session``, that session's blocks are not protected from it). Only ``namespace``'s
        blocks are reached. Never freed: a block another session's recorded chain lists, or a request of another
        session holds; a block a request of this session (or one without a session) holds is unpublished now and
        freed when the request ends, and that request publishes nothing from there on. The session's later turns are
        recorded as usual. ``reason`` keys the stats (``EngineStats.cache.invalidations``).
        """
        if self._kv is None:
            raise EngineStopped("the engine is not loaded")
        if (from_position is None) == (block_hashes is None) or (from_position is not None and session is None):
            raise InvalidRequestError("invalidate() needs session and from_position, or block_hashes")
        if from_position is not None and (isinstance(from_position, bool) or not isinstance(from_position, int)):
            raise InvalidRequestError(f"from_position must be an integer >= 0, got {from_position!r}")
        if from_position is not None and from_position < 0:
            raise InvalidRequestError(f"from_position must be an integer >= 0, got {from_position!r}")
        root = self._root(namespace)
        with self._lock:
            targets = list(block_hashes or ())
            if from_position is not None and session is not None:
                targets += self._cut_session(session, root, from_position // self.info.block_size)
            protected = self._protected_from(session)
            result = self._kv.invalidate(targets, root=root, protected=protected, reason=reason)
            if self._tier is not None:  # NOTE: the disk copies of the subtree go too (the index knows each parent)
                self._tier.remove(targets, root, protected)
            return result

    def flush_namespace(self, namespace: str, reason: str = "flushed") -> InvalidationResult:
        """Free every cached block of ``namespace`` (all its sessions' chains, its shared prefixes); no other
        namespace's block is reached. A block a running request holds is unpublished now and freed when the request
        ends, and that request publishes nothing from there on. The namespace's sessions keep no recorded chain.
        """
        if self._kv is None:
            raise EngineStopped("the engine is not loaded")
        root = self._root(namespace)
        with self._lock:
            for session in [s for s, r in self._session_roots.items() if r == root]:
                self._sessions.truncate(session, 0)
            result = self._kv.flush_root(root, reason=reason)
            if self._tier is not None:
                self._tier.store.remove_root(root)
            return result

    def session_footprint(self, session: str) -> CacheFootprint:
        """The blocks of ``session``'s recorded chain that are cached right now (shared ones included)."""
        if self._kv is None:
            raise EngineStopped("the engine is not loaded")
        with self._lock:
            blocks = self._kv.num_cached(self._sessions.chain(session))
        return CacheFootprint(blocks, blocks * self.info.block_size)

    def _cut_session(self, session: str, root: BlockHash, first_block: int) -> list[BlockHash]:
        """The session's hashes from ``first_block`` on (recorded chain and in-flight requests), which stop there."""
        assert self._kv is not None
        targets: list[BlockHash] = []
        if self._session_roots.get(session) == root:
            targets += self._sessions.chain(session)[first_block:]
            self._sessions.truncate(session, first_block)
        for rid, req in self._requests.items():
            seq = req.seq
            if req.session == session and seq.root == root:
                targets += self._kv.request_hashes(rid)[first_block:]
                # NOTE: on the sequence too: a waiting (or preempted) request holds no blocks yet; the scheduler
                # applies the limit when it admits it.
                seq.publish_limit = first_block if seq.publish_limit is None else min(seq.publish_limit, first_block)
                self._kv.stop_publishing(rid, first_block)
        return targets

    def _protected_from(self, session: str | None) -> set[BlockHash]:
        """Hashes an invalidation on behalf of ``session`` must keep: other sessions' chains and running requests."""
        assert self._kv is not None
        protected = self._sessions.wanted_by_others(session)
        for rid, req in self._requests.items():
            if req.session is not None and req.session != session:
                protected.update(self._kv.request_hashes(rid))
        return protected

    def stats(self) -> EngineStats:
        if self._scheduler is None or self._kv is None:
            raise EngineStopped("the engine is not loaded")
        with self._lock:
            c = self._counters
            return EngineStats(
                running=self._scheduler.num_running,
                waiting=self._scheduler.num_waiting,
                kv=self._kv.usage(),
                requests_finished=c.finished,
                prompt_tokens=c.prompt_tokens,
                cached_tokens=c.cached_tokens,
                generated_tokens=c.generated_tokens,
                steps=c.steps,
                cache=self._kv.cache_stats(),
                tiers=self._tier_stats(),
            )

    def _tier_stats(self) -> TierStats:
        assert self._kv is not None
        usage, pinned = self._kv.usage(), self._kv.pool.num_pinned
        if self._tier is None:
            return memory_only_stats(usage.num_used_blocks, usage.num_cached_blocks, pinned)
        return self._tier.stats(usage.num_used_blocks, usage.num_cached_blocks, pinned)

    # ------------------------------------------------------------------ synchronous driving (tests, benchmarks)

    def run_until_idle(self) -> None:
        """Drive steps on the calling thread until no work is left (only when the loop thread is not running)."""
        if self._thread is not None:
            raise InvalidRequestError("run_until_idle() cannot be used while the step loop runs")
        try:
            while True:
                if self._step():
                    continue
                if not self._loading():
                    break
                self._wakeup.wait(0.05)  # NOTE: a prefix is loading from disk; the loader wakes us when it is in
                self._wakeup.clear()
        except Exception:
            self._fail_in_flight()
            raise
        finally:
            release_thread_pool()

    def generate_sync(
        self, prompts: Sequence[Prompt], params: SamplingParams, namespace: str = "default"
    ) -> list[RequestFinished]:
        """Submit all prompts at once, run them in one continuous batch, return their results in order."""
        if self._thread is not None:
            raise InvalidRequestError("generate_sync() cannot be used while the step loop runs; use generate()")
        self.load()
        results: dict[str, RequestFinished] = {}
        errors: list[EngineError] = []

        def sink(event: GenerationEvent | EngineError) -> None:
            if isinstance(event, RequestFinished):
                results[event.request_id] = event
            elif isinstance(event, EngineError):
                errors.append(event)

        ids: list[str] = []
        try:
            for prompt in prompts:
                ids.append(self.submit(prompt, params, namespace, sink))
        except EngineError:
            # NOTE: all or nothing: the prompts already queued must not run later, in another call's batch.
            for rid in ids:
                self.abort(rid)
            self.run_until_idle()
            raise
        self.run_until_idle()
        if errors:
            raise errors[0]
        return [results[i] for i in ids]

    # ------------------------------------------------------------------ the step loop

    def _run_loop(self, loaded: concurrent.futures.Future[EngineInfo], stopping: threading.Event) -> None:
        try:
            info = self.load()
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            loaded.set_exception(exc)
            return
        loaded.set_result(info)
        pool_held = True
        while not stopping.is_set():
            self._wakeup.clear()
            try:
                self._maintain()
                worked = self._step()
            except Exception:
                log.exception("engine step failed; failing the requests in flight")
                self._fail_in_flight()
                worked = True
            if worked:
                pool_held = True
                continue
            if pool_held:  # NOTE: an idle pool still counts against every other thread's (engine/openmp.py)
                release_thread_pool()
                pool_held = False
            self._wakeup.wait(0.1)
        release_thread_pool()

    def _loading(self) -> bool:
        assert self._scheduler is not None
        with self._lock:
            return any(seq.loading for seq in self._scheduler.waiting)

    def _maintain(self) -> None:
        """Tier upkeep between steps: the memory TTL (idle blocks to disk) and the disk TTL."""
        tier = self._tier
        if tier is None:
            return
        now = time.monotonic()
        if now - self._last_sweep >= _SWEEP_EVERY_S:
            self._last_sweep = now
            with self._lock:
                tier.sweep_idle(now - self._settings.memory_ttl_s, _SWEEP_MAX_BLOCKS)
        if now - self._last_expire >= _EXPIRE_EVERY_S:
            self._last_expire = now
            tier.store.expire()

    def _step(self) -> bool:
        assert self._scheduler is not None and self._sampler is not None
        with self._lock:
            self._apply_aborts()
            if self._tier is not None:
                self._tier.install_loaded()
            out = self._scheduler.schedule()
            if self._tier is not None:
                self._tier.drain_evictions()  # NOTE: before the forward pass overwrites the blocks handed out
            for seq in out.rejected:
                self._finish_with_error(
                    seq.request_id,
                    PromptTooLongError(
                        seq.num_tokens,
                        seq.params.max_tokens,
                        self.info.num_blocks * self.info.block_size,
                        "KV cache pool",
                    ),
                )
        if out.is_empty:
            return False
        computed, logits, failed = self._forward_isolated(out.scheduled)
        sampled = [s for s in computed if s.need_logits]
        outcomes = self._sampler.sample(logits, [self._requests[s.seq.request_id].sampler_state for s in sampled])
        tokens: list[tuple[Seq, int]] = []
        for item, outcome in zip(sampled, outcomes, strict=True):
            if isinstance(outcome, int):
                tokens.append((item.seq, outcome))
            else:
                failed.append((item, outcome.reason))
        now = time.monotonic()
        with self._lock:
            for item, reason in failed:  # NOTE: before update_after_step, so none of their blocks is published
                self._fail_scheduled(item, reason)
            self._scheduler.update_after_step(out)
            self._counters.steps += 1
            for seq, token in tokens:
                self._on_token_isolated(seq, token, now)
        return True

    def _forward_isolated(
        self, scheduled: list[ScheduledSeq]
    ) -> tuple[list[ScheduledSeq], torch.Tensor, list[tuple[ScheduledSeq, str]]]:
        """Run the forward pass; when it raises, re-run halves of the batch until the requests that fail alone are
        found. Returns the items computed, their logits (rows of those needing logits, in order) and the failures.

        NOTE: re-running is safe because nothing has advanced yet: a forward only writes the K/V of positions
        ``start_pos .. start_pos + n - 1`` of each item into that item's own, not yet published blocks (shared
        prefix blocks are full and lie before ``start_pos``), and the scheduler's state changes only in
        ``update_after_step``. A re-run writes the same positions into the same slots before any query reads them
        (``engine/model/llama.py`` ``_layer`` stores each layer's K/V before it attends).
        """
        import torch  # NOTE: not at module level: the backend imports this module and must not pull in torch

        assert self._runner is not None
        try:
            items = _batch_items(scheduled)
            logits = self._runner.forward(items)
            for s, item in zip(scheduled, items, strict=True):
                if item.prompt_logprobs is not None:
                    s.seq.store_prompt_logprobs(s.start_pos, item.prompt_logprobs)
            return scheduled, logits, []
        except Exception as exc:  # noqa: BLE001 - isolated below; the culprit's error is logged and reported
            if len(scheduled) == 1:
                return [], self._no_logits(), [(scheduled[0], f"forward raised {type(exc).__name__}: {exc}")]
            log.warning("a forward pass of %d requests failed (%r); re-running it in halves", len(scheduled), exc)
        half = len(scheduled) // 2
        first, first_logits, first_failed = self._forward_isolated(scheduled[:half])
        second, second_logits, second_failed = self._forward_isolated(scheduled[half:])
        return first + second, torch.cat([first_logits, second_logits]), first_failed + second_failed

    def _no_logits(self) -> torch.Tensor:
        import torch

        return torch.empty((0, self.info.vocab_size), dtype=torch.float32)

    def _fail_scheduled(self, item: ScheduledSeq, reason: str) -> None:
        """Fail one request of the step: zero the blocks the step was writing for it, free them, tell its sink."""
        assert self._runner is not None
        rid = item.seq.request_id
        log.error("request %s failed in an engine step (the rest of the batch goes on): %s", rid, reason)
        if rid not in self._requests:
            return
        # NOTE: the failed step may have left NaN or garbage K/V there. Padded attention reads masked slots of
        # reused blocks and multiplies them by 0, and 0 * NaN is NaN: a later owner of the block must find zeros.
        bs = self.info.block_size
        end = item.start_pos + item.num_new_tokens
        self._runner.clear_blocks(item.block_table[item.start_pos // bs : -(-end // bs)])
        self._finish_with_error(rid, RequestFailed(_INTERNAL_ERROR))

    def _on_token_isolated(self, seq: Seq, token: int, now: float) -> None:
        """``_on_token``, failing only this request when detokenizing or reporting its token raises."""
        try:
            self._on_token(seq, token, now)
        except Exception as exc:  # one request's detokenizer or sink must not fail the batch
            log.exception("request %s failed after its token was sampled", seq.request_id)
            self._finish_with_error(seq.request_id, RequestFailed(_INTERNAL_ERROR), cause=exc)

    def _on_token(self, seq: Seq, token: int, now: float) -> None:
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
            elif seq.num_output_tokens >= seq.params.max_tokens or seq.num_tokens >= self.info.max_model_len:
                reason = FinishReason.LENGTH
        # NOTE: every sampled token is reported in exactly one delta, even when its text is empty (held back, or a
        # stop token), so a stream's token ids always add up to the final event's.
        req.pieces.append(text)
        req.sink(TokenDelta(seq.request_id, (token,), text))
        if reason is not None:
            self._finish(req, reason, now)

    def _finish(self, req: _Request, reason: FinishReason, now: float) -> None:
        seq = req.seq
        tail = req.detok.flush() if reason is not FinishReason.ABORTED else ""
        if tail:
            req.pieces.append(tail)
            req.sink(TokenDelta(seq.request_id, (), tail))
        status = {
            FinishReason.STOP: SequenceStatus.FINISHED_STOPPED,
            FinishReason.LENGTH: SequenceStatus.FINISHED_LENGTH,
            FinishReason.ABORTED: SequenceStatus.FINISHED_ABORTED,
        }[reason]
        assert self._scheduler is not None
        if req.session is not None and req.session not in self._released_sessions:
            assert self._kv is not None
            # NOTE: recorded before the blocks are freed, while the request still knows where it stopped publishing.
            chain = self._kv.session_chain(seq.request_id, seq.root, seq.all_token_ids, seq.publish_limit)
            self._sessions.record(req.session, chain)
            self._session_roots[req.session] = seq.root
        if not seq.is_finished:
            self._scheduler.finish(seq, status)
        del self._requests[seq.request_id]
        self._pending_aborts.discard(seq.request_id)
        stats = _request_stats(seq, req.first_token_time, now)
        c = self._counters
        c.finished += 1
        c.prompt_tokens += stats.prompt_tokens
        c.cached_tokens += stats.cached_tokens
        c.generated_tokens += stats.completion_tokens
        logprobs = None if seq.prompt_logprobs is None else tuple(seq.prompt_logprobs)
        text = "".join(req.pieces)
        req.sink(RequestFinished(seq.request_id, reason, text, tuple(seq.output_token_ids), stats, logprobs))

    def _apply_aborts(self) -> None:
        assert self._scheduler is not None
        now = time.monotonic()
        for rid in list(self._pending_aborts):
            req = self._requests.get(rid)
            if req is not None:
                self._scheduler.abort(rid)
                self._finish(req, FinishReason.ABORTED, now)
        self._pending_aborts.clear()

    def _fail_in_flight(self) -> None:
        """After a step failed outside the isolated parts (a scheduler bug): fail every request in flight, releasing
        its blocks, so the engine can serve on."""
        with self._lock:
            for rid in list(self._requests):
                self._finish_with_error(rid, EngineError(_INTERNAL_ERROR))

    def _finish_with_error(self, request_id: str, error: EngineError, cause: BaseException | None = None) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        assert self._scheduler is not None
        self._pending_aborts.discard(request_id)
        if not req.seq.is_finished:
            self._scheduler.abort(request_id)
        if cause is not None:
            error.__cause__ = cause
        with contextlib.suppress(Exception):  # NOTE: a sink that raises has nobody left to tell
            req.sink(error)

    # ------------------------------------------------------------------ helpers

    def _wants_disk_tier(self) -> bool:
        return bool(self.config.disk_cache_dir) and self.config.enable_prefix_caching

    def _open_disk_tier(self, directory: str, runner: ModelRunner) -> DiskTier:
        from engine.kv.disk_store import DiskStore
        from engine.kv.disk_writer import DiskWriter

        assert self._kv is not None
        settings = self._settings
        store = DiskStore(
            directory,
            self._kv_fingerprint(),
            max_bytes=settings.disk_max_bytes,
            min_free_bytes=settings.min_free_bytes,
            ttl_s=settings.disk_ttl_s,
        )
        log.info("disk tier at %s: %d blocks from earlier runs", directory, store.stats().blocks)
        # NOTE: a bounded queue: each pending block holds a copy of its K/V in RAM (368 KiB for SmolLM2 in bf16)
        pending = max(64, min(1024, _MAX_PENDING_BYTES // max(1, self.info.kv_bytes_per_token * self.info.block_size)))
        return DiskTier(store, DiskWriter(store, max_pending_blocks=pending), self._kv, runner, self._wakeup.set)

    def _kv_fingerprint(self) -> str:
        """What K/V on disk must match to be reused: the model and tokenizer, and everything that changes K/V bits
        (dtype, weight quantization, block geometry, the CPU's kernel family)."""
        import hashlib

        import torch

        info, config = self.info, self.config
        cpu = torch.backends.cpu.get_cpu_capability() if info.device == "cpu" else info.device
        parts = [info.fingerprint, info.dtype, str(config.quantization), str(config.packed_weights), cpu]
        parts += [str(info.block_size), str(info.kv_bytes_per_token)]
        return hashlib.sha256("\x00".join(parts).encode()).hexdigest()

    def _root(self, namespace: str) -> BlockHash:
        root = self._roots.get(namespace)
        if root is None:
            root = self._roots[namespace] = root_hash(self.info.fingerprint, namespace)
        return root

    def _check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        if prompt_tokens == 0:
            raise EmptyPromptError()
        info = self.info
        if prompt_tokens + max_tokens > info.max_model_len:
            raise PromptTooLongError(prompt_tokens, max_tokens, info.max_model_len)
        pool_tokens = info.num_blocks * info.block_size
        if prompt_tokens + max_tokens > pool_tokens:
            raise PromptTooLongError(prompt_tokens, max_tokens, pool_tokens, "KV cache pool")


def _batch_items(scheduled: list[ScheduledSeq]) -> list[BatchItemT]:
    from engine.model_runner import BatchItem

    return [
        BatchItem(
            s.token_ids,
            s.start_pos,
            s.block_table,
            s.need_logits,
            prompt=s.start_pos + s.num_new_tokens <= s.seq.num_prompt_tokens,
            request_id=s.seq.request_id,
            logprob_targets=s.seq.logprob_targets(s.start_pos, s.start_pos + s.num_new_tokens),
        )
        for s in scheduled
    ]


def _request_stats(seq: Seq, first_token_time: float | None, now: float) -> RequestStats:
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
    )


if TYPE_CHECKING:
    from engine.model_runner import BatchItem as BatchItemT
