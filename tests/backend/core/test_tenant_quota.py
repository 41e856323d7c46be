"""The tenants' quotas at the edge, on a fake clock: concurrency, the tokens-per-minute window and its retry hint,
the weight handed to the engine, and the gated stream's release of what it admitted."""

from __future__ import annotations

from collections.abc import AsyncGenerator

import pytest

from backend.core.tenant_quota import (
    DEFAULT_QUOTA,
    WINDOW_S,
    GatedEngine,
    QuotaGate,
    RateLimited,
    TenantQuota,
    gated,
)
from backend.engine_client.values import (
    DEFAULT_SHARE,
    FairShare,
    FinishReason,
    GenerationEvent,
    RequestFinished,
    RequestStats,
    TokenDelta,
)

pytestmark = pytest.mark.anyio


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(quotas: dict[str, TenantQuota]) -> tuple[QuotaGate, Clock, list[tuple[str, str]]]:
    clock, refused = Clock(), []
    gate = QuotaGate(clock, on_refused=lambda t, r: refused.append((t, r)))
    gate.load(quotas)
    return gate, clock, refused


def finished(prompt: int, cached: int, completion: int) -> RequestFinished:
    stats = RequestStats(prompt, cached, prompt - cached, completion, 0.1, 0.0, 0.02, 0)
    return RequestFinished("r", FinishReason.STOP, "ok", (), stats)


def test_the_share_carries_the_tenant_and_its_weight() -> None:
    gate, _, _ = make({"A": TenantQuota(weight=2.0)})
    assert gate.admit("A") == FairShare("A", 2.0)
    assert gate.admit("B") == FairShare("B", 1.0)  # no row: the defaults
    assert gate.quota("B") == DEFAULT_QUOTA


def test_max_concurrent_refuses_the_request_over_it_until_one_ends() -> None:
    gate, _, refused = make({"A": TenantQuota(max_concurrent=2)})
    gate.admit("A")
    gate.admit("A")
    with pytest.raises(RateLimited, match="2 requests of this tenant are in flight") as caught:
        gate.admit("A")
    assert (caught.value.reason, caught.value.retry_after_s) == ("max_concurrent", 1.0)
    assert refused == [("A", "max_concurrent")]
    gate.admit("B")  # another tenant is not held by A's limit
    gate.release("A", 0)
    gate.admit("A")
    assert gate.in_flight("A") == 2


def test_tokens_per_minute_refuses_until_enough_of_the_window_ages_out() -> None:
    gate, clock, refused = make({"A": TenantQuota(tokens_per_minute=100)})
    gate.admit("A")
    gate.release("A", 60)  # at t=1000
    clock.now += 10
    gate.admit("A")
    gate.release("A", 50)  # at t=1010: 110 in the window
    clock.now += 5
    with pytest.raises(RateLimited, match=r"110 tokens in the last minute \(limit 100\)") as caught:
        gate.admit("A")
    # The first 60 age out at 1000 + 60: then 50 < 100.
    assert caught.value.retry_after_s == pytest.approx(1000 + WINDOW_S - clock.now)
    assert refused == [("A", "tokens_per_minute")]
    clock.now = 1000 + WINDOW_S
    assert gate.admit("A") == FairShare("A")
    assert gate.tokens_in_window("A") == 50


def test_a_refused_request_holds_no_slot() -> None:
    gate, _, _ = make({"A": TenantQuota(max_concurrent=1)})
    gate.admit("A")
    for _ in range(3):
        with pytest.raises(RateLimited):
            gate.admit("A")
    assert gate.in_flight("A") == 1


def test_set_and_reset_one_tenant() -> None:
    gate, _, _ = make({})
    gate.set("A", TenantQuota(weight=4.0))
    assert gate.admit("A").weight == 4.0
    gate.set("A", None)
    assert gate.quota("A") == DEFAULT_QUOTA


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"weight": 0.0}, "weight"),
        ({"weight": float("inf")}, "weight"),
        ({"tokens_per_minute": 0}, "tokens_per_minute"),
        ({"max_concurrent": 0}, "max_concurrent"),
    ],
)
def test_invalid_quotas_are_refused(kwargs: dict[str, float], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        TenantQuota(**kwargs)  # type: ignore[arg-type]


async def test_the_gated_stream_counts_computed_tokens_and_releases_on_close() -> None:
    served: list[tuple[str, int]] = []
    gate, _, _ = make({"A": TenantQuota(weight=2.0, max_concurrent=1)})
    gate.on_served = lambda t, stats: served.append((t, stats.prefilled_tokens))
    shares: list[FairShare] = []

    async def engine(share: FairShare) -> AsyncGenerator[GenerationEvent, None]:
        shares.append(share)
        yield TokenDelta("r", (5,), "ok")
        yield finished(prompt=40, cached=32, completion=3)

    events = [e async for e in gated(gate, "A", engine)]
    assert [type(e).__name__ for e in events] == ["TokenDelta", "RequestFinished"]
    assert shares == [FairShare("A", 2.0)]
    assert (gate.in_flight("A"), gate.tokens_in_window("A")) == (0, 8 + 3)  # the 32 cached tokens are free
    assert served == [("A", 8)]

    stream = gated(gate, "A", engine)
    await anext(stream)
    with pytest.raises(RateLimited):  # the first is still in flight
        await anext(gated(gate, "A", engine))
    await stream.aclose()  # closed early (a cancelled turn): the slot is released, nothing was computed
    assert gate.in_flight("A") == 0


async def test_the_gated_engine_passes_a_request_without_a_tenant_through() -> None:
    calls: list[FairShare] = []

    class Inner:
        info = "inner info"

        async def generate(self, *args: object) -> AsyncGenerator[GenerationEvent, None]:
            calls.append(args[5])  # type: ignore[arg-type]
            yield finished(4, 0, 1)

    gate, _, _ = make({"A": TenantQuota(weight=3.0, max_concurrent=1)})
    engine = GatedEngine(Inner(), gate)  # type: ignore[arg-type]
    assert engine.info == "inner info"
    assert [e async for e in engine.generate([1, 2], None, "ns", "r1", None)] == [finished(4, 0, 1)]
    assert [e async for e in engine.generate([1, 2], None, "ns", "r2", None, FairShare("A"))] == [finished(4, 0, 1)]
    assert calls == [DEFAULT_SHARE, FairShare("A", 3.0)]
    assert gate.tokens_in_window("A") == 5
