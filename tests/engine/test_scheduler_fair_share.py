"""The scheduler's fair share by tenant (VTC), on integers: no model, every plan exact.

A simulated step plans, "computes" and appends a token to each sequence that got logits; a sequence finishes after
``REPLY`` output tokens. Served tokens are what the plans computed (prefill chunks + decodes), per tenant.
"""

from __future__ import annotations

from collections import Counter
from itertools import count

from engine.fair_share import FairShare
from engine.kv.block_hash import root_hash
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

ROOT = root_hash("m", "ns")
SAMPLED = 7777
REPLY = 4
_starts = count(1000, 100)


def make(max_num_seqs: int = 2, budget: int = 16, max_waiting: int = 128, num_blocks: int = 256) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_waiting, 4), KVCacheManager(num_blocks, 4))


def seq(rid: str, tenant: str, n: int = 8, weight: float = 1.0, session: str | None = None) -> Sequence:
    start = next(_starts)  # NOTE: distinct tokens: no prefix hits unless a test builds one
    prompt = list(range(start, start + n))
    return Sequence(rid, prompt, SamplingParams(), ROOT, session=session, share=FairShare(tenant, weight))


def step(sched: Scheduler, served: Counter[str] | None = None) -> SchedulerOutput:
    out = sched.schedule()
    sched.update_after_step(out)
    for item in out.scheduled:
        if served is not None:
            served[item.seq.share.tenant] += item.num_new_tokens
        if item.need_logits:
            item.seq.append_token(SAMPLED)
            if item.seq.num_output_tokens >= REPLY:
                sched.finish(item.seq, SequenceStatus.FINISHED_LENGTH)
    return out


def admitted(out: SchedulerOutput) -> list[str]:
    return [i.seq.request_id for i in out.scheduled if i.start_pos == 0]


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(i.seq.request_id, i.start_pos, i.num_new_tokens) for i in out.scheduled]


def test_a_tenant_with_nothing_running_takes_a_slot_from_a_burst() -> None:
    sched = make(max_num_seqs=2)
    for i in range(6):
        sched.add(seq(f"a{i}", "A"))
    assert admitted(step(sched)) == ["a0", "a1"]
    a1 = sched.get("a1")
    sched.add(seq("b0", "B"))
    out = step(sched)
    # FCFS: b0 waited for a2..a5. Fair: A holds both slots (over an even share of 1), B none: a1, the newest, yields.
    assert plan(out) == [("a0", 8, 1), ("b0", 0, 8)]
    assert out.preempted == [a1]
    later = [step(sched) for _ in range(4)]
    assert [o.preempted for o in later] == [[], [], [], []]  # B's one slot is its share: A does not take it back
    # a1 is A's first once a slot frees (its reply stalled mid-stream), from its published blocks: 1 token recomputed.
    assert plan(later[2]) == [("b0", 10, 1), ("a1", 8, 1)]


def test_a_newcomer_takes_a_slot_while_the_holders_still_prefill() -> None:
    sched = capped(max_num_seqs=2, budget=64, chunk=16)
    for i in range(2):
        sched.add(seq(f"a{i}", "A", n=64))
    step(sched)
    step(sched)  # (the first tenant's two long prompts hold both slots, a chunk a step)
    sched.add(seq("b0", "B", n=8))
    out = step(sched)
    # the slot is handed over before the step's prefill is planned: b0 goes first, a0 keeps the rest of the chunk
    assert admitted(out) == ["b0"] and [s.request_id for s in out.preempted] == ["a1"]
    assert plan(out)[0] == ("b0", 0, 8)


def test_no_slot_changes_hands_with_a_single_slot() -> None:
    one = make(max_num_seqs=1)
    one.add(seq("a0", "A"))
    step(one)
    one.add(seq("b0", "B"))
    assert [o.preempted for o in (step(one), step(one))] == [[], []]  # nobody holds more than a share of one slot


def test_equal_weights_split_served_tokens_evenly_while_both_are_backlogged() -> None:
    sched = make(max_num_seqs=4, budget=16)
    for i in range(40):
        sched.add(seq(f"a{i}", "A"))
    for i in range(40):
        sched.add(seq(f"b{i}", "B"))  # (all of B's arrive after all of A's)
    served: Counter[str] = Counter()
    for _ in range(40):
        step(sched, served)
    assert served == Counter({"A": 217, "B": 217})  # FCFS: A's 40 first, B next to nothing


def test_weights_two_to_one_split_served_tokens_two_to_one() -> None:
    sched = make(max_num_seqs=4, budget=16)
    for i in range(40):
        sched.add(seq(f"a{i}", "A", weight=2.0))
        sched.add(seq(f"b{i}", "B"))
    served: Counter[str] = Counter()
    for _ in range(60):
        step(sched, served)
    assert served == Counter({"A": 436, "B": 218})


def test_a_lone_tenant_gets_the_whole_engine() -> None:
    """Work-conserving: the same plans, step by step, as with no tenants at all."""

    def plans(tenant: str | None) -> list[list[tuple[str, int, int]]]:
        sched = make(max_num_seqs=3, budget=16)
        for i in range(8):
            s = seq(f"r{i}", tenant or "")
            sched.add(s if tenant else Sequence(s.request_id, s.prompt_token_ids, s.params, ROOT))
        return [[(i.seq.request_id, i.start_pos, i.num_new_tokens) for i in step(sched).scheduled] for _ in range(20)]

    lone = plans("A")
    assert lone == plans(None)
    assert [sum(n for _, _, n in p) for p in lone[:3]] == [16, 10, 3]  # prompts fill the budget up to max_num_seqs


def test_a_tenant_back_from_idle_banks_no_credit() -> None:
    sched = make(max_num_seqs=1, budget=16)
    for i in range(3):
        sched.add(seq(f"a{i}", "A"))
    served: Counter[str] = Counter()
    for _ in range(8):  # A alone: a0 then a1 (a prefill and 3 decodes each)
        step(sched, served)
    b = seq("b0", "B")
    sched.add(b)
    assert sched.fair.rank(b.share, b.fair_session)[0] == sched.fair.tenants.counter("A")
    # B gets the next slot (ties go to the oldest: a2 waits since before), then they alternate; B is not served its
    # "missed" share of A's solo time.
    for i in range(3, 6):
        sched.add(seq(f"a{i}", "A"))
    sched.add(seq("b1", "B"))
    order = []
    for _ in range(40):
        order += admitted(step(sched))
    assert order == ["a2", "b0", "a3", "b1", "a4", "a5"]


def test_prefix_hits_are_free_only_computed_tokens_are_charged() -> None:
    sched = make(max_num_seqs=4, budget=64)
    first = seq("a0", "A", n=17)
    sched.add(first)
    step(sched)  # 17 prompt tokens computed: blocks 0..3 (16 tokens) published
    again = Sequence("a1", list(first.prompt_token_ids), SamplingParams(), ROOT, share=FairShare("A"))
    sched.add(again)
    before = sched.fair.tenants.counter("A")
    out = step(sched)
    assert [(i.seq.request_id, i.start_pos, i.num_new_tokens) for i in out.scheduled] == [("a0", 17, 1), ("a1", 16, 1)]
    assert sched.fair.tenants.counter("A") - before == 2  # a0's decode + a1's one recomputed token, not 17


def test_within_a_tenant_a_new_session_goes_before_a_busy_one() -> None:
    sched = make(max_num_seqs=1, budget=16)
    for i in range(3):
        sched.add(seq(f"s{i}", "A", session="busy"))
    step(sched)
    sched.add(seq("q0", "A", session="quiet"))
    order = []
    for _ in range(20):
        order += admitted(step(sched))
    assert order == ["q0", "s1", "s2"]


def test_preemption_gives_back_the_planned_tokens() -> None:
    # 4 blocks: a and b (8 tokens each) fill the pool; a's first decode preempts b, which was planned in the step.
    sched = Scheduler(SchedulerConfig(4, 64, 8, 4), KVCacheManager(4, 4))
    a, b = seq("a", "A"), seq("b", "B")
    sched.add(a)
    sched.add(b)
    step(sched)
    out = step(sched)
    assert out.preempted == [b]
    assert (sched.fair.tenants.counter("A"), sched.fair.tenants.counter("B")) == (9.0, 8.0)


def capped(max_num_seqs: int = 8, budget: int = 64, chunk: int = 16, lone: bool = False) -> Scheduler:
    config = SchedulerConfig(max_num_seqs, budget, 128, 4, long_prefill_chunk=chunk, cap_lone_steps=lone)
    return Scheduler(config, KVCacheManager(256, 4))


def prefilled(out: SchedulerOutput) -> int:
    return sum(i.num_new_tokens for i in out.scheduled if not i.seq.output_token_ids)


def test_beside_another_tenant_a_step_prefills_one_chunk_in_all() -> None:
    alone = capped()
    for i in range(6):
        alone.add(seq(f"a{i}", "A", n=10))
    assert prefilled(alone.schedule()) == 60  # one tenant: every prompt in one step, a chunk cap each
    shared = capped()
    for i in range(6):
        shared.add(seq(f"a{i}", "A", n=10))
    shared.add(seq("b", "B", n=10))
    # (two tenants: a step costs one chunk of prefill at most, so the other waits behind one such step)
    assert prefilled(shared.schedule()) == 16


def test_where_lone_steps_are_capped_a_burst_finishes_its_prompts_a_chunk_at_a_time() -> None:
    sched = capped(budget=64, chunk=16, lone=True)
    for i in range(6):
        sched.add(seq(f"a{i}", "A", n=10))
    first = sched.schedule()
    assert prefilled(first) == 16
    # (whole prompts first: one finishes in the first step, the next one's rest in the second)
    assert [(i.seq.request_id, i.num_new_tokens, i.need_logits) for i in first.scheduled] == [
        ("a0", 10, True),
        ("a1", 6, False),
    ]
    lone = capped(budget=64, chunk=16, lone=True)
    lone.add(seq("a0", "A", n=60))
    assert prefilled(lone.schedule()) == 60  # (a prompt alone still takes the whole budget)


def test_a_newcomer_is_planned_beside_another_tenants_running_prefills() -> None:
    sched = capped(budget=64, chunk=16)
    for i in range(4):
        sched.add(seq(f"a{i}", "A", n=100))
    step(sched)  # A's four long prompts are admitted, a chunk each
    assert sched.num_running == 4
    sched.add(seq("b", "B", n=8))
    first = step(sched)
    assert prefilled(first) <= 16
    # B's counter is lifted to A's, and the tie goes to B, whose tenant has nothing running: B's prompt is planned in
    # the first step after it arrived (first come, first served, B would wait for the rest of A's 400 tokens: 6 steps)
    assert plan(first)[0] == ("b", 0, 8)


def test_a_tenants_running_prefills_still_go_before_its_own_admissions() -> None:
    sched = capped(budget=64, chunk=16)
    sched.add(seq("a0", "A", n=100))
    sched.add(seq("x", "X", n=4))  # keeps the engine shared, so every step's prefill stays within the chunk
    step(sched)
    sched.add(seq("a1", "A", n=8))
    later = [plan(step(sched)) for _ in range(3)]
    firsts = [next((p for p in ps if p[0].startswith("a")), None) for ps in later]
    # a1 ties with a0 (one tenant, one counter): a0's running prefill first, as when A is alone
    assert firsts[0] is not None and firsts[0][0] == "a0"


def test_a_newcomers_step_plans_no_other_tenants_prefill() -> None:
    sched = capped(budget=64, chunk=32)
    sched.add(seq("a0", "A", n=4))
    step(sched)  # a0 decodes from now on
    for i in range(1, 4):
        sched.add(seq(f"a{i}", "A", n=100))
    step(sched)  # A's long prompts prefill beside a0's decode
    sched.add(seq("b", "B", n=8))
    newcomer = plan(step(sched))
    # B's first token comes from a step of A's decode and B's 8 prompt tokens, not of A's 32-token chunks too
    assert ("b", 0, 8) in newcomer
    assert [p for p in newcomer if p[0] != "b" and p[2] > 1] == []
    assert len(plan(step(sched))) > 2  # then A's chunks go on (B decodes: no newcomer any more)


def test_newcomers_of_several_tenants_share_their_step() -> None:
    sched = capped(budget=64, chunk=32)
    sched.add(seq("a0", "A", n=4))
    step(sched)
    for i in range(1, 3):
        sched.add(seq(f"a{i}", "A", n=100))
    step(sched)
    sched.add(seq("b", "B", n=8))
    sched.add(seq("c", "C", n=8))
    both = plan(step(sched))
    # B and C arrive together: one step for both (not one step each), still without A's chunks
    assert ("b", 0, 8) in both and ("c", 0, 8) in both
    assert [p for p in both if p[0].startswith("a") and p[2] > 1] == []
