"""Issue 46: a cache-control call that some replica did not do names that replica. ``RemoteEngine`` against a
stand-in vLLM replica (no ``/kvchat/*`` routes; ``support/vllm_standin.py``) and a kvchat replica that is gone after
the start: erase, flush, invalidate and pin report each replica's outcome, and the coarse erase (vLLM's prefix-cache
reset) reaches the replica, or says why not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from backend.engine_client.remote import RemoteEngine
from backend.engine_client.replica_report import (
    PrefixCacheReset,
    ReplicaOutcome,
    ReplicaReport,
    ReplicaResult,
    ReportedErasure,
    ReportedInvalidation,
    ReportedPin,
    report_of,
)
from backend.engine_client.values import ErasureResult
from backend.engine_client.wire import encode
from engine.llm_engine import LLMEngine
from support.server import free_port
from support.vllm_standin import VllmStandIn

pytestmark = pytest.mark.anyio
RESET = "/reset_prefix_cache?reset_running_requests=true"
NO_ERASE = "vLLM has no per-session erase"
NO_CONTROL = "vLLM has no per-session or per-namespace cache control"


@pytest.fixture
def vllm(tiny_model_dir: Path) -> Iterator[VllmStandIn]:
    standin = VllmStandIn(str(tiny_model_dir), dev_mode=True)
    yield standin
    standin.stop()


@pytest.fixture
async def remote(vllm: VllmStandIn, tiny_model_dir: Path) -> AsyncIterator[RemoteEngine]:
    engine = RemoteEngine(vllm.url, model=str(tiny_model_dir), timeout_s=2.0)
    await engine.start()
    yield engine
    await engine.stop()


def _unsupported(url: str, detail: str) -> ReplicaReport:
    return ReplicaReport((ReplicaResult(url, ReplicaOutcome.UNSUPPORTED, detail),))


# ---------------------------------------------------------------------- the report


def test_a_report_names_the_replicas_that_did_not_do_it() -> None:
    report = ReplicaReport(
        (
            ReplicaResult("http://a", ReplicaOutcome.DONE),
            ReplicaResult("http://b", ReplicaOutcome.UNSUPPORTED, "no erase"),
            ReplicaResult("http://c", ReplicaOutcome.FAILED, "cannot be reached"),
        )
    )
    assert [r.replica for r in report.gaps] == ["http://b", "http://c"]
    assert not report.complete
    assert report.describe("erased") == (
        "not erased on http://b (unsupported: no erase); http://c (failed: cannot be reached)"
    )
    reset = ReplicaReport((ReplicaResult("http://b", ReplicaOutcome.CACHE_RESET, "whole cache"),))
    after = report.replaced(reset)
    assert [r.outcome.value for r in after.results] == ["done", "cache_reset", "failed"]
    assert after.with_outcome(ReplicaOutcome.CACHE_RESET) == ("http://b",)
    assert [r.replica for r in after.gaps] == ["http://c"]


def test_the_in_process_engines_results_carry_an_empty_complete_report() -> None:
    report = report_of(ErasureResult(3, 1))
    assert (report, report.complete, report.describe("erased")) == (ReplicaReport(), True, "")


# ---------------------------------------------------------------------- RemoteEngine with a vLLM replica


async def test_an_erase_on_a_vllm_replica_names_it_instead_of_reporting_zeros(
    remote: RemoteEngine, vllm: VllmStandIn
) -> None:
    erased = await asyncio.to_thread(remote.erase_session, "s1", "tenant-a")
    assert erased == ReportedErasure(0, 0, _unsupported(vllm.url, NO_ERASE))
    assert not report_of(erased).complete
    assert [path for _, path in vllm.requests if "kvchat" in path] == ["/kvchat/info"]  # (only the start's probe)


async def test_flush_invalidate_and_pin_name_the_vllm_replica(remote: RemoteEngine, vllm: VllmStandIn) -> None:
    flushed = remote.flush_namespace("tenant-a")
    invalidated = remote.invalidate("tenant-a", session="s1", from_position=0)
    pinned = remote.pin_prefix("tenant-a", list(range(40)))
    assert flushed == ReportedInvalidation(0, 0, 0, _unsupported(vllm.url, NO_CONTROL))
    assert invalidated == ReportedInvalidation(0, 0, 0, _unsupported(vllm.url, NO_CONTROL))
    assert pinned == ReportedPin(0, 0, 0, _unsupported(vllm.url, "vLLM has no pinning"))


async def test_the_coarse_erase_resets_the_vllm_replicas_whole_prefix_cache(
    remote: RemoteEngine, vllm: VllmStandIn
) -> None:
    assert isinstance(remote, PrefixCacheReset)
    report = await asyncio.to_thread(remote.reset_prefix_caches, [vllm.url])
    assert report == ReplicaReport(
        (ReplicaResult(vllm.url, ReplicaOutcome.CACHE_RESET, "its whole prefix cache, every session's"),)
    )
    assert report.complete
    assert vllm.received("POST", RESET) == 1


async def test_a_vllm_without_dev_mode_cannot_reset_and_says_how_to_allow_it(
    remote: RemoteEngine, vllm: VllmStandIn
) -> None:
    vllm.dev_mode = False
    dead = f"http://127.0.0.1:{free_port()}"
    report = await asyncio.to_thread(remote.reset_prefix_caches, [vllm.url, dead])
    assert [(r.replica, r.outcome) for r in report.results] == [
        (vllm.url, ReplicaOutcome.UNSUPPORTED),
        (dead, ReplicaOutcome.FAILED),
    ]
    assert report.results[0].detail == "no /reset_prefix_cache: vLLM serves it with VLLM_SERVER_DEV_MODE=1"
    assert "cannot be reached" in report.results[1].detail
    assert vllm.received("POST", RESET) == 1  # asked, and refused with a 404


async def test_an_erase_names_a_kvchat_replica_gone_since_the_start_and_erases_on_the_others(
    vllm: VllmStandIn, tiny_model_dir: Path, tiny_engine: LLMEngine
) -> None:
    info = {"engine": "kvchat", "model": "kvchat/tiny", "info": encode(tiny_engine.info), "prompt_limit": 2048}
    kvchat = VllmStandIn(str(tiny_model_dir), info=info)
    remote = RemoteEngine(vllm.url, [kvchat.url, vllm.url], model=str(tiny_model_dir), timeout_s=2.0)
    await remote.start()
    kvchat.stop()
    try:
        erased = await asyncio.to_thread(remote.erase_session, "s1", "tenant-a")
    finally:
        await remote.stop()
    report = report_of(erased)
    assert [(r.replica, r.outcome) for r in report.results] == [
        (kvchat.url, ReplicaOutcome.FAILED),
        (vllm.url, ReplicaOutcome.UNSUPPORTED),
    ]
    assert "cannot be reached" in report.results[0].detail
    assert (erased.memory_blocks, erased.disk_blocks) == (0, 0)
