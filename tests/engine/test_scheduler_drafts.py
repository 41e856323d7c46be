"""The scheduler's part of suffix drafts: drafts ride on a decode step within the cost model's limit, never preempt,
and only the accepted ones stay computed (the rejected ones' blocks go back)."""

from __future__ import annotations

from engine.kv.block_hash import root_hash
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import Sequence

ROOT = root_hash("m", "ns")


def running(sched: Scheduler, *prompts: tuple[str, int]) -> list[Sequence]:
    """Sequences whose prompts (id, tokens) are computed and whose first token is sampled (they decode next)."""
    seqs = [Sequence(rid, list(range(100, 100 + n)), SamplingParams(), ROOT) for rid, n in prompts]
    for seq in seqs:
        sched.add(seq)
    sched.update_after_step(sched.schedule())
    for seq in seqs:
        seq.append_token(1)
    return seqs


def make(num_blocks: int = 64, limit: int = 4) -> Scheduler:
    return Scheduler(SchedulerConfig(8, 64, 8, 4), KVCacheManager(num_blocks, 4), lambda decoding: limit)


def test_a_decode_step_carries_the_drafts_within_the_limit() -> None:
    sched = make(limit=3)
    (a,) = running(sched, ("a", 6))
    a.draft_token_ids = [7, 8, 9, 10, 11]
    item = sched.schedule().scheduled[0]
    assert (item.start_pos, item.num_new_tokens, item.drafts, item.need_logits) == (6, 4, (7, 8, 9), True)
    assert item.token_ids == [1, 7, 8, 9]
    assert sched.kv.block_table("a") == [0, 1, 2]  # 10 slots


def test_only_the_accepted_drafts_stay_computed() -> None:
    sched = make(limit=3)
    (a,) = running(sched, ("a", 6))
    a.draft_token_ids = [7, 8, 9]
    out = sched.schedule()
    out.scheduled[0].num_accepted = 1
    sched.update_after_step(out)
    assert a.num_computed_tokens == 8  # the decoded token and one draft
    assert sched.kv.block_table("a") == [0, 1, 2]  # the 9th token (the next one) needs a third block


def test_rejected_drafts_give_back_the_blocks_they_took() -> None:
    sched = make(limit=8)
    (a,) = running(sched, ("a", 8))
    a.draft_token_ids = list(range(20, 28))
    out = sched.schedule()
    assert sched.kv.block_table("a") == [0, 1, 2, 3, 4]  # 17 slots
    sched.update_after_step(out)  # nothing accepted
    assert sched.kv.block_table("a") == [0, 1, 2]
    assert sched.kv.num_free_blocks == 64 - 3


def test_no_drafts_where_the_cost_model_says_none() -> None:
    sched = make(limit=0)
    (a,) = running(sched, ("a", 6))
    a.draft_token_ids = [7, 8]
    assert sched.schedule().scheduled[0].drafts == ()


def test_drafts_never_preempt_a_neighbour() -> None:
    sched = make(num_blocks=5, limit=8)
    a, b = running(sched, ("a", 7), ("b", 7))  # 2 + 2 blocks hold their next token; 1 is free
    a.draft_token_ids = list(range(20, 28))
    out = sched.schedule()
    assert [(i.seq.request_id, i.drafts) for i in out.scheduled] == [("a", ()), ("b", ())]  # 3 more were needed
    assert out.preempted == []
    assert b.status is a.status


def test_no_drafts_while_a_prompt_waits_or_prefills() -> None:
    sched = Scheduler(SchedulerConfig(8, 8, 8, 4), KVCacheManager(64, 4), lambda decoding: 4)
    (a,) = running(sched, ("a", 6))
    sched.add(Sequence("b", list(range(300, 320)), SamplingParams(), ROOT))  # 20 tokens: 3 steps at a budget of 8
    for _ in range(3):
        a.draft_token_ids = [7, 8, 9]
        out = sched.schedule()
        assert [i.drafts for i in out.scheduled if i.seq is a] == [()]  # b's prompt is still being computed
        sched.update_after_step(out)
        a.append_token(1)
    a.draft_token_ids = [7, 8, 9]
    [item] = [i for i in sched.schedule().scheduled if i.seq is a]
    assert item.drafts == (7, 8, 9)  # b decodes too now: the drafts ride again
