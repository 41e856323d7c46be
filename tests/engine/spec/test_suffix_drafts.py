"""The suffix drafter on integers: per-request drafts, the tenant's tree, isolation, erasure, bounds."""

from __future__ import annotations

import pytest

from engine.spec import suffix_drafts
from engine.spec.cost_model import DraftCostModel, LiveCostModel
from engine.spec.suffix_drafts import DraftSettings, SuffixDrafter

pytestmark = pytest.mark.skipif(not suffix_drafts.available(), reason="needs the spec extra (arctic-inference)")

REPLY = [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]  # a reply a tenant gave before
CUE = [40, 41, 42, 43]  # what preceded it


def finished_reply(drafter: SuffixDrafter, rid: str, tenant: str, session: str | None = None) -> None:
    drafter.begin(rid, tenant, [1, 2, *CUE], session=session)
    drafter.end(rid, REPLY, keep=True)


def draft_after_cue(drafter: SuffixDrafter, rid: str, tenant: str) -> list[int]:
    """A new request of ``tenant`` whose prompt ends with the cue and the reply's first tokens."""
    drafter.begin(rid, tenant, [9, 8, *CUE, *REPLY[:3]])
    return drafter.propose(rid, [], 8)


def test_the_request_drafts_from_its_own_prompt() -> None:
    drafter = SuffixDrafter()
    drafter.begin("r", "t", [7, 1, 2, 3, 4, 5, 6, 9, 9, 1, 2, 3])
    assert drafter.propose("r", [], 8) == [4, 5, 6]  # the match [1, 2, 3] continues with 4, 5, 6 (factor 1.0)


def test_a_tenant_gets_drafts_from_its_own_recent_replies() -> None:
    drafter = SuffixDrafter()
    finished_reply(drafter, "a1", "tenant-a")
    draft = draft_after_cue(drafter, "a2", "tenant-a")
    assert draft and draft == REPLY[3 : 3 + len(draft)]


def test_another_tenant_never_gets_them() -> None:
    drafter = SuffixDrafter()
    finished_reply(drafter, "a1", "tenant-a")
    assert draft_after_cue(drafter, "b1", "tenant-b") == []


def test_the_reply_so_far_feeds_the_request_tree() -> None:
    drafter = SuffixDrafter()
    drafter.begin("r", "t", [1, 2])
    assert drafter.propose("r", [30, 31, 32, 33, 30, 31], 8) == [32, 33]


def test_an_aborted_reply_leaves_the_tenant_tree() -> None:
    drafter = SuffixDrafter()
    drafter.begin("a1", "tenant-a", [1, 2, *CUE])
    drafter.propose("a1", REPLY, 4)  # (the reply so far is in the tenant's tree while the request runs)
    drafter.end("a1", REPLY, keep=False)
    assert draft_after_cue(drafter, "a2", "tenant-a") == []


def test_erasing_a_session_removes_its_replies_only() -> None:
    drafter = SuffixDrafter()
    finished_reply(drafter, "a1", "tenant-a", session="s1")
    assert drafter.erase_session("tenant-a", "s1") == 1
    assert draft_after_cue(drafter, "a2", "tenant-a") == []
    finished_reply(drafter, "a3", "tenant-a", session="s2")
    assert drafter.erase_session("tenant-a", "s1") == 0
    assert draft_after_cue(drafter, "a4", "tenant-a")  # s2's reply is still there


def test_the_oldest_idle_tenant_tree_goes_beyond_the_bound() -> None:
    drafter = SuffixDrafter(DraftSettings(max_tenants=2))
    for tenant in ("t1", "t2", "t3"):
        finished_reply(drafter, f"{tenant}-r", tenant)
    assert draft_after_cue(drafter, "x1", "t1") == []  # t1's tree was dropped (least recently used)
    assert draft_after_cue(drafter, "x3", "t3")


def test_the_cost_model_verifies_less_of_a_request_whose_drafts_fail() -> None:
    """Each draft is scored against the tokens the request produced next, verified or not: the request whose replies
    leave the tree's text gets shorter drafts, the one that follows it gets them whole."""
    model = DraftCostModel(base_ms=((1, 16.0), (16, 40.0)), row_ms=1.0, acceptance=0.5)
    drafter = SuffixDrafter(cost=LiveCostModel(model))
    loop = [30, 31, 32, 33, 34, 35, 36, 37]
    drafter.begin("follows", "t", loop * 3)
    drafter.begin("leaves", "t", loop * 3)
    first = drafter.propose("follows", [], 8)
    assert 0 < len(first) < 8  # at the prior rate (0.5) only the first few tokens pay
    assert drafter.propose("leaves", [], 8) == first
    follows: list[int] = []
    leaves: list[int] = []
    for i in range(40):
        verified = len(drafter.propose("follows", follows, 8))
        follows += [loop[(len(follows) + j) % 8] for j in range(verified + 1)]  # its draft passed, and one more
        leaves.append(30)
        drafter.propose("leaves", leaves, 8)  # the tree says 31, 32, ...
        leaves.append(200 + i)  # ... the request goes elsewhere
    assert drafter.propose("follows", follows, 8) == [loop[(len(follows) + j) % 8] for j in range(8)]
    assert len(drafter.propose("leaves", [*leaves, 30, 31, 32], 8)) < len(first)


def test_a_request_cannot_begin_twice() -> None:
    drafter = SuffixDrafter()
    drafter.begin("r", "t", [1])
    with pytest.raises(ValueError, match="already drafting"):
        drafter.begin("r", "t", [1])
