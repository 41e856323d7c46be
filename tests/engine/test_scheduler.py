from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.errors import EngineBusy, InvalidRequestError
from engine.kv.block_hash import root_hash
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

ROOT = root_hash("m", "ns")
SAMPLED = 7777


def make(
    num_blocks: int = 64, block_size: int = 4, max_num_seqs: int = 8, budget: int = 64, max_waiting: int = 8
) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, max_waiting, block_size)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def seq(rid: str, n: int, start: int = 0) -> Sequence:
    return Sequence(rid, list(range(start, start + n)), SamplingParams(), ROOT)


def step(sched: Scheduler) -> SchedulerOutput:
    """One engine step: schedule, 'run the model', then append a token to every sequence that got logits."""
    out = sched.schedule()
    sched.update_after_step(out)
    for item in out.scheduled:
        if item.need_logits and item.seq.status is SequenceStatus.RUNNING:
            item.seq.append_token(SAMPLED)
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(i.seq.request_id, i.start_pos, i.num_new_tokens, i.need_logits) for i in out.scheduled]


def test_chunked_prefill_then_decode() -> None:
    sched = make(block_size=16, budget=16)
    a = seq("a", 40)
    sched.add(a)
    out = step(sched)
    assert plan(out) == [("a", 0, 16, False)]
    assert out.scheduled[0].block_table == [0]
    assert out.scheduled[0].token_ids == list(range(16))
    assert plan(step(sched)) == [("a", 16, 16, False)]
    out = step(sched)
    assert plan(out) == [("a", 32, 8, True)]
    assert out.scheduled[0].block_table == [0, 1, 2]
    assert a.num_prefilled_tokens == 40
    assert a.output_token_ids == [SAMPLED]
    out = step(sched)
    assert plan(out) == [("a", 40, 1, True)]
    assert out.scheduled[0].token_ids == [SAMPLED]
    assert a.num_prefilled_tokens == 40  # decode tokens are not prompt tokens
    assert a.num_computed_tokens == 41
    assert a.status is SequenceStatus.RUNNING
    assert a.first_scheduled_time is not None


def test_empty_schedule() -> None:
    sched = make()
    out = sched.schedule()
    assert out.is_empty
    assert out.num_batched_tokens == 0
    assert not sched.has_unfinished()


def test_decodes_come_first_then_prefill_within_budget() -> None:
    sched = make(budget=8)
    a, b = seq("a", 5), seq("b", 20, start=100)
    sched.add(a)
    assert plan(step(sched)) == [("a", 0, 5, True)]
    sched.add(b)
    out = step(sched)
    assert plan(out) == [("a", 5, 1, True), ("b", 0, 7, False)]
    assert out.num_batched_tokens == 8
    out = step(sched)
    assert plan(out) == [("a", 6, 1, True), ("b", 7, 7, False)]


def test_running_prefill_continues_before_new_admission() -> None:
    sched = make(budget=10)
    a, b = seq("a", 16), seq("b", 4, start=100)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [("a", 0, 10, False)]
    assert sched.num_waiting == 1
    assert plan(step(sched)) == [("a", 10, 6, True), ("b", 0, 4, True)]
    assert sched.num_waiting == 0
    assert sched.num_running == 2


def test_max_num_seqs_limits_admission() -> None:
    sched = make(max_num_seqs=2)
    seqs = [seq(f"s{i}", 3, start=10 * i) for i in range(3)]
    for s in seqs:
        sched.add(s)
    assert [i.seq.request_id for i in step(sched).scheduled] == ["s0", "s1"]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    sched.finish(seqs[0], SequenceStatus.FINISHED_STOPPED)
    assert plan(step(sched)) == [("s1", 3, 1, True), ("s2", 0, 3, True)]


def test_waiting_queue_full_raises_engine_busy() -> None:
    sched = make(max_num_seqs=1, max_waiting=2)
    for name in "abc":  # two waiting places, and the free running slot the next step fills
        sched.add(seq(name, 3, start=10 * ord(name)))
    with pytest.raises(EngineBusy, match="3 requests are already waiting") as info:
        sched.add(seq("d", 3))
    assert info.value.retry_after_s == 1.0
    assert info.value.code == "busy"
    step(sched)
    assert (sched.num_running, sched.num_waiting) == (1, 2)
    with pytest.raises(EngineBusy, match="2 requests are already waiting"):
        sched.add(seq("d", 3))


def test_a_slot_freed_before_the_next_step_is_room_for_a_new_request() -> None:
    """Regression: a request arriving between a finish and the next step's admission was refused as busy."""
    sched = make(max_num_seqs=1, max_waiting=1)
    a, b = seq("a", 3), seq("b", 3, start=10)
    sched.add(a)
    step(sched)
    sched.add(b)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)  # b is still waiting: no step has run since
    sched.add(seq("c", 3, start=20))  # the engine holds 2 = max_num_seqs + max_waiting: accepted
    assert (sched.num_running, sched.num_waiting) == (0, 2)
    with pytest.raises(EngineBusy):
        sched.add(seq("d", 3, start=30))


def test_duplicate_request_id_is_refused() -> None:
    sched = make()
    sched.add(seq("a", 3))
    with pytest.raises(InvalidRequestError, match="already in use"):
        sched.add(seq("a", 3))


def test_preempts_newest_running_and_recovers() -> None:
    # 4 blocks of 4 tokens: two 8-token prompts fill the pool; the first decode needs a third block each.
    sched = make(num_blocks=4)
    a, b = seq("a", 8), seq("b", 8, start=100)
    sched.add(a)
    sched.add(b)
    out = step(sched)
    assert plan(out) == [("a", 0, 8, True), ("b", 0, 8, True)]
    assert [i.block_table for i in out.scheduled] == [[0, 1], [2, 3]]
    out = step(sched)
    assert plan(out) == [("a", 8, 1, True)]
    assert out.preempted == [b]
    assert out.scheduled[0].block_table == [0, 1, 3]  # b's tail block (freed first) is reused first
    assert b.status is SequenceStatus.WAITING
    assert (b.num_computed_tokens, b.num_preemptions, b.num_cached_tokens) == (0, 1, 0)
    assert list(sched.waiting) == [b]
    assert sched.kv.block_table("b") == []
    # b cannot come back while a holds 3 of the 4 blocks (it needs 3 blocks, only its head block 2 is left).
    assert plan(step(sched)) == [("a", 9, 1, True)]
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    out = step(sched)
    # b's first block survived in the cache: only tokens 4..8 (incl. its sampled token) are recomputed.
    assert plan(out) == [("b", 4, 5, True)]
    assert out.scheduled[0].block_table[0] == 2
    assert b.num_cached_tokens == 0  # the first admission's figure is what the user is told
    assert b.num_prefilled_tokens == 8 + 4
    assert b.output_token_ids == [SAMPLED, SAMPLED]


def test_preempted_sequence_goes_to_the_front_of_waiting() -> None:
    sched = make(num_blocks=6)
    a, b, c = seq("a", 8), seq("b", 8, start=100), seq("c", 8, start=200)
    d = seq("d", 2, start=300)
    for s in (a, b, c):
        sched.add(s)
    step(sched)
    sched.add(d)
    # Each decode needs a new block and the pool is full: a preempts c (the newest); b then uses c's freed block.
    out = step(sched)
    assert plan(out) == [("a", 8, 1, True), ("b", 8, 1, True)]
    assert out.preempted == [c]
    assert list(sched.waiting) == [c, d]


def test_newest_sequence_preempts_itself() -> None:
    sched = make(num_blocks=5, budget=9)
    b = seq("b", 8, start=100)
    sched.add(b)
    step(sched)  # b: 2 blocks, 9 tokens
    c = seq("c", 12, start=200)
    sched.add(c)
    out = step(sched)
    assert plan(out) == [("b", 8, 1, True), ("c", 0, 8, False)]
    assert sched.kv.num_free_blocks == 0
    out = step(sched)
    # b's decode fits its third block; c's next chunk needs a block, none is free, and c is the newest: it yields.
    assert plan(out) == [("b", 9, 1, True)]
    assert out.preempted == [c]
    assert (c.num_preemptions, c.num_computed_tokens, c.num_prefilled_tokens) == (1, 0, 8)
    assert list(sched.waiting) == [c]
    assert sched.running == [b]


def test_sequence_that_can_never_fit_is_rejected_not_retried() -> None:
    sched = make(num_blocks=2)
    big = seq("big", 12)
    sched.add(big)
    out = sched.schedule()
    assert out.rejected == [big]
    assert out.is_empty
    assert big.status is SequenceStatus.FINISHED_ABORTED
    assert not sched.has_unfinished()


def test_running_sequence_outgrowing_the_pool_is_rejected() -> None:
    sched = make(num_blocks=2)
    a = seq("a", 7)
    sched.add(a)
    step(sched)  # 7 prompt tokens, +1 sampled
    step(sched)  # decode fills the 8th slot, +1 sampled
    out = step(sched)
    assert out.rejected == [a]
    assert out.preempted == []
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert sched.kv.usage().num_used_blocks == 0


def test_abort_waiting_and_running_releases_blocks() -> None:
    sched = make(budget=8)
    a, b = seq("a", 8), seq("b", 8, start=100)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.kv.usage().num_used_blocks == 2
    assert sched.abort("b") is b
    assert b.status is SequenceStatus.FINISHED_ABORTED
    assert sched.num_waiting == 0
    assert sched.abort("a") is a
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert sched.kv.usage().num_used_blocks == 0
    assert sched.kv.block_table("a") == []
    assert sched.abort("a") is None
    assert sched.abort("nope") is None
    assert not sched.has_unfinished()


def test_abort_between_schedule_and_update_is_skipped() -> None:
    sched = make()
    a = seq("a", 8)
    sched.add(a)
    out = sched.schedule()
    sched.abort("a")
    sched.update_after_step(out)
    assert a.num_computed_tokens == 0
    assert sched.kv.usage().num_cached_blocks == 0


def test_prefix_hit_on_admission() -> None:
    sched = make(block_size=16)
    a = seq("a", 40)
    sched.add(a)
    step(sched)
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    b = Sequence("b", [*range(32), 900, 901, 902], SamplingParams(), ROOT)
    sched.add(b)
    out = step(sched)
    assert plan(out) == [("b", 32, 3, True)]
    assert out.scheduled[0].block_table[:2] == [0, 1]
    assert (b.num_cached_tokens, b.num_prefilled_tokens) == (32, 3)
    usage = sched.kv.usage()
    assert (usage.num_query_tokens, usage.num_hit_tokens) == (75, 32)


def test_prefix_hit_is_per_namespace() -> None:
    sched = make(block_size=16)
    a = seq("a", 40)
    sched.add(a)
    step(sched)
    other = Sequence("b", list(range(40)), SamplingParams(), root_hash("m", "other"))
    sched.add(other)
    assert plan(step(sched)) == [("a", 40, 1, True), ("b", 0, 40, True)]
    assert other.num_cached_tokens == 0


def test_finish_requires_a_finished_status_and_a_known_seq() -> None:
    sched = make()
    a = seq("a", 3)
    sched.add(a)
    with pytest.raises(ValueError, match="finished status"):
        sched.finish(a, SequenceStatus.RUNNING)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    with pytest.raises(ValueError, match="not scheduled here"):
        sched.finish(a, SequenceStatus.FINISHED_ABORTED)


def test_scheduler_config_validation() -> None:
    with pytest.raises(InvalidRequestError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    config = SchedulerConfig.from_engine_config(EngineConfig(max_num_seqs=3, max_waiting=5))
    assert (config.max_num_seqs, config.max_num_batched_tokens, config.max_waiting, config.block_size) == (
        3,
        2048,
        5,
        16,
    )
    with pytest.raises(ValueError, match="block_size"):
        Scheduler(SchedulerConfig(block_size=16), KVCacheManager(4, block_size=8))


def test_a_long_prefill_takes_the_whole_budget_alone_and_a_capped_chunk_beside_others() -> None:
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_waiting=8, block_size=4, long_prefill_chunk=16
    )
    sched = Scheduler(config, KVCacheManager(64, 4))
    sched.add(seq("long", 150))
    assert plan(step(sched)) == [("long", 0, 64, False)]  # alone: the whole budget
    sched.add(seq("short", 10, start=500))
    # beside a newcomer: a chunk of 16, and the newcomer's prefill in the same step (it is short: not capped)
    assert plan(step(sched)) == [("long", 64, 16, False), ("short", 0, 10, True)]
    assert plan(step(sched)) == [("short", 10, 1, True), ("long", 80, 16, False)]


def test_without_a_cap_a_long_prefill_takes_what_the_budget_leaves() -> None:
    sched = make(budget=64)
    sched.add(seq("long", 150))
    step(sched)
    sched.add(seq("short", 10, start=500))
    assert plan(step(sched)) == [("long", 64, 64, False)]  # (the newcomer waits for the next step)


def test_the_chunk_cap_must_not_be_negative() -> None:
    with pytest.raises(InvalidRequestError, match="long_prefill_chunk"):
        SchedulerConfig(long_prefill_chunk=-1)
