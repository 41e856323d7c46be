"""The inbox's Prometheus metrics (issue 41), on the app's registry (``backend/core/metrics.py``): how long customers
wait for a person, how long until a person first answers, and how long the queue is when a session joins it. Each
worker observes the steps it runs; Prometheus sums the workers. No tenant or session label (see ``metrics.py``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

# seconds: from a few seconds (an agent at the desk) to an hour (nobody there)
_WAIT_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
_QUEUE_BUCKETS = (0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.handoffs = Counter(
            "kvchat:handoffs", "Sessions handed to a person, by reason.", ["reason"], registry=registry
        )
        self.queue_length = Histogram(
            "kvchat:inbox_queue_length",
            "Sessions waiting for a person, seen as a session joins the queue (it included).",
            buckets=_QUEUE_BUCKETS,
            registry=registry,
        )
        self.wait = Histogram(
            "kvchat:handoff_wait_seconds",
            "A hand-off's wait from the request to its first claim.",
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.first_reply = Histogram(
            "kvchat:handoff_first_reply_seconds",
            "A hand-off's time from the request to a person's first reply.",
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
