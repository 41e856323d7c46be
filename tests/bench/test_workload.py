"""The workload generator on a tiny synthetic dataset, and one in-process kvchat run on the tiny model.

No performance assertions: benchmarks are programs, not tests (STYLE.md, habit 13).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bench.driver import DriverSpec, run_system
from bench.metrics import TurnRecord, percentile, summarize
from bench.runners import SystemOptions
from bench.workload import Arrival, ThinkTime, WorkloadConfig, build_sessions

CONVERSATIONS = [
    {
        "id": "c1",
        "turns": [
            {"role": "User", "content": "Where is my order #1?"},
            {"role": "AGENT", "content": "Let me check order #1 for you."},
            {"role": "user", "content": "It was due yesterday."},
            {"role": "agent", "content": "It ships today."},
        ],
    },
    {
        "id": "c2",
        "turns": [
            {"role": "agent", "content": "Hi! How can I help?"},  # a leading agent turn is dropped
            {"role": "user", "content": "I want a refund."},
            {"role": "user", "content": "The item is broken."},  # same-role runs are merged
            {"role": "agent", "content": "Sorry! A refund is on its way."},
        ],
    },
    {
        "id": "c3",
        "turns": [
            {"role": "user", "content": "Reset my password please."},
            {"role": "agent", "content": "I sent you a reset link."},
        ],
    },
]
GUIDELINES = {
    "Order Issue": {
        "description": "orders",
        "subflows": {
            "Status": {
                "instructions": ["Ask for the order id."],
                "actions": [{"type": "interaction", "button": "Pull up Account", "text": "Find it.", "subtext": []}],
            }
        },
    },
    "Refunds": {
        "description": "refunds and returns",
        "subflows": {
            "Initiate Refund": {
                "instructions": ["Ask why."],
                "actions": [{"type": "kb query", "button": "Validate", "text": "Check it.", "subtext": ["Email"]}],
            }
        },
    },
}


@pytest.fixture
def data_dir(tmp_path: Path) -> Path:
    lines = "\n".join(json.dumps(c) for c in CONVERSATIONS) + "\n"
    (tmp_path / "cucom_ecommerce_dev.jsonl").write_text(lines)
    (tmp_path / "abcd_guidelines.json").write_text(json.dumps(GUIDELINES))
    return tmp_path


def test_sessions_are_deterministic_and_share_the_policy_prefix(data_dir: Path) -> None:
    config = WorkloadConfig(data_dir=data_dir, turns=3, seed=7, policy_chars=400)
    first, again = build_sessions(config, 3), build_sessions(config, 3)
    assert first == again
    assert [s.session_id for s in first] == ["s7-0000", "s7-0001", "s7-0002"]
    assert len({s.system_prompt for s in first}) == 1
    assert "# Agent handbook" in first[0].system_prompt
    assert "[Pull up Account] Find it." in first[0].system_prompt
    assert all([t.index for t in s.turns] == [1, 2, 3] for s in first)
    assert build_sessions(WorkloadConfig(data_dir=data_dir, turns=3, seed=8, policy_chars=400), 3) != first


def test_recorded_agent_turns_become_assistant_messages(data_dir: Path) -> None:
    session = build_sessions(WorkloadConfig(data_dir=data_dir, turns=3, policy_chars=400), 1)[0]
    t1, t2, t3 = session.turns
    assert session.messages(1) == [
        {"role": "system", "content": session.system_prompt},
        {"role": "user", "content": t1.user},
    ]
    assert session.messages(3)[1:] == [
        {"role": "user", "content": t1.user},
        {"role": "assistant", "content": t1.reference_reply},
        {"role": "user", "content": t2.user},
        {"role": "assistant", "content": t2.reference_reply},
        {"role": "user", "content": t3.user},
    ]
    # each turn's prompt extends the previous one: what a prefix cache can reuse
    assert session.messages(3)[: len(session.messages(2)) - 1] == session.messages(2)[:-1]
    with pytest.raises(ValueError, match="outside"):
        session.messages(4)


def test_conversations_are_normalised_and_spliced(data_dir: Path) -> None:
    sessions = build_sessions(WorkloadConfig(data_dir=data_dir, turns=5, policy_chars=0), 1)
    pairs = {(t.user, t.reference_reply) for t in sessions[0].turns}
    assert ("I want a refund.\nThe item is broken.", "Sorry! A refund is on its way.") in pairs
    assert len({t.conversation_id for t in sessions[0].turns}) == 3  # 2 + 1 + 1 + ... spliced back to back
    assert "Agent handbook" not in sessions[0].system_prompt


def test_arrival_and_think_time_follow_the_config(data_dir: Path) -> None:
    ramp = WorkloadConfig(data_dir=data_dir, turns=2, arrival=Arrival.RAMP, arrival_window_s=4.0, think_time_s=1.5)
    sessions = build_sessions(ramp, 4)
    assert [s.start_s for s in sessions] == [0.0, 1.0, 2.0, 3.0]
    assert all(s.think_s == (0.0, 1.5) for s in sessions)
    later = build_sessions(ramp, 2, start=2)
    assert [s.session_id for s in later] == ["s0-0002", "s0-0003"]
    assert [s.start_s for s in later] == [0.0, 1.0]
    exp = WorkloadConfig(data_dir=data_dir, turns=3, think=ThinkTime.EXP, think_time_s=2.0)
    assert build_sessions(exp, 2)[0].think_s == build_sessions(exp, 2)[0].think_s
    assert build_sessions(exp, 2)[0].think_s[0] == 0.0


def test_summaries_of_records() -> None:
    records = [
        TurnRecord("a", 1, 0.0, (0.5, 0.6, 0.7), 3, 100, 0),
        TurnRecord("a", 2, 1.0, (1.1, 1.2, 1.3), 3, 150, 120),
        TurnRecord("b", 1, 0.0, (), 0, 100, None, "boom"),
    ]
    s = summarize(records, concurrency=2, sessions=2, turns_planned=4, timed_out=False, kv_peak_bytes=None)
    assert (s.turns_done, s.errors, s.first_error) == (2, 1, "boom")
    assert s.ttft_s.mean == pytest.approx(0.3)
    assert s.itl_s.mean == pytest.approx(0.1)
    assert s.output_tokens == 6
    assert s.throughput_tok_s == pytest.approx(6 / 1.3)
    assert s.hit_rate == pytest.approx(120 / 250)
    assert s.hit_rate_by_turn == {1: 0.0, 2: pytest.approx(0.8)}
    assert s.ttft_by_turn_s == {1: pytest.approx(0.5), 2: pytest.approx(0.1)}
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5


def test_kvchat_in_process_runner_on_the_tiny_model(data_dir: Path, tiny_model_dir: Path, tmp_path: Path) -> None:
    spec = DriverSpec(
        system="kvchat",
        options=SystemOptions(str(tiny_model_dir), threads=1, kv_mb=8, max_tokens=4, dtype="float32", log_dir=tmp_path),
        workload=WorkloadConfig(data_dir=data_dir, turns=2, policy_chars=200),
        levels=(2,),
        level_budgets_s=(60.0,),
        grace_s=30.0,
    )
    events: list[dict[str, object]] = []
    result = asyncio.run(run_system(spec, events.append))
    assert (result.status, result.error) == ("ok", None)
    (level,) = result.levels
    assert (level.concurrency, level.sessions, level.turns_planned, level.turns_done) == (2, 2, 4, 4)
    assert level.errors == 0 and not level.timed_out
    assert level.output_tokens == 16
    assert level.ttft_s.n == 4 and level.ttft_s.mean is not None and level.ttft_s.mean > 0
    assert level.itl_s.n == 4
    assert level.throughput_tok_s > 0
    assert set(level.ttft_by_turn_s) == {1, 2}
    hit_turn_2 = level.hit_rate_by_turn[2]
    assert hit_turn_2 is not None and hit_turn_2 > 0
    assert level.kv_peak_bytes is not None and level.kv_peak_bytes > 0
    assert result.peak_rss_bytes is not None and result.peak_rss_bytes > 0
    assert sum(1 for e in events if "turn" in e) == 4
