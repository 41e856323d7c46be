from __future__ import annotations

from engine.kv.block_hash import BlockHash, hash_chain, root_hash
from engine.kv.session_index import SessionIndex

BS = 4
ROOT = root_hash("m", "ns")
SYSTEM = [7] * 8  # two full blocks shared by every session
ALICE = hash_chain(ROOT, [*SYSTEM, 1, 1, 1, 1, 2, 2, 2, 2], BS)
BOB = hash_chain(ROOT, [*SYSTEM, 3, 3, 3, 3], BS)


def test_chains_share_exactly_the_system_prompt() -> None:
    assert len(ALICE) == 4
    assert len(BOB) == 3
    assert ALICE[:2] == BOB[:2]
    assert len(set(ALICE) | set(BOB)) == 5


def test_empty_index() -> None:
    index = SessionIndex()
    assert len(index) == 0
    assert "alice" not in index
    assert index.chain("alice") == ()
    assert index.sessions_of(ALICE[0]) == 0
    assert index.release("alice") == []


def test_record_counts_sessions_per_hash() -> None:
    index = SessionIndex()
    index.record("alice", ALICE)
    index.record("bob", BOB)
    assert len(index) == 2
    assert "alice" in index
    assert "bob" in index
    assert index.chain("alice") == tuple(ALICE)
    assert [index.sessions_of(h) for h in ALICE] == [2, 2, 1, 1]
    assert [index.sessions_of(h) for h in BOB] == [2, 2, 1]


def test_release_returns_only_the_unshared_tail_tail_first() -> None:
    index = SessionIndex()
    index.record("alice", ALICE)
    index.record("bob", BOB)
    assert index.release("alice") == [ALICE[3], ALICE[2]]
    assert "alice" not in index
    assert len(index) == 1
    assert [index.sessions_of(h) for h in ALICE] == [1, 1, 0, 0]
    assert index.release("alice") == []  # already released
    assert index.release("bob") == [BOB[2], BOB[1], BOB[0]]
    assert len(index) == 0
    assert [index.sessions_of(h) for h in (*ALICE, *BOB)] == [0] * 7


def test_release_keeps_the_head_the_system_message_fills() -> None:
    index = SessionIndex()
    index.record("alice", ALICE, head=2)
    assert index.release("alice") == [ALICE[3], ALICE[2]]
    assert [index.sessions_of(h) for h in ALICE] == [0] * 4  # forgotten all the same
    index.record("bob", BOB, head=2)
    index.record("bob", BOB)  # the latest request had no system message
    assert index.release("bob") == [BOB[2], BOB[1], BOB[0]]


def test_a_truncated_chain_keeps_no_more_head_than_it_has_left() -> None:
    index = SessionIndex()
    index.record("alice", ALICE, head=3)
    index.truncate("alice", 1)
    assert index.release("alice") == []
    index.record("alice", ALICE, head=9)  # a head longer than the chain is the whole chain
    assert index.release("alice") == []


def test_record_replaces_the_chain_and_decrements_old_counts() -> None:
    index = SessionIndex()
    index.record("alice", ALICE)
    index.record("bob", BOB)
    # Alice's next turn re-tokenized her history differently: the new chain keeps the system prompt only.
    new = hash_chain(ROOT, [*SYSTEM, 9, 9, 9, 9], BS)
    index.record("alice", new)
    assert len(index) == 2
    assert index.chain("alice") == tuple(new)
    assert [index.sessions_of(h) for h in ALICE] == [2, 2, 0, 0]
    assert index.sessions_of(new[2]) == 1
    assert index.release("alice") == [new[2]]
    assert [index.sessions_of(h) for h in BOB] == [1, 1, 1]


def test_record_extending_the_same_chain_keeps_counts_at_one() -> None:
    index = SessionIndex()
    index.record("alice", ALICE[:2])
    index.record("alice", ALICE)
    assert [index.sessions_of(h) for h in ALICE] == [1, 1, 1, 1]
    assert index.release("alice") == ALICE[::-1]


def test_record_same_chain_twice_is_idempotent() -> None:
    index = SessionIndex()
    index.record("alice", ALICE)
    index.record("alice", ALICE)
    assert [index.sessions_of(h) for h in ALICE] == [1, 1, 1, 1]
    assert len(index) == 1


def test_empty_chain_registers_the_session() -> None:
    index = SessionIndex()
    index.record("alice", ALICE)
    index.record("alice", [])
    assert "alice" in index
    assert index.chain("alice") == ()
    assert [index.sessions_of(h) for h in ALICE] == [0, 0, 0, 0]
    assert index.release("alice") == []
    assert "alice" not in index


def test_a_hash_listed_twice_counts_once() -> None:
    index = SessionIndex()
    dup: list[BlockHash] = [ALICE[0], ALICE[1], ALICE[0]]
    index.record("alice", dup)
    index.record("bob", BOB)
    assert index.chain("alice") == (ALICE[0], ALICE[1])
    assert index.sessions_of(ALICE[0]) == 2
    assert index.release("alice") == []
    assert index.sessions_of(ALICE[0]) == 1


def test_wanted_by_others_and_truncate() -> None:
    index = SessionIndex()
    index.record("alice", ALICE)
    index.record("bob", BOB)
    assert index.wanted_by_others("alice") == set(BOB)
    assert index.wanted_by_others("bob") == set(ALICE)
    assert index.wanted_by_others(None) == set(ALICE) | set(BOB)
    assert index.wanted_by_others("carol") == set(ALICE) | set(BOB)
    index.truncate("alice", 3)
    assert index.chain("alice") == tuple(ALICE[:3])
    assert index.sessions_of(ALICE[3]) == 0
    assert index.sessions_of(ALICE[0]) == 2
    index.truncate("carol", 0)  # unknown: ignored
    assert "carol" not in index
    assert index.release("alice") == [ALICE[2]]
