"""Continuous batching with chunked prefill, admission control and preemption by recompute.

One ``schedule()`` call plans one model step:

1. running sequences that decode (one token each, plus the draft tokens the cost model lets it verify: engine.spec),
   oldest admission first;
2. the step's prefill: running sequences still prefilling (a chunk each) and waiting sequences (admitted while
   ``max_num_seqs`` and the pool allow), in fair order (below), within the step's prefill budget.

Fair share (``engine.fair_share``, VTC): every tenant has a virtual token counter that grows with the tokens
planned for it (prefill chunks and decodes; prefix-cache hits are free) divided by its weight. The step's prefill
goes first to the sequence, running or waiting, of the tenant with the smallest counter (inside a tenant, its running
prefills first, then the waiting sequence of the session with the smallest counter, then the oldest), so one
tenant's burst, admitted or queued, cannot hold another's reply. A tenant back from idle is lifted to the
smallest active counter: idling banks no credit (the tie that makes goes to it). A newcomer's step (its tenant has
nothing decoding while another's replies decode) prefills only its tenant's prompts, so its first token comes from
a step of its own rows and the decodes. Alone, a tenant gets the whole engine. Scheduling decides only when a token
is computed, never its value.

When every running slot is taken and the fairest waiting sequence's tenant has nothing running, one running sequence
of the tenant that holds the most slots, beyond its even share, is preempted for it (one a step). Without that, a
burst admitted together finishes together, and the next tenant waits for the whole burst's replies, however small
its counter.

While other sequences are in flight, a prefill chunk takes at most ``long_prefill_chunk`` tokens of the step (alone,
a prompt takes the whole budget): a long cold prompt then advances a chunk a step beside the others. While more than
one tenant has requests in flight, the step's prefill takes at most that many tokens in all: a step then costs about
one chunk (~200 ms on the kinds measured) plus its decodes, so a new turn of a tenant with a smaller counter waits
behind at most one such step, not behind a budget's worth of another tenant's prompts (a burst of 60 new turns
planned 2,048 prefill tokens a step: ~4 s on 2 AVX2 cores). Where the CPU kind's table says so
(``cap_lone_steps``), the same holds for a tenant alone with several requests in flight: a burst's prompts then
finish one chunk's worth at a time instead of all at the end of one long step, and the later ones find a shared
prefix in the blocks the first published.

When the pool runs out for a running sequence, the most recently admitted running sequence is preempted: its blocks
are freed and it goes back to the front of the waiting queue, to be recomputed later (its published blocks usually
make that a prefix hit).

Assumption: the engine rejects a request whose prompt + max_tokens does not fit the whole pool before ``add``. A
sequence that still cannot fit while it is alone in the pool is not retried forever: it is finished as aborted and
reported in ``SchedulerOutput.rejected`` (the engine fails it with ``PromptTooLongError``).
"""

from __future__ import annotations

import functools
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.errors import EngineBusy, InvalidRequestError
from engine.fair_share import FairCounters
from engine.kv.kv_cache_manager import KVCacheManager, MatchResult
from engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_waiting: int = 256
    block_size: int = 16
    # NOTE: the longest prefill chunk of a step that has other sequences in flight, and the step's prefill in all
    # while several tenants have (0: no cap, the budget). The engine sets it per CPU kind and dtype
    # (engine.model.kernels.prefill_chunk): such a chunk costs ~200 ms there.
    long_prefill_chunk: int = 0
    # NOTE: whether the step's prefill in all stays within ``long_prefill_chunk`` while one tenant alone has several
    # sequences in flight too (engine.model.kernels.caps_lone_steps: the kinds where that was measured to pay).
    cap_lone_steps: bool = False
    # NOTE: a constant retry hint: the queue drains at a rate that depends on prompt and output lengths the caller
    # cannot see, and a constant is honest and predictable; clients add their own jitter.
    retry_after_s: float = 1.0

    def __post_init__(self) -> None:
        checks = {
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "max_waiting": self.max_waiting >= 1,
            "block_size": self.block_size >= 1,
            "retry_after_s": self.retry_after_s >= 0,
            "long_prefill_chunk": self.long_prefill_chunk >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(f"invalid scheduler config: {name}={getattr(self, name)!r}")

    @classmethod
    def from_engine_config(
        cls, config: EngineConfig, long_prefill_chunk: int = 0, cap_lone_steps: bool = False
    ) -> SchedulerConfig:
        """The scheduler's part of ``config``; the chunk and ``cap_lone_steps`` as resolved for this machine."""
        blocks = (config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting, config.block_size)
        return cls(*blocks, long_prefill_chunk=long_prefill_chunk, cap_lone_steps=cap_lone_steps)


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    start_pos: int  # tokens of the sequence already in the pool
    num_new_tokens: int  # tokens computed this step: positions start_pos .. start_pos + num_new_tokens - 1
    block_table: list[int]  # covers start_pos + num_new_tokens tokens
    need_logits: bool  # the chunk reaches the sequence's last token, so the engine samples from its logits
    # Draft tokens verified after the sequence's last token (the last num_new_tokens - 1 tokens of the step; every
    # row needs logits). The engine sets ``num_accepted`` before ``update_after_step``.
    drafts: tuple[int, ...] = ()
    num_accepted: int = 0

    @property
    def token_ids(self) -> list[int]:
        base = self.seq.token_slice(self.start_pos, self.start_pos + self.num_new_tokens - len(self.drafts))
        return base + list(self.drafts) if self.drafts else base


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)  # could never fit the pool; finished as aborted

    @property
    def num_batched_tokens(self) -> int:
        return sum(item.num_new_tokens for item in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(slots=True)
class _Step:
    """What one ``schedule()`` call has decided so far."""

    budget: int
    prefill: int  # prefill tokens the step may still plan (``Scheduler._prefill_budget``)
    scheduled: dict[str, ScheduledSeq] = field(default_factory=dict)
    prefills: set[str] = field(default_factory=set)  # the request ids whose planned chunk is a prefill
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)


DraftLimit = Callable[[int], int]  # decode sequences in the step -> the most draft tokens each may verify (0: none)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, draft_limit: DraftLimit | None = None) -> None:
        if config.block_size != kv.block_size:
            raise ValueError(f"scheduler block_size {config.block_size} != KV cache block_size {kv.block_size}")
        self.config = config
        self.kv = kv
        # NOTE: the cost model (engine.spec.cost_model) decides per step; None: drafts are never verified.
        self.draft_limit = draft_limit
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order: the last one is preempted first
        self._seqs: dict[str, Sequence] = {}
        self.fair = FairCounters()

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def get(self, request_id: str) -> Sequence | None:
        return self._seqs.get(request_id)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Raises ``EngineBusy`` when the waiting queue is full.

        A running slot that is free now counts as room: the next step admits into it. Without that, a request that
        arrives between one sequence finishing and the next step's admission was refused although the engine held
        fewer than ``max_num_seqs + max_waiting`` requests (seen as a spurious ``busy`` at exactly full load).
        """
        if seq.request_id in self._seqs:
            raise InvalidRequestError(f"request id {seq.request_id!r} is already in use")
        if seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"only a waiting sequence can be added, got {seq!r}")
        free_slots = max(0, self.config.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.config.max_waiting + free_slots:
            raise EngineBusy(f"{len(self.waiting)} requests are already waiting", self.config.retry_after_s)
        self.waiting.append(seq)
        self._seqs[seq.request_id] = seq
        self.fair.enter(seq.share, seq.fair_session)

    def abort(self, request_id: str) -> Sequence | None:
        """Abort a waiting or running sequence and free its blocks. Returns None for an unknown (or finished) id."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Remove a sequence from the scheduler with a finished ``status`` and release its blocks."""
        if not status.is_finished:
            raise ValueError(f"finish() needs a finished status, got {status}")
        if self._seqs.pop(seq.request_id, None) is None:
            raise ValueError(f"{seq!r} is not scheduled here")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        self.fair.leave(seq.share, seq.fair_session)
        seq.status = status

    def schedule(self) -> SchedulerOutput:
        step = _Step(budget=self.config.max_num_batched_tokens, prefill=self._prefill_budget())
        self._schedule_decodes(step)
        # NOTE: before the step's prefill, not after it: while the slots' holders still prefill, their chunks would
        # take the step's (capped) prefill first, and the newcomer would wait for all of them to finish.
        if self._room(step) and len(self.running) >= self.config.max_num_seqs and not step.preempted:
            self._hand_over_a_slot(step)
        self._schedule_prefills(step)
        return SchedulerOutput(list(step.scheduled.values()), step.preempted, step.rejected)

    def update_after_step(self, output: SchedulerOutput) -> None:
        """Record that the model computed every scheduled chunk, and publish the blocks it filled.

        Call it before appending the sampled tokens. Sequences finished in between (aborted) are skipped.
        """
        for item in output.scheduled:
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue
            rejected = len(item.drafts) - item.num_accepted
            end = item.start_pos + item.num_new_tokens - rejected
            seq.num_computed_tokens = end
            seq.num_prefilled_tokens += max(0, min(end, seq.num_prompt_tokens) - item.start_pos)
            if end // self.config.block_size > item.start_pos // self.config.block_size:  # a block became full
                tokens = seq.all_token_ids + list(item.drafts[: item.num_accepted])
                self.kv.cache_full_blocks(seq.request_id, seq.root, tokens, end, owner=seq.session)
            if rejected:  # NOTE: the rejected drafts' slots: the chain is unchanged, blocks past the next token go
                self.kv.truncate(seq.request_id, end + 1)

    def _next_waiting(self) -> Sequence | None:
        """The waiting sequence to admit next: smallest tenant counter; inside the tenant, a preempted sequence first
        (its reply stalled mid-stream), then the session with the smallest counter, then the oldest (the front of
        the queue, where a preempted sequence goes back).

        NOTE: a sequence whose prefix is still loading from disk is passed over, not waited for.
        """
        ready = (seq for seq in self.waiting if not seq.loading)
        return min(ready, key=self._rank, default=None)

    def _rank(self, seq: Sequence) -> tuple[float, bool, float]:
        tenant, session = self.fair.rank(seq.share, seq.fair_session)
        return tenant, seq.num_preemptions == 0, session

    def _hand_over_a_slot(self, step: _Step) -> None:
        """All slots are taken: when the fairest waiting sequence's tenant has none, preempt the newest running
        sequence of the tenant holding the most slots beyond an even share, and admit the waiting one instead.

        NOTE: cheap for the victim: its full blocks are published, so its recompute is mostly a prefix hit; and
        bounded: only a tenant with nothing running takes a slot, from one over its share, at most once a step.
        """
        seq = self._next_waiting()
        if seq is None:
            return
        held = Counter(s.share.tenant for s in self.running)
        if held[seq.share.tenant]:
            return
        tenant, count = held.most_common(1)[0]
        counters = self.fair.tenants
        # NOTE: "beyond an even share" (at least one slot kept) is what keeps two tenants from taking a slot back and
        # forth: the one that just got its slot holds no more than its share.
        share = max(1.0, self.config.max_num_seqs / (len(held) + 1))
        # NOTE: a tie hands the slot over: a tenant back from idle is lifted to the holder's counter, and before the
        # step's prefill is planned the holder's chunks have not been charged yet.
        if count <= share or counters.counter(tenant) < counters.counter(seq.share.tenant):
            return
        victim = next(s for s in reversed(self.running) if s.share.tenant == tenant)
        self._preempt(victim, step)
        self._admit(seq, step)  # (short of blocks even now, it waits in front: nothing is lost)

    def _schedule_decodes(self, step: _Step) -> None:
        """Every running sequence that decodes: one token, and the drafts the cost model lets it verify."""
        per_seq = self._drafts_per_seq()
        for seq in list(self.running):  # NOTE: admission order: the budget rarely runs out before the decodes
            if step.budget <= 0:
                return
            if seq.status is not SequenceStatus.RUNNING or seq.request_id in step.scheduled or not decodes(seq):
                continue  # preempted earlier in this loop, or prefilling, or waiting for its sampled token
            drafts = self._drafts(seq, per_seq, step)
            if drafts:
                self._plan(seq, 1 + len(drafts), step, drafts)
            elif self._reserve(seq, 1, step):
                self._plan(seq, 1, step)

    def _schedule_prefills(self, step: _Step) -> None:
        """The step's prefill budget, to running prefills and the next waiting sequence (the fairest:
        ``_next_waiting``) in one order: the smallest tenant counter first (it grows as the step plans); inside a
        tenant, its running prefills (by session counter) before its next admission, as when one tenant is alone.

        A newcomer's step: when the step's first prefill is for a tenant with nothing decoding (its turn waits for its
        first token) while another tenant's replies decode, the step plans only such tenants' prefills.

        NOTE: no admission in a step that preempted: the pool is already short, a new sequence would only be
        preempted in turn (the same rule as vLLM); nor after the fairest waiting one found no blocks: nobody
        overtakes it (else a long prompt could starve).
        NOTE: why the newcomer's step: filled with another tenant's chunks, the step that brings its first token
        costs a whole chunk (Zen 4, bf16: 486 prefill tokens beside B's 26 took 1.4 s while the backend handled a
        burst's turns, where B's own rows would have taken a fraction; ``KVCHAT_ENGINE_STEP_TRACE``). The others lose
        that step's prefill room, only while the newcomer's prompt prefills."""
        admitting = True
        decoding = {s.share.tenant for s in self.running if s.output_token_ids}  # (no admission changes it)
        newcomer = functools.partial(_newcomer, decoding)
        only = False  # once the step's first prefill (a handed-over slot's, or planned below) is a newcomer's
        while self._room(step):
            if not only and len(step.prefills) == 1:
                only = newcomer(step.scheduled[next(iter(step.prefills))].seq)
            running = [s for s in self.running if s.request_id not in step.scheduled and _prefills(s)]
            running = [s for s in running if not only or newcomer(s)]
            run = min(running, key=lambda s: self._prefill_rank(s, False), default=None)
            room = admitting and not step.preempted and len(self.running) < self.config.max_num_seqs
            wait = self._next_waiting() if room else None
            wait = wait if wait is None or not only or newcomer(wait) else None
            if wait is not None and (run is None or self._prefill_rank(wait, True) < self._prefill_rank(run, False)):
                admitting = self._admit(wait, step)
                continue
            if run is None:
                return
            num_new = min(run.num_tokens - run.num_computed_tokens, step.budget, step.prefill, self._chunk_cap())
            if self._reserve(run, num_new, step):
                self._plan(run, num_new, step, prefill=True)
            else:
                admitting = False  # (the pool is short: the rule above)

    def _room(self, step: _Step) -> bool:
        return step.budget > 0 and step.prefill > 0

    def _prefill_rank(self, seq: Sequence, waiting: bool) -> tuple[float, bool, float]:
        """Smaller is planned first: the tenant's counter; on a tie, a running prefill before an admission of a tenant
        that has sequences running (its own order when alone), but an admission of a tenant with nothing running
        first; then the session's counter.

        NOTE: why the newcomer wins the tie: it is lifted to the smallest active counter, so its tenant and the one
        prefilling are tied when it arrives; the running prefill winning could cost the newcomer a whole step, and a
        step of a burst's onset took 0.6-1.5 s on 2 Zen 4 cores while the backend handled the burst's turns (issue
        42's probe, ``KVCHAT_ENGINE_STEP_TRACE``)."""
        tenant, session = self.fair.rank(seq.share, seq.fair_session)
        behind = waiting and any(s.share.tenant == seq.share.tenant for s in self.running)
        return tenant, behind, session

    def _chunk_cap(self) -> int:
        """The most tokens one prefill chunk may take now: ``long_prefill_chunk`` while another sequence is in
        flight (running or waiting), else no cap (the step budget bounds it)."""
        cap = self.config.long_prefill_chunk
        return self.config.max_num_batched_tokens if self._alone() or cap == 0 else cap

    def _alone(self) -> bool:
        """Whether at most one sequence is in flight (running or waiting)."""
        return len(self.running) + len(self.waiting) <= 1

    def _prefill_budget(self) -> int:
        """The most prefill tokens this step plans: ``long_prefill_chunk`` while more than one tenant has a request
        in flight, and where ``cap_lone_steps``, while one tenant alone has several; else no cap beyond the chunk's
        (the step budget bounds it).

        NOTE: the cap bounds a step (~200 ms of prefill plus its decodes on the kinds measured) so that another
        tenant's new turn waits behind one such step, not behind a whole budget of someone else's prompts. For a
        tenant alone it makes a burst's prompts finish a chunk at a time, not all at the end of one long step: on
        Zen 4 the mean first token of 16 sessions arriving at once came 1.6-2x sooner (``cap_lone_steps``). On AVX2
        a lone tenant keeps big steps: with every step capped at its 96-token chunk, 16 sessions arriving together
        lost 10-40 % of their tokens/s (commit 7d4d562)."""
        cap = self.config.long_prefill_chunk
        shared = self.fair.tenants.num_active > 1
        several = self.config.cap_lone_steps and not self._alone()
        return cap if (shared or several) and cap else self.config.max_num_batched_tokens

    def drafts_wanted(self) -> bool:
        """Whether the next step may verify drafts at all: no prompt waits or prefills (``_drafts_per_seq``)."""
        return not self.waiting and not any(_prefills(s) for s in self.running)

    def _drafts_per_seq(self) -> int:
        """The most draft tokens each decoding sequence may verify this step (the cost model's word); none while a
        prompt waits or prefills.

        NOTE: why none then: a step with a prefill chunk is bound by arithmetic, so draft rows lengthen it and every
        prefilling request's first token comes later (16 sessions arriving together on AVX2, fp32: TTFT p50 +12 %,
        mean +16 % with drafts, for the same tokens/s), a cost the per-sequence model does not see."""
        if self.draft_limit is None or not self.drafts_wanted():
            return 0
        decoding = sum(1 for s in self.running if decodes(s))
        return self.draft_limit(decoding)

    def _drafts(self, seq: Sequence, per_seq: int, step: _Step) -> tuple[int, ...]:
        """The drafts ``seq`` verifies this step, their slots allocated; none when the budget or the pool is short.

        NOTE: drafts never preempt anyone: when their blocks are not free, the sequence decodes one token as usual.
        """
        k = min(len(seq.draft_token_ids), per_seq, step.budget - 1)
        if k <= 0:
            return ()
        if not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens + 1 + k):
            return ()
        return tuple(seq.draft_token_ids[:k])

    def _reserve(self, seq: Sequence, num_new: int, step: _Step) -> bool:
        """Allocate slots for ``seq``, preempting the newest running sequences as needed. False if ``seq`` lost."""
        while not self.kv.allocate_slots(seq.request_id, seq.num_computed_tokens + num_new):
            victim = self.running[-1]
            if victim is seq and len(self.running) == 1:
                self._reject(seq, step)
                return False
            self._preempt(victim, step)
            if victim is seq:
                return False
        return True

    def _admit(self, seq: Sequence, step: _Step) -> bool:
        # NOTE: a cached block holds K/V, never logits, so a request that wants prompt log-probabilities computes its
        # whole prompt (vLLM does the same); it still publishes its blocks for others.
        if seq.params.prompt_logprobs:
            match = MatchResult(num_query_tokens=seq.num_tokens)
        else:
            match = self.kv.match_prefix(seq.root, seq.all_token_ids)
        num_new = min(seq.num_tokens - match.num_cached_tokens, step.budget, step.prefill, self._chunk_cap())
        if not self.kv.allocate_slots(seq.request_id, match.num_cached_tokens + num_new, match, seq.spans):
            if self.running:
                return False  # the fairest waits for blocks; nobody overtakes it (else a long prompt could starve)
            self._reject(seq, step)
            return True
        self.waiting.remove(seq)
        if seq.publish_limit is not None:  # (set while it waited, or before a preemption freed its blocks)
            self.kv.stop_publishing(seq.request_id, seq.publish_limit)
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = match.num_cached_tokens
        if seq.first_scheduled_time is None:
            seq.first_scheduled_time = time.monotonic()
            seq.num_cached_tokens = match.num_cached_tokens
            if seq.promoted:
                disk = sum(1 for h in match.block_hashes if h in seq.promoted)
                seq.num_disk_cached_tokens = disk * self.config.block_size
        self.running.append(seq)
        self._plan(seq, num_new, step, prefill=True)
        return True

    def _plan(
        self, seq: Sequence, num_new: int, step: _Step, drafts: tuple[int, ...] = (), prefill: bool = False
    ) -> None:
        start = seq.num_computed_tokens
        table = self.kv.block_table(seq.request_id)
        need_logits = start + num_new - len(drafts) == seq.num_tokens
        step.scheduled[seq.request_id] = ScheduledSeq(seq, start, num_new, table, need_logits, drafts)
        step.budget -= num_new
        if prefill:
            step.prefill -= num_new
            step.prefills.add(seq.request_id)
        # NOTE: billed when planned, not after the step: the next pick of this same step must see it.
        self.fair.charge(seq.share, seq.fair_session, num_new)

    def _preempt(self, seq: Sequence, step: _Step) -> None:
        self.running.remove(seq)
        self.kv.free(seq.request_id)
        planned = step.scheduled.pop(seq.request_id, None)
        if planned is not None:  # NOTE: it was planned earlier in this step; give its tokens back to the budget
            step.budget += planned.num_new_tokens
            if seq.request_id in step.prefills:
                step.prefill += planned.num_new_tokens
            self.fair.charge(seq.share, seq.fair_session, -planned.num_new_tokens)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        step.preempted.append(seq)

    def _reject(self, seq: Sequence, step: _Step) -> None:
        # NOTE: reaching here means the engine's prompt-length validation let through a sequence larger than the
        # whole pool; finishing it keeps the loop from retrying it forever.
        self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        step.rejected.append(seq)


def decodes(seq: Sequence) -> bool:
    """Whether a running sequence's next step is a decode: one token left to compute (its last sampled one)."""
    return seq.num_tokens - seq.num_computed_tokens == 1


def _newcomer(decoding: set[str], seq: Sequence) -> bool:
    """Whether ``seq``'s tenant has no running sequence past its prompt while another tenant's (``decoding``) do."""
    return bool(decoding) and seq.share.tenant not in decoding


def _prefills(seq: Sequence) -> bool:
    """Whether a running sequence still prefills: more than one token left to compute (a prompt's chunk, or a
    recompute after preemption)."""
    return seq.status is SequenceStatus.RUNNING and seq.num_tokens - seq.num_computed_tokens > 1
