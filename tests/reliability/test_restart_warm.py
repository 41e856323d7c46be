"""A graceful restart keeps the KV cache: a real ``kvchat serve`` process, stopped with SIGTERM, and a new one on the
same data directory serves the same prompt from its disk tier, with the same output as before.

Also the other arm: another tenant's identical prompt after the restart gets no cached token (the namespace salt comes
from the server's secret, kept in the data directory, never from the client).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from support.server import CHAT_TOKEN
from support.server_process import REPO_ROOT, ServerProcess, start_server_process, tiny_server_env

PROMPT = " ".join(f"ticket {n} for order {n * 7} needs a refund per clause {n % 9}." for n in range(40))


def _complete(server: ServerProcess, token: str) -> dict[str, Any]:
    body = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, "temperature": 0}
    response = httpx.post(
        f"{server.http}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {token}"}, timeout=120
    )
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _metric(server: ServerProcess, name: str, **labels: str) -> float:
    """One sample of the operator's ``/metrics`` (loopback: no operator token needed)."""
    text = httpx.get(f"{server.http}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise AssertionError(f"no {name}{labels} in /metrics")


def _second_tenant_token(env: dict[str, str]) -> str:
    """``kvchat tenants create`` (the operator's CLI) on the server's database: the new tenant's chat token."""
    out = subprocess.run(
        [sys.executable, "-m", "backend.cli", "tenants", "create", "other-tenant"],
        cwd=REPO_ROOT,
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    return next(line.split()[-1] for line in out.splitlines() if line.startswith("chat token"))


def test_a_graceful_restart_serves_the_same_prompt_from_disk(pg_url: str, tiny_model_dir: Path, tmp_path: Path) -> None:
    env = tiny_server_env(pg_url, tiny_model_dir, tmp_path / "data", kv_min_free_space_gb=0)
    first = start_server_process(env, tmp_path / "serve-1.log")
    try:
        before = _complete(first, CHAT_TOKEN)
        # SIGTERM: the drain stops the engine, which writes memory back to disk (uvicorn re-raises the signal)
        assert first.terminate() in (0, -signal.SIGTERM)
    finally:
        first.kill()

    second = start_server_process(env, tmp_path / "serve-2.log")
    try:
        assert _metric(second, "kvchat:kv_blocks", tier="disk", state="stored") > 0
        after = _complete(second, CHAT_TOKEN)
        prompt_tokens = after["usage"]["prompt_tokens"]
        cached = after["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert cached >= prompt_tokens - 16 and cached > 0  # every full block but the one holding the last token
        assert after["choices"][0]["message"]["content"] == before["choices"][0]["message"]["content"]
        assert _metric(second, "kvchat:kv_promoted_blocks_total") * 16 >= cached
        other = _complete(second, _second_tenant_token(env))
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    finally:
        second.terminate()
        second.kill()
