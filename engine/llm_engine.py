"""The engine's facade: load the model, start and stop the step loop, submit, stream and abort requests, session and
cache control, stats. The parts do the work: ``engine_core`` (the step loop and its failure isolation),
``request_table`` (the requests in flight and how each ends), ``prompt_encoder`` (prompt forms, the prompt limit),
``kv.cache_control`` (invalidation, sessions, pins, the disk tier).

Threading model. One step-loop thread owns the model: it schedules, runs the forward pass (torch releases the GIL),
samples and detokenizes. Callers live on an asyncio loop. ``generate`` is the one bridge from the step thread to
asyncio: a request's events reach its ``asyncio.Queue`` through the caller loop's ``LoopBridge`` (one wake-up of the
loop per step's burst of events, not one per token). Aborts are queued and
applied by the step thread between steps.

NOTE: applying aborts between steps (never during one) is what makes them safe: the forward pass writes K/V into the
blocks of every scheduled sequence, and those blocks must not return to the free queue — or be reallocated — while
it runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import uuid
import weakref
from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.engine_core import EngineCore, Submission
from engine.engine_info import EngineInfo, EngineStats
from engine.errors import EngineError, EngineStopped, InvalidRequestError
from engine.fair_share import DEFAULT_SHARE, FairShare
from engine.gil import shorten_switch_interval
from engine.kv.block_hash import BlockHash
from engine.kv.cache_control import ErasureResult, PinResult
from engine.kv.kv_cache_manager import CacheFootprint, InvalidationResult
from engine.kv.tier_config import CacheSettings
from engine.loop_bridge import LoopBridge
from engine.openmp import release_thread_pool
from engine.outputs import GenerationEvent, RequestFinished
from engine.prompt import TokenizedPrompt
from engine.prompt_encoder import Prompt, needs_tokenizing
from engine.request_table import Collector, Sink
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

__all__ = ["EngineInfo", "EngineStats", "ErasureResult", "LLMEngine", "PinResult", "Prompt", "Sink"]

log = logging.getLogger("kvchat.engine")


class LLMEngine:
    """Load once, ``await start()``, then ``generate`` from any number of coroutines."""

    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        self._info: EngineInfo | None = None
        self._core: EngineCore | None = None
        self._settings = self.config.cache_settings  # (until load: then CacheControl holds them)
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._loaded: concurrent.futures.Future[EngineInfo] | None = None  # set while a loop thread exists
        self._bridges: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopBridge] = weakref.WeakKeyDictionary()

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> EngineInfo:
        """Resolve and load the model, size the KV pool, open the disk tier when configured (blocking; seconds)."""
        if self._info is None:
            self._build()
        info, core = self.info, self.core
        if self.config.disk_cache_dir and self.config.enable_prefix_caching and core.cache.tier is None:
            c = self.config
            fingerprint = core.runner.kv_fingerprint(info.fingerprint, c.quantization)
            core.cache.open_tier(str(c.disk_cache_dir), fingerprint, core.runner, self._wakeup.set)
        return info

    def _build(self) -> None:
        from engine.model_runner import ModelRunner

        runner = ModelRunner.from_config(self.config)
        info = EngineInfo.of(runner, self.config)
        config = dataclasses.replace(self.config, cache_settings=self._settings)  # (as changed before the load)
        self._core = EngineCore.build(runner, config, info, self._lock, self._wakeup)
        self._info = info
        log.info(
            "engine loaded: %s (%s, %s on %s), %d KV blocks of %d tokens",
            info.model_path, info.architecture, info.dtype, info.device, info.num_blocks, info.block_size,
        )  # fmt: skip
        release_thread_pool()  # loading ran parallel regions on this thread (engine/openmp.py)

    async def start(self) -> EngineInfo:
        """Start the step loop thread; it loads the model first (see ``engine.openmp`` for why on that thread), and
        shorten the GIL switch interval (``engine.gil``: else a busy event loop slows every step by tens of times).

        Concurrent calls share one load; cancelling a caller does not cancel the load (a later call picks it up).
        """
        if self._loaded is None:
            shorten_switch_interval()  # NOTE: the loop thread shares the GIL with the caller's threads (engine.gil)
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
        if self._core is not None:
            with self._lock:
                self._core.table.fail_all(lambda: EngineStopped("the engine stopped"))
        await asyncio.to_thread(self.close_disk_tier)

    def close_disk_tier(self) -> None:
        """Write what memory holds back to disk (so the next process starts warm) and close the tier; ``stop()``
        calls it. Blocks (the writes). A later ``start()`` or ``load()`` opens the tier again."""
        if self._core is not None:
            self._core.cache.close_tier()

    @property
    def core(self) -> EngineCore:
        """The loaded parts and the step loop (``EngineStopped`` before ``load``)."""
        if self._core is None:
            raise EngineStopped("the engine is not loaded")
        return self._core

    @property
    def info(self) -> EngineInfo:
        if self._info is None:
            raise EngineStopped("the engine is not loaded")
        return self._info

    @property
    def tokenizer(self) -> Tokenizer:
        return self.core.encoder.tokenizer

    @property
    def is_running(self) -> bool:
        """The step loop is serving: started and its model loaded."""
        loaded = self._loaded
        return self._thread is not None and loaded is not None and loaded.done() and loaded.exception() is None

    # NOTE: the test seams of engine.testing.Faults and of the exactness tests (None until loaded).
    _runner = property(lambda self: self._core and self._core.runner)
    _sampler = property(lambda self: self._core and self._core.sampler)
    _scheduler = property(lambda self: self._core and self._core.scheduler)

    # ------------------------------------------------------------------ prompts

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids (``tokenize_prompt`` without the spans)."""
        return self.tokenize_prompt(prompt).token_ids

    def tokenize_prompt(self, prompt: Prompt) -> TokenizedPrompt:
        """Chat messages → the model's chat template; a string → plain encoding; token ids are checked; a
        ``SegmentedPrompt`` → the chat template over its messages, with each segment's token span. A
        ``TokenizedPrompt`` (what this returned earlier) passes through, its ids checked: submit it, and the prompt
        is tokenized once."""
        return self.core.encoder.encode(prompt)

    def prompt_token_floor(self, texts: Iterable[str]) -> int:
        """A lower bound of the tokens ``texts`` encode to, from their length alone (no tokenizing)."""
        return self.core.encoder.token_floor(texts)

    @property
    def prompt_limit(self) -> int:
        """The most tokens a request may hold (prompt and reply): the model's context or the KV pool, the smaller.
        The one formula: ``submit`` checks every prompt against it (``PromptTooLongError``)."""
        return self.core.encoder.limit

    # ------------------------------------------------------------------ requests

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "default",
        request_id: str | None = None,
        session: str | None = None,
        share: FairShare = DEFAULT_SHARE,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Stream ``TokenDelta`` events (one per sampled token, then one with any text held back to the end), then one
        ``RequestFinished``. The one bridge from the step thread to asyncio.

        A prompt that needs tokenizing is registered in a worker thread (the event loop never tokenizes); a
        ``TokenizedPrompt`` or token ids are registered at once. Closing the iterator early aborts the request, as
        does cancelling it while it registers (once registered); ``abort(request_id)`` works from the moment this
        is first iterated. ``share`` names the tenant it is charged to for fair scheduling (``engine.fair_share``).
        Raises ``EngineBusy`` (admission), ``InvalidRequestError`` subclasses, ``EngineStopped``.
        """
        if not self.is_running:
            raise EngineStopped("the engine is not running")
        bridge = self._bridge(asyncio.get_running_loop())
        queue: asyncio.Queue[GenerationEvent | EngineError] = asyncio.Queue()

        def sink(event: GenerationEvent | EngineError) -> None:
            # NOTE: the caller's loop may close before the step thread applies the abort its generator's finalizer
            # queued; the bridge drops an event nobody can receive, never raising into the step thread.
            bridge.put(queue, event)

        rid = request_id or uuid.uuid4().hex
        submission, offload = (prompt, params or SamplingParams(), namespace, sink), needs_tokenizing(prompt)
        with self._lock:
            self.core.table.claim([rid])
        done = False
        try:
            if offload:  # NOTE: shielded: a cancelled caller leaves the registration to finish (then aborts it)
                registering = asyncio.ensure_future(
                    asyncio.to_thread(self._register, [submission], [rid], session, share)
                )
                registering.add_done_callback(lambda f: f.cancelled() or f.exception())  # (retrieved: never logged)
                await asyncio.shield(registering)
            else:
                self._register([submission], [rid], session, share)
            while not done:
                event = await queue.get()
                if isinstance(event, EngineError):
                    done = True
                    raise event
                done = isinstance(event, RequestFinished)
                yield event
        finally:
            if not done:
                self.abort(rid)  # (a request still registering is aborted as soon as it is registered)

    def _bridge(self, loop: asyncio.AbstractEventLoop) -> LoopBridge:
        """The caller loop's bridge (made on its first request; with the lock: two threads' loops may ask at once)."""
        with self._lock:
            bridge = self._bridges.get(loop)
            if bridge is None:
                bridge = self._bridges[loop] = LoopBridge(loop)
            return bridge

    def submit(
        self,
        prompt: Prompt,
        params: SamplingParams,
        namespace: str,
        sink: Sink,
        request_id: str | None = None,
        session: str | None = None,
        share: FairShare = DEFAULT_SHARE,
    ) -> str:
        """Register a request whose events go to ``sink`` (called from the step thread). Returns its id.

        ``session`` (optional) names the conversation the request belongs to, so ``release_session`` can later free
        the blocks only that conversation uses.
        """
        return self.submit_many([(prompt, params, namespace, sink)], [request_id], session, share)[0]

    def submit_many(
        self,
        requests: Sequence[Submission],
        request_ids: Sequence[str | None] | None = None,
        session: str | None = None,
        share: FairShare = DEFAULT_SHARE,
    ) -> list[str]:
        """Register several requests at once: all or none, and the step loop sees them together (one batch)."""
        ids = [rid or uuid.uuid4().hex for rid in (request_ids or [None] * len(requests))]
        with self._lock:
            self.core.table.claim(ids)
        return self._register(requests, ids, session, share)

    def _register(
        self, requests: Sequence[Submission], ids: list[str], session: str | None, share: FairShare = DEFAULT_SHARE
    ) -> list[str]:
        """Encode and check claimed requests (outside the lock), then hand them to the scheduler together."""
        core = self.core
        try:
            prepared = [core.prepare(s, rid, session, share) for s, rid in zip(requests, ids, strict=True)]
            with self._lock:
                core.table.add(prepared)
                for r in prepared:
                    if not r.seq.params.prompt_logprobs:
                        core.cache.prefetch(r.seq)
                if session is not None:
                    core.cache.reopen(session)
        finally:
            with self._lock:
                core.table.unclaim(ids)
        self._wakeup.set()
        return ids

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (registering included); its blocks are released before the next step."""
        if self._core is not None:
            with self._lock:
                self._core.table.abort(request_id)
        self._wakeup.set()

    # ------------------------------------------------------------------ session and cache control, stats
    # NOTE: each delegates to ``engine.kv.cache_control.CacheControl``, whose docstrings say what it does exactly.

    def cache_settings(self) -> CacheSettings:
        return self._settings if self._core is None else self._core.cache.settings

    def configure_cache(self, **changes: object) -> CacheSettings:
        """Change cache settings while the engine runs (validated; ``InvalidRequestError`` names a bad one)."""
        if self._core is None:
            self._settings = self._settings.changed(**changes)
            return self._settings
        return self._core.cache.configure(**changes)

    def pin_prefix(self, namespace: str, token_ids: Sequence[int]) -> PinResult:
        """Keep the full blocks of ``namespace``'s shared prefix in memory (its ids are checked first)."""
        ids = self.tokenize_prompt(list(token_ids)).token_ids if token_ids else []
        return self.core.cache.pin_prefix(namespace, ids)

    def unpin(self, namespace: str) -> int:
        """Unpin the namespace's prefix (its blocks age out like any other). Returns blocks unpinned now."""
        return self.core.cache.unpin(namespace)

    def set_session_temperature(self, session: str, temperature: float) -> None:
        """The session's semantic temperature (0 cold .. 1 hot): eviction takes a cold topic's blocks first."""
        self.core.cache.set_temperature(session, temperature)

    def invalidate(
        self,
        namespace: str,
        *,
        session: str | None = None,
        from_position: int | None = None,
        block_hashes: Sequence[BlockHash] | None = None,
        reason: str = "invalidated",
    ) -> InvalidationResult:
        """Free cached blocks whose context changed (``session`` from ``from_position``, or ``block_hashes``) and
        every block that depends on them, in every tier; other sessions' blocks are protected."""
        return self.core.cache.invalidate(
            namespace, session=session, from_position=from_position, block_hashes=block_hashes, reason=reason
        )

    def invalidate_prefix(
        self, namespace: str, token_ids: Sequence[int], from_position: int, reason: str = "invalidated"
    ) -> InvalidationResult:
        """Free the cached chain of ``token_ids`` from ``from_position`` on, and its dependents, in every tier and
        every session (shared text that changed: a handbook section)."""
        return self.core.cache.invalidate_prefix(namespace, token_ids, from_position, reason)

    def flush_namespace(self, namespace: str, reason: str = "flushed") -> InvalidationResult:
        """Free every cached block of ``namespace``, in every tier (no other namespace's)."""
        return self.core.cache.flush_namespace(namespace, reason)

    def release_session(self, session: str) -> int:
        """Free the cached blocks only ``session`` used (demoted to disk where there is a disk tier)."""
        return self.core.cache.release_session(session)

    def erase_session(self, session: str, namespace: str) -> ErasureResult:
        """Erasure: remove the session's blocks from every tier (a shared prefix another session wants stays), and
        its replies from its tenant's draft tree (engine.spec)."""
        result = self.core.cache.erase_session(session, namespace)
        self.core.erase_drafts(session, namespace)
        return result

    def session_footprint(self, session: str) -> CacheFootprint:
        """The blocks of ``session``'s recorded chain that are cached right now (shared ones included)."""
        return self.core.cache.footprint(session)

    def stats(self) -> EngineStats:
        return self.core.stats()

    # ------------------------------------------------------------------ synchronous driving (tests, benchmarks)

    def run_until_idle(self) -> None:
        """Drive steps on the calling thread until no work is left (only when the loop thread is not running)."""
        if self._thread is not None:
            raise InvalidRequestError("run_until_idle() cannot be used while the step loop runs")
        self.core.run_until_idle()

    def generate_sync(
        self, prompts: Sequence[Prompt], params: SamplingParams, namespace: str = "default"
    ) -> list[RequestFinished]:
        """Submit all prompts at once, run them in one continuous batch, return their results in order."""
        if self._thread is not None:
            raise InvalidRequestError("generate_sync() cannot be used while the step loop runs; use generate()")
        self.load()
        collect = Collector()
        ids: list[str] = []
        try:
            for prompt in prompts:
                ids.append(self.submit(prompt, params, namespace, collect))
        except EngineError:
            # NOTE: all or nothing: the prompts already queued must not run later, in another call's batch.
            for rid in ids:
                self.abort(rid)
            self.run_until_idle()
            raise
        self.run_until_idle()
        return collect.results(ids)

    # ------------------------------------------------------------------ the step loop

    def _run_loop(self, loaded: concurrent.futures.Future[EngineInfo], stopping: threading.Event) -> None:
        try:
            info = self.load()
        except BaseException as exc:  # noqa: BLE001 - handed to start(), which raises it
            loaded.set_exception(exc)
            return
        loaded.set_result(info)
        self.core.serve(stopping)

    def _step(self) -> bool:
        """One step of the loop on the calling thread (a test seam)."""
        return self.core.step()
