"""``bench.fairness`` without a server: the queue-time arithmetic, the served-token counts and the printed table."""

from __future__ import annotations

from bench.fairness import Served, build_parser, queue_delta, table


def test_queue_delta_is_the_mean_wait_between_two_scrapes() -> None:
    before = {"A": (10.0, 4.0)}
    after = {"A": (16.0, 7.0), "B": (0.5, 2.0)}
    assert queue_delta(before, after) == {"A": 2.0, "B": 0.25}
    assert queue_delta(after, after) == {"A": None, "B": None}


def test_served_counts_prefilled_and_completion_tokens() -> None:
    s = Served()
    s.add({"prefilled_tokens": 30, "completion_tokens": 32, "cached_tokens": 300})
    s.add({"prefilled_tokens": 2, "completion_tokens": 8, "cached_tokens": 0})
    assert (s.replies, s.tokens) == (2, 72)


def test_the_table_compares_each_phase_with_b_alone() -> None:
    ttft = {"n": 8, "p50": 0.1, "p99": 0.2, "max": 0.2}
    engine = {"n": 8, "p50": 0.05, "p99": 0.1, "max": 0.1}
    slow = {"n": 8, "p50": 0.3, "p99": 0.5, "max": 0.5}
    backlog = {"A": {"tokens": 200, "completion": 100, "tokens_per_s": 5.0}, "B": {"tokens": 100}}
    report = {
        "config": {"flood_sessions": 60, "flood_streams": 200},
        "phases": {
            "b_alone": {"b_ttft": ttft, "b_engine_ttft": engine},
            "b_beside_sessions": {"b_ttft": slow, "b_engine_ttft": engine},
            "b_beside_streams": {"b_ttft": ttft},
            "split_weighted": backlog,
            "lone": {"A": {"tokens_per_s": 250.0, "completion": 3000}},
        },
    }
    lines = table(report).splitlines()
    assert lines[2].split() == ["beside", "A's", "60", "sessions", "300", "500", "8", "2.5x", "50", "100"]
    assert lines[4] == "split_weighted: A 200 tokens, B 100 tokens, A/B = 2.00"
    assert lines[5] == "lone A: 250.0 served tokens/s (3000 completion tokens)"
    assert build_parser().parse_args(["--database-url", "x"]).flood_sessions == 60
