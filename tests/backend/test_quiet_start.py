"""A clean first start is quiet (issue 45): nothing at warning level, no access-log line for the health probes or the
dashboard's polls, and the keys the start generated framed as the console's last lines. A real ``kvchat serve``
process on a fresh SQLite data dir (what ``make run`` does), with the tiny test model."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import httpx

from support.server_process import start_server_process

CHAT_KEY = re.compile(r"^  chat token \(also its OpenAI API key\)  (\S+)$")
ADMIN_KEY = re.compile(r"^  admin API key                         (kvc_admin_\S+)$")


def test_a_clean_first_start_is_quiet_and_ends_with_the_keys(tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {
        "KVCHAT_MODEL": str(tiny_model_dir),
        "KVCHAT_ENGINE_DEVICE": "cpu",
        "KVCHAT_ENGINE_DTYPE": "float32",
        "KVCHAT_MAX_KV_MEMORY_MB": "8",
        "KVCHAT_DATA_DIR": str(tmp_path / "data"),
        "KVCHAT_CACHE_DIR": str(tmp_path / "cache"),
        "KVCHAT_LOG_LEVEL": "info",
        "KVCHAT_BOOTSTRAP_CHAT_TOKEN": "",
        "KVCHAT_BOOTSTRAP_ADMIN_KEY": "",
        "KVCHAT_DISABLE_KERNELS": "1",  # (no C build into the fresh cache: not what this test is about)
        "KVCHAT_GC_FREEZE": "1",  # (what `make run` does; the suite turns it off elsewhere: tests/conftest.py)
    }
    server = start_server_process(env, tmp_path / "serve.log")
    try:
        lines = server.log().splitlines()
        admin_key = next(m.group(1) for line in lines if (m := ADMIN_KEY.match(line)))
        for path in ("/livez", "/readyz", "/metrics", "/admin/stats?window_s=60", "/admin/sessions/summary?limit=50"):
            response = httpx.get(f"{server.http}{path}", headers={"X-API-Key": admin_key}, timeout=30)
            assert response.status_code == 200, (path, response.text)
        assert httpx.get(f"{server.http}/admin/sessions", headers={"X-API-Key": admin_key}).status_code == 200
        after_polls = server.log().splitlines()
    finally:
        assert server.terminate() in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has shut down
    assert [line for line in after_polls if re.search(r" (WARNING|ERROR|CRITICAL) ", line)] == []
    assert not any(
        re.search(r'"GET /(livez|readyz|metrics|admin/stats|admin/sessions/summary)', x) for x in after_polls
    )
    assert any('"GET /admin/sessions HTTP/1.1" 200' in line for line in after_polls)  # other requests still logged
    assert not any("Context impl" in line or "Will assume" in line for line in after_polls)  # alembic's machinery
    assert any("Running upgrade  -> 0001" in line for line in after_polls)  # ... but not its migrations
    rule = "=" * 72
    start_lines = lines
    assert start_lines[-1].startswith(rule) and set(start_lines[-1]) == {"="}
    assert start_lines[-6] == start_lines[-1]
    assert start_lines[-5] == (
        "  First start: the default tenant's keys. They are shown only this once (only their hashes are stored):"
    )
    assert CHAT_KEY.match(start_lines[-4])
    assert ADMIN_KEY.match(start_lines[-3])
    assert "kvchat ready: chat page" in start_lines[-7]
