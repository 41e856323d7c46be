"""The engine's Prometheus gauges and counters (vLLM-style ``kvchat:`` names), shared by the backend's ``/metrics``
(``backend/core/metrics.py``) and the engine server's (``backend/engine_server/control.py``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import CacheStats, EngineInfo, EngineStats, TierStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class EngineCollector(Collector):
    """Engine gauges and counters, from ``read``: the engine's info and stats now, or None while it is down.

    NOTE: ``read`` must not wait on the network: a scrape runs on the server's thread pool, and the backend's
    ``read`` is the snapshot its engine client keeps fresh (``backend/engine_client/control.py``).
    """

    def __init__(self, read: Callable[[], tuple[EngineInfo, EngineStats] | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily]:
        now = self._read()
        if now is None:
            return
        info, s = now
        block_bytes = info.block_size * info.kv_bytes_per_token
        yield GaugeMetricFamily("kvchat:num_requests_running", "Requests in the running batch.", s.running)
        yield GaugeMetricFamily("kvchat:num_requests_waiting", "Requests waiting to be scheduled.", s.waiting)
        usage = s.kv.num_used_blocks / s.kv.num_blocks if s.kv.num_blocks else 0.0
        yield GaugeMetricFamily("kvchat:kv_cache_usage_perc", "Share of KV blocks held by requests (0-1).", usage)
        by_tier = GaugeMetricFamily(
            "kvchat:kv_cache_bytes",
            "KV bytes per tier and state (cached: published, reusable).",
            labels=["tier", "state"],
        )
        by_tier.add_metric(["memory", "used"], s.kv.num_used_blocks * block_bytes)
        by_tier.add_metric(["memory", "cached"], s.kv.num_cached_blocks * block_bytes)
        by_tier.add_metric(["memory", "capacity"], s.kv.num_blocks * block_bytes)
        yield by_tier
        held = s.kv.num_used_blocks + s.kv.num_evictable_blocks
        yield from _tiers(s.tiers, held * block_bytes)
        yield _counter(
            "kvchat:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.kv.num_query_tokens
        )
        yield _counter("kvchat:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.kv.num_hit_tokens)
        yield _counter("kvchat:prompt_tokens", "Prompt tokens of finished requests.", s.prompt_tokens)
        yield _counter("kvchat:generation_tokens", "Tokens generated.", s.generated_tokens)
        yield _counter("kvchat:request_success", "Requests finished.", s.requests_finished)
        yield _counter("kvchat:engine_steps", "Engine steps (one batch each).", s.steps)
        # engine/cpu_share.py: fewer threads than cores while other work holds them (summed over replicas)
        yield GaugeMetricFamily("kvchat:engine_threads", "OpenMP threads of the engine's steps now.", s.threads)
        yield _counter("kvchat:engine_width_changes", "Changes of the engine's step width.", s.width_changes)
        # suffix decoding (engine/spec): acceptance rate = accepted / draft tokens; tokens per verify step =
        # (accepted + verify steps) / verify steps, and their spread in the histogram (docs/operating.md)
        yield _counter("kvchat:spec_decode_draft_tokens", "Draft tokens verified.", s.drafted_tokens)
        yield _counter("kvchat:spec_decode_accepted_tokens", "Draft tokens accepted.", s.accepted_tokens)
        yield _counter("kvchat:spec_decode_verify_steps", "Request steps that verified drafts.", s.verify_steps)
        yield _tokens_per_verify_step(s.tokens_per_verify_step)
        yield from _by_block_type(s.cache)


TOKENS_PER_STEP_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)


def _tokens_per_verify_step(counts: Mapping[int, int]) -> HistogramMetricFamily:
    """The tokens each verify step gave a request (its accepted drafts and one more), as a histogram: 1 means every
    draft was rejected. Its ``_sum`` over its ``_count`` is the mean tokens per verify step."""
    buckets = [(str(le), sum(n for k, n in counts.items() if k <= le)) for le in TOKENS_PER_STEP_BUCKETS]
    buckets.append(("+Inf", sum(counts.values())))
    return HistogramMetricFamily(
        "kvchat:spec_decode_tokens_per_verify_step",
        "Tokens a request's verify step gave (accepted drafts + 1).",
        buckets=buckets,
        sum_value=sum(k * n for k, n in counts.items()),
    )


def _tiers(t: TierStats, memory_bytes: int) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    """KV blocks by tier, bytes by tier, and the traffic between tiers.

    NOTE: the memory states overlap (a block a request holds may be cached and pinned too); ``kv_tier_bytes`` counts
    each block once: memory is what requests hold plus the free blocks kept for reuse.
    """
    blocks = GaugeMetricFamily(
        "kvchat:kv_blocks",
        "KV blocks per tier and state (memory: used by requests, cached = reusable, pinned; disk: stored).",
        labels=["tier", "state"],
    )
    blocks.add_metric(["memory", "used"], t.memory_blocks_used)
    blocks.add_metric(["memory", "cached"], t.memory_blocks_cached)
    blocks.add_metric(["memory", "pinned"], t.pinned_blocks)
    blocks.add_metric(["disk", "stored"], t.disk_blocks)
    yield blocks
    memory = GaugeMetricFamily("kvchat:kv_tier_bytes", "KV bytes held per tier.", labels=["tier"])
    memory.add_metric(["memory"], memory_bytes)
    memory.add_metric(["disk"], t.disk_bytes)
    yield memory
    yield _counter("kvchat:kv_disk_writes", "Blocks written to the disk tier.", t.disk_writes)
    yield _counter(
        "kvchat:kv_disk_writes_refused",
        "Disk-tier writes refused (free-space guard, size cap, full write queue).",
        t.disk_writes_refused,
    )
    yield _counter(
        "kvchat:kv_disk_quarantined", "Disk-tier files that failed a check on load (quarantined).", t.disk_quarantined
    )
    yield _counter("kvchat:kv_promoted_blocks", "Blocks loaded from disk back into memory.", t.promoted_blocks)
    yield _counter("kvchat:kv_demoted_blocks", "Idle blocks moved from memory to disk.", t.demoted_blocks)
    yield _counter("kvchat:kv_expired_blocks", "Blocks dropped when their tier's TTL passed.", t.expired_blocks)


def _by_block_type(cache: CacheStats) -> Iterator[CounterMetricFamily]:
    """Prefix-cache queries and hits by semantic block type, and what invalidation freed, by reason.

    NOTE: block types and reasons come from small fixed vocabularies (the splitter's types, the engine's own labels,
    the invalidation reasons), so these labels stay bounded.
    """
    queries = CounterMetricFamily(
        "kvchat:prefix_cache_queries_by_type", "Prompt tokens looked up, by block type.", labels=["block_type"]
    )
    hits = CounterMetricFamily(
        "kvchat:prefix_cache_hits_by_type", "Prompt tokens found in the cache, by block type.", labels=["block_type"]
    )
    for block_type, n in sorted(cache.query_tokens_by_type.items()):
        queries.add_metric([block_type], n)
        hits.add_metric([block_type], cache.hit_tokens_by_type.get(block_type, 0))
    freed_blocks = CounterMetricFamily(
        "kvchat:invalidated_blocks", "Cached blocks freed by invalidation, by reason.", labels=["reason"]
    )
    freed_tokens = CounterMetricFamily(
        "kvchat:invalidated_tokens", "Cached tokens freed by invalidation, by reason.", labels=["reason"]
    )
    for reason, counts in sorted(cache.invalidations.items()):
        freed_blocks.add_metric([reason], counts.blocks_freed)
        freed_tokens.add_metric([reason], counts.tokens_freed)
    yield from (queries, hits, freed_blocks, freed_tokens)


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, documentation, value=value)


def read_in_place(engine: EngineClient) -> Callable[[], tuple[EngineInfo, EngineStats] | None]:
    """``EngineCollector``'s reader of an engine whose ``stats`` is bookkeeping in memory (the in-process engine)."""

    def read() -> tuple[EngineInfo, EngineStats] | None:
        return (engine.info, engine.stats()) if engine.is_running else None

    return read
