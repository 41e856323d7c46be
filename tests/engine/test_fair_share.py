"""Virtual token counters on integers: charging by weight, the idle lift, no banked credit, bounded memory."""

from __future__ import annotations

import math

import pytest

from engine.errors import InvalidRequestError
from engine.fair_share import FairCounters, FairShare, VirtualCounters


def test_charge_divides_by_the_weight() -> None:
    vc: VirtualCounters[str] = VirtualCounters()
    vc.enter("a", 1.0)
    vc.enter("b", 2.0)
    vc.charge("a", 10)
    vc.charge("b", 10)
    assert (vc.counter("a"), vc.counter("b")) == (10.0, 5.0)
    assert vc.virtual_time == 5.0
    vc.charge("b", -4)  # a planned chunk given back
    assert vc.counter("b") == 3.0


def test_a_key_back_from_idle_is_lifted_to_the_smallest_active_counter() -> None:
    vc: VirtualCounters[str] = VirtualCounters()
    vc.enter("a")
    vc.enter("b")
    vc.charge("a", 100)
    vc.charge("b", 40)
    vc.enter("c")  # new: lifted to min(100, 40)
    assert vc.counter("c") == 40.0
    vc.leave("b")  # b idles at 40 ...
    vc.charge("c", 30)
    vc.enter("b")  # ... and comes back: lifted to min(a=100, c=70), not kept at 40
    assert vc.counter("b") == 70.0


def test_a_key_ahead_of_the_others_keeps_its_counter_across_an_idle_gap() -> None:
    vc: VirtualCounters[str] = VirtualCounters()
    vc.enter("a")
    vc.enter("b")
    vc.charge("a", 100)
    vc.charge("b", 10)
    vc.leave("a")
    vc.enter("a")
    assert vc.counter("a") == 100.0  # idling must not wipe a debt either


def test_no_credit_is_banked_while_nobody_is_active() -> None:
    vc: VirtualCounters[str] = VirtualCounters()
    vc.enter("a")
    vc.charge("a", 500)
    vc.leave("a")
    assert vc.virtual_time == 500.0
    vc.enter("b")  # b arrives first after a quiet period: starts at the virtual time, not at 0
    assert vc.counter("b") == 500.0
    vc.enter("a")
    assert vc.counter("a") == 500.0


def test_counters_of_idle_keys_at_or_below_the_virtual_time_are_dropped() -> None:
    vc: VirtualCounters[str] = VirtualCounters()
    vc.enter("a")
    vc.enter("b")
    vc.charge("a", 5)
    vc.charge("b", 9)
    vc.leave("b")  # above the virtual time (5): kept, it is a debt
    assert len(vc) == 2
    vc.leave("a")
    assert len(vc) == 1  # a (5 <= 5) dropped; b (9 > 5) kept
    vc.enter("a")
    vc.charge("a", 10)
    vc.leave("a")  # virtual time 15 now passes b's 9: both dropped
    assert len(vc) == 0
    assert vc.virtual_time == 15.0


def test_two_requests_of_one_key_keep_it_active_until_the_last_leaves() -> None:
    vc: VirtualCounters[str] = VirtualCounters()
    vc.enter("a")
    vc.enter("a")
    vc.leave("a")
    assert vc.is_active("a")
    vc.leave("a")
    assert not vc.is_active("a")


def test_fair_counters_rank_by_tenant_then_session() -> None:
    fc = FairCounters()
    a, b = FairShare("A"), FairShare("B", 2.0)
    fc.enter(a, "s1")
    fc.enter(a, "s2")
    fc.enter(b, "t1")
    fc.charge(a, "s1", 6)
    fc.charge(b, "t1", 8)
    assert fc.rank(a, "s1") == (6.0, 6.0)
    assert fc.rank(a, "s2") == (6.0, 0.0)  # same tenant counter; the idle session goes first inside A
    assert fc.rank(b, "t1") == (4.0, 8.0)  # weight 2 halves the tenant's counter, not the session's
    fc.leave(a, "s1")
    fc.leave(a, "s2")
    fc.enter(a, "s3")  # A back from idle: lifted to B's 4, its sessions start afresh
    assert fc.rank(a, "s3") == (6.0, 0.0)


@pytest.mark.parametrize("weight", [0.0, -1.0, math.nan])
def test_a_weight_must_be_positive(weight: float) -> None:
    with pytest.raises(InvalidRequestError, match="weight must be > 0"):
        FairShare("t", weight)
