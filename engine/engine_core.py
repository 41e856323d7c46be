"""The step loop: schedule, run the forward pass, sample, hand each token to its request — with failure isolation.

One step, in order: under the engine lock, apply the aborts queued since the last step, install the blocks loaded
from disk, schedule, demote the published blocks the schedule handed out; outside it, the forward pass and sampling
(torch releases the GIL, so callers keep registering meanwhile); under the lock again, fail what failed, advance the
scheduler (which publishes the filled blocks) and report the tokens.

Failure isolation. One request must never fail the others in its batch. A forward pass that raises is re-run on
halves of the batch, down to single requests; only a request whose forward fails alone is failed. A row the sampler
cannot sample (non-finite logits) and a token that fails to detokenize fail that request alone. A failed request's
blocks written in the failed step are zeroed and freed, and never published to the prefix cache.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.cpu_share import CpuShare
from engine.engine_info import EngineInfo, EngineStats
from engine.errors import EngineError, PromptTooLongError, RequestFailed
from engine.fair_share import DEFAULT_SHARE, FairShare
from engine.kv.block_meta import GENERATED, UNTYPED, SpanMap, TokenSpan
from engine.kv.cache_control import CacheControl
from engine.kv.kv_cache_manager import KVCacheManager
from engine.openmp import release_thread_pool
from engine.prompt_encoder import Prompt, PromptEncoder
from engine.request_table import Request, RequestTable, Sink
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler, SchedulerConfig
from engine.sequence import Sequence as Seq
from engine.sequence import SequenceStatus
from engine.step_trace import StepTrace, step_record

if TYPE_CHECKING:
    import torch

    from engine.model_runner import BatchItem, ModelRunner
    from engine.sampler import Sampler
    from engine.spec.suffix_drafts import SuffixDrafter

log = logging.getLogger("kvchat.engine")
Submission = tuple[Prompt, SamplingParams, str, Sink]  # prompt, params, namespace, sink

INTERNAL_ERROR = "internal engine error (see the server log)"


class EngineCore:
    """The loaded parts of one engine and the step that drives them (``LLMEngine`` is its facade)."""

    def __init__(
        self,
        runner: ModelRunner,
        encoder: PromptEncoder,
        sampler: Sampler,
        kv: KVCacheManager,
        scheduler: Scheduler,
        cache: CacheControl,
        table: RequestTable,
        lock: threading.Lock,
        wakeup: threading.Event,
        drafter: SuffixDrafter | None = None,
        drafts_default: bool = False,
        trace: StepTrace | None = None,
        cpu_share: CpuShare | None = None,
        threads: int = 0,
    ) -> None:
        self.runner = runner
        self.encoder = encoder
        self.sampler = sampler
        self.kv = kv
        self.scheduler = scheduler
        self.cache = cache
        self.table = table
        self._lock = lock
        self._wakeup = wakeup
        self._block_size = kv.block_size
        self.drafter = drafter  # suffix drafts (engine.spec); None: every decode step computes one token
        self.drafts_default = drafts_default  # for requests that do not say (``SamplingParams.drafts`` None)
        self.trace = trace  # a JSON line per step (``EngineConfig.step_trace``); None: off
        self.cpu_share = cpu_share  # each step's thread count (``EngineConfig.adapt_threads``); None: fixed
        self.threads = threads  # the fixed thread count (when ``cpu_share`` is None)

    @classmethod
    def build(
        cls, runner: ModelRunner, config: EngineConfig, info: EngineInfo, lock: threading.Lock, wakeup: threading.Event
    ) -> EngineCore:
        """Wire the parts around a loaded model: tokenizer, pool bookkeeping, scheduler, cache control, requests."""
        from engine.grammar import GrammarCompiler
        from engine.sampler import Sampler
        from engine.tokenizer import Tokenizer

        tokenizer = Tokenizer(runner.model_path)
        pool_tokens = info.num_blocks * info.block_size
        encoder = PromptEncoder(tokenizer, info.vocab_size, info.max_model_len, pool_tokens)
        kv = KVCacheManager(runner.num_blocks, config.block_size, config.enable_prefix_caching)
        from engine.model import kernels

        chunk = config.long_prefill_chunk
        chunk = kernels.prefill_chunk(runner.dtype, runner.device.type) if chunk is None else chunk
        lone = config.cap_lone_steps
        lone = kernels.caps_lone_steps(runner.dtype, runner.device.type) if lone is None else lone
        drafter = _speculation(config, runner)
        draft_limit = drafter.cost.limit if drafter is not None and drafter.cost is not None else None
        scheduler = Scheduler(SchedulerConfig.from_engine_config(config, chunk, lone), kv, draft_limit)
        cache = CacheControl(kv, info.fingerprint, config.cache_settings, lock, lambda: table.seqs())
        table = RequestTable(scheduler, cache, info.max_model_len)
        grammar = GrammarCompiler(tokenizer.hf, info.vocab_size, tokenizer.eos_token_ids)
        sampler = Sampler(runner.device, vocab_size=info.vocab_size, grammar=grammar)
        trace = StepTrace(config.step_trace) if config.step_trace else None
        import torch

        share = None
        if config.adapt_threads:
            same_bits = kernels.same_bits_at_any_width(runner.dtype, runner.device.type)
            share = CpuShare.for_engine(torch.get_num_threads(), same_bits)
        parts = (runner, encoder, sampler, kv, scheduler, cache, table, lock, wakeup, drafter, config.drafts, trace)
        return cls(*parts, share, torch.get_num_threads())

    def prepare(
        self, submission: Submission, rid: str, session: str | None, share: FairShare = DEFAULT_SHARE
    ) -> Request:
        """A request ready to be added: its prompt encoded (outside the lock: it may tokenize) and checked."""
        from engine.tokenizer import IncrementalDetokenizer

        prompt, params, namespace, sink = submission
        tokenized = self.encoder.encode(prompt)
        ids = tokenized.token_ids
        self.encoder.check_fits(len(ids), params.max_tokens)
        spans = SpanMap(tokenized.spans or (TokenSpan(0, len(ids), UNTYPED),), fill=GENERATED)
        root = self.cache.root(namespace)
        system = tokenized.system_tokens
        seq = Seq(rid, ids, params, root, spans=spans, session=session, system_tokens=system, share=share)
        state = self.sampler.new_state(params, self.encoder.tokenizer.eos_token_ids, rid, prompt_token_ids=ids)
        return Request(seq, state, IncrementalDetokenizer(self.encoder.tokenizer, ids, params.stop), sink)

    def serve(self, stopping: threading.Event) -> None:
        """The loop thread's body: step while there is work, otherwise wait for a wakeup, until ``stopping``."""
        pool_held = True
        while not stopping.is_set():
            self._wakeup.clear()
            try:
                self.cache.maintain()
                worked = self.step()
            except Exception:
                log.exception("engine step failed; failing the requests in flight")
                self.fail_in_flight()
                worked = True
            if worked:
                pool_held = True
                continue
            if pool_held:  # NOTE: an idle pool still counts against every other thread's (engine/openmp.py)
                release_thread_pool()
                pool_held = False
            self._wakeup.wait(0.1)
        release_thread_pool()

    def run_until_idle(self) -> None:
        """Drive steps on the calling thread until no work is left (when no loop thread runs: tests, benchmarks)."""
        try:
            while True:
                if self.step():
                    continue
                if not self._loading():
                    break
                self._wakeup.wait(0.05)  # NOTE: a prefix is loading from disk; the loader wakes us when it is in
                self._wakeup.clear()
        except Exception:
            self.fail_in_flight()
            raise
        finally:
            release_thread_pool()

    def _loading(self) -> bool:
        with self._lock:
            return any(seq.loading for seq in self.scheduler.waiting)

    def step(self) -> bool:
        """One step; False when there was nothing to do."""
        with self._lock:
            self.table.apply_aborts()
            self.cache.install_loaded()
            out = self.scheduler.schedule()
            self.cache.drain_evictions()  # NOTE: before the forward pass overwrites the blocks handed out
            for seq in out.rejected:
                pool = self.kv.num_blocks * self._block_size
                error = PromptTooLongError(seq.num_tokens, seq.params.max_tokens, pool, "KV cache pool")
                self.table.fail(seq.request_id, error)
        if out.is_empty:
            return False
        threads = self.cpu_share.apply() if self.cpu_share is not None else None
        began = time.monotonic()
        computed, logits, failed = self._forward_isolated(out.scheduled)
        forward_s = time.monotonic() - began
        sampled = [s for s in computed if s.need_logits]
        tokens = self._sample(sampled, logits, failed)
        now = time.monotonic()
        with self._lock:
            if self.trace is not None:  # NOTE: before update_after_step: a decode is told from a chunk by its position
                run, wait = self.scheduler.running, self.scheduler.waiting
                self.trace.write(step_record(began, forward_s, out.scheduled, run, wait, threads))
            for item, reason in failed:  # NOTE: before update_after_step, so none of their blocks is published
                self._fail_scheduled(item, reason)
            for item, picked in tokens:
                item.num_accepted = len(picked) - 1 if item.drafts else 0
            self.scheduler.update_after_step(out)
            self.table.counters.steps += 1
            for item, picked in tokens:
                self._count_drafts(item)
                for token in picked:  # NOTE: one by one: a stop (token, string, length) drops the tokens after it
                    if item.seq.is_finished or item.seq.request_id not in self.table:
                        break
                    self._on_token_isolated(item.seq, token, now)
            self._propose_drafts([item.seq for item, _ in tokens])
        return True

    def _sample(
        self, sampled: list[ScheduledSeq], logits: torch.Tensor, failed: list[tuple[ScheduledSeq, str]]
    ) -> list[tuple[ScheduledSeq, list[int]]]:
        """Each sampled item's tokens: one from its row, or, for an item that verified drafts, the accepted drafts and
        one more (``Sampler.verify``); an item whose rows cannot be sampled goes to ``failed``."""
        import torch

        plain = [s for s in sampled if not s.drafts]
        rows: dict[int, tuple[int, int]] = {}  # id(item) -> its logits rows
        at = 0
        for s in sampled:
            rows[id(s)] = (at, at + 1 + len(s.drafts))
            at += 1 + len(s.drafts)
        plain_logits = logits
        if len(plain) != len(sampled):
            plain_logits = logits.index_select(0, torch.tensor([rows[id(s)][0] for s in plain], dtype=torch.long))
        states = [self.table[s.seq.request_id].sampler_state for s in plain]
        outcomes = dict(zip(map(id, plain), self.sampler.sample(plain_logits, states), strict=True))
        out: list[tuple[ScheduledSeq, list[int]]] = []
        for s in sampled:
            if s.drafts:
                lo, hi = rows[id(s)]
                result = self.sampler.verify(logits[lo:hi], self.table[s.seq.request_id].sampler_state, s.drafts)
            else:
                one = outcomes[id(s)]
                result = [one] if isinstance(one, int) else one
            if isinstance(result, list):
                out.append((s, result))
            else:
                failed.append((s, result.reason))
        return out

    def _count_drafts(self, item: ScheduledSeq) -> None:
        if not item.drafts:
            return
        seq, c = item.seq, self.table.counters
        seq.num_drafted_tokens += len(item.drafts)
        seq.num_accepted_tokens += item.num_accepted
        c.drafted_tokens += len(item.drafts)
        c.accepted_tokens += item.num_accepted
        c.verify_steps += 1
        gave = item.num_accepted + 1
        c.tokens_per_verify_step[gave] = c.tokens_per_verify_step.get(gave, 0) + 1

    def _propose_drafts(self, seqs: list[Seq]) -> None:
        """After a step (under the lock): end the drafting of requests that are gone, and give each request that
        sampled this step the draft its next step verifies (none where the cost model allows none now)."""
        from engine.sampler import drafts_allowed

        drafter = self.drafter
        if drafter is None:
            return
        limit, decoding = self.scheduler.draft_limit, self.scheduler.num_running
        # NOTE: no tree lookups for a step that will not verify them (a prompt waits or prefills: Scheduler)
        pays = limit is not None and limit(decoding) > 0 and self.scheduler.drafts_wanted()
        for seq in seqs:
            seq.draft_token_ids = []
            rid = seq.request_id
            if seq.is_finished or rid not in self.table:
                if drafter.is_active(rid):
                    keep = seq.status is not SequenceStatus.FINISHED_ABORTED
                    drafter.end(rid, seq.output_token_ids, keep=keep)
                continue
            state = self.table[rid].sampler_state
            if not pays or not drafts_allowed(state, self.drafts_default):
                continue
            if not drafter.is_active(rid):
                drafter.begin(rid, seq.root, seq.prompt_token_ids, session=seq.session)
            room = min(seq.params.max_tokens - seq.num_output_tokens, self.runner.max_model_len - seq.num_tokens) - 1
            seq.draft_token_ids = drafter.propose(rid, seq.output_token_ids, room, decoding)
        for rid in drafter.active:
            if rid not in self.table:  # aborted or failed since: its reply leaves the tenant's tree
                drafter.end(rid, (), keep=False)

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

        try:
            items = _batch_items(scheduled)
            logits = self.runner.forward(items)
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

        return torch.empty((0, self.runner.vocab_size), dtype=torch.float32)

    def _fail_scheduled(self, item: ScheduledSeq, reason: str) -> None:
        """Fail one request of the step: zero the blocks the step was writing for it, free them, tell its sink."""
        rid = item.seq.request_id
        log.error("request %s failed in an engine step (the rest of the batch goes on): %s", rid, reason)
        if rid not in self.table:
            return
        # NOTE: the failed step may have left NaN or garbage K/V there. Padded attention reads masked slots of
        # reused blocks and multiplies them by 0, and 0 * NaN is NaN: a later owner of the block must find zeros.
        bs = self._block_size
        end = item.start_pos + item.num_new_tokens
        self.runner.clear_blocks(item.block_table[item.start_pos // bs : -(-end // bs)])
        self.table.fail(rid, RequestFailed(INTERNAL_ERROR))

    def _on_token_isolated(self, seq: Seq, token: int, now: float) -> None:
        """``RequestTable.on_token``, failing only this request when detokenizing or reporting its token raises."""
        try:
            self.table.on_token(seq, token, now)
        except Exception as exc:  # one request's detokenizer or sink must not fail the batch
            log.exception("request %s failed after its token was sampled", seq.request_id)
            self.table.fail(seq.request_id, RequestFailed(INTERNAL_ERROR), cause=exc)

    def erase_drafts(self, session: str, namespace: str) -> int:
        """Remove ``session``'s replies from its tenant's draft tree (erasure); returns how many went."""
        if self.drafter is None:
            return 0
        with self._lock:
            return self.drafter.erase_session(self.cache.root(namespace), session)

    def stats(self) -> EngineStats:
        with self._lock:
            c = self.table.counters
            return EngineStats(
                running=self.scheduler.num_running,
                waiting=self.scheduler.num_waiting,
                kv=self.kv.usage(),
                requests_finished=c.finished,
                prompt_tokens=c.prompt_tokens,
                cached_tokens=c.cached_tokens,
                generated_tokens=c.generated_tokens,
                steps=c.steps,
                cache=self.kv.cache_stats(),
                tiers=self.cache.tier_stats(),
                drafted_tokens=c.drafted_tokens,
                accepted_tokens=c.accepted_tokens,
                verify_steps=c.verify_steps,
                tokens_per_verify_step=dict(c.tokens_per_verify_step),
                threads=self.threads if self.cpu_share is None else self.cpu_share.width,
                width_changes=0 if self.cpu_share is None else self.cpu_share.changes,
            )

    def fail_in_flight(self) -> None:
        """After a step failed outside the isolated parts (a scheduler bug): fail every request in flight, releasing
        its blocks, so the engine can serve on."""
        with self._lock:
            self.table.fail_all(lambda: EngineError(INTERNAL_ERROR))


def _speculation(config: EngineConfig, runner: ModelRunner) -> SuffixDrafter | None:
    """The drafter with its live cost model (the scheduler's per-step draft limit): none where drafts cannot be made
    here.

    NOTE: made whether or not ``config.drafts`` is on: the switch is only the default of requests that do not say
    (a tenant's ``drafts: on`` asks for them on an engine whose switch is off). An engine where no request asks
    holds an empty drafter: no tree is built before a request drafts.
    """
    from engine.spec import cost_model, suffix_drafts

    if not suffix_drafts.available():
        return None
    model = cost_model.for_machine(runner.dtype, runner.device.type)
    if model is None:
        return None
    settings = suffix_drafts.DraftSettings(max_draft_tokens=model.max_draft_tokens)
    return suffix_drafts.SuffixDrafter(settings, cost_model.LiveCostModel(model))


def _batch_items(scheduled: list[ScheduledSeq]) -> list[BatchItem]:
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
            verify=bool(s.drafts),
        )
        for s in scheduled
    ]
