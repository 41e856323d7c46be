"""An admin call whose control call to a remote engine gets no answer (issue 43): it is refused with 503
``unavailable`` at the deadline (``backend/engine_client/control.py``), not held for the client's timeout, and not
a 500. A real server on SQLite whose engine is a replica that stops answering its control calls once started."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.engine_client import control
from backend.engine_client.wire import encode
from engine.llm_engine import LLMEngine
from support.fake_replica import FakeReplica
from support.server import LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio

TOKEN = "test-operator-token"
OPERATOR = {"Authorization": f"Bearer {TOKEN}"}
DEADLINE_S = 0.5


@pytest.fixture
def replica(tiny_engine: LLMEngine) -> Iterator[FakeReplica]:
    info = {"engine": "kvchat", "model": "kvchat/tiny", "info": encode(tiny_engine.info), "prompt_limit": 2048}
    fake = FakeReplica(info)
    yield fake
    fake.stop()


@pytest.fixture
def live(
    sqlite_url: str, tmp_path: Path, tiny_model_dir: Path, replica: FakeReplica, monkeypatch: pytest.MonkeyPatch
) -> Iterator[LiveServer]:
    settings = server_settings(
        sqlite_url, tmp_path / "data", engine_url=replica.url, model=str(tiny_model_dir), operator_token=TOKEN
    )
    with serving(settings, None) as server:
        replica.silent_control = True
        monkeypatch.setattr(control, "TIMEOUT_S", DEADLINE_S)
        yield server
        replica.silent_control = False


async def test_a_cache_change_the_engine_does_not_answer_is_503_unavailable_at_the_deadline(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http, timeout=30) as http:
        began = time.monotonic()
        answer = await http.patch("/admin/cache/settings", headers=OPERATOR, json={"memory_ttl_s": 60})
        waited = time.monotonic() - began
    assert answer.status_code == 503, answer.text
    assert answer.json() == {
        "detail": f"the engine did not answer configure_cache within {DEADLINE_S:g} s",
        "code": "unavailable",
    }
    assert waited < 5.0  # (the deadline ended it: the remote client's own timeout is 30 s)
