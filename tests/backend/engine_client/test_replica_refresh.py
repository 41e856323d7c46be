"""Replicas that come and go (issue 45): a replica that cannot be reached is logged once when it goes down and once
when it answers again, not on every call; the router's worker list is read again, so a replica it dropped is no longer
called and a new one is added. Real HTTP servers on loopback: vLLM stand-ins as replicas, and a router stand-in that
answers vllm-router's ``/list_workers`` from a list the test changes."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from backend.engine_client.remote import RemoteEngine
from backend.engine_client.remote_control import ReplicaSet
from support.server import free_port
from support.vllm_standin import VllmStandIn

pytestmark = pytest.mark.anyio
LOGGER = "kvchat.engine_client"


class RouterStandIn:
    """``GET /list_workers`` → ``{"urls": workers}`` (vllm-router's answer); anything else 404."""

    def __init__(self, workers: list[str]) -> None:
        self.workers = workers
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                found = self.path == "/list_workers"
                body = json.dumps({"urls": standin.workers} if found else {"detail": "Not Found"}).encode()
                self.send_response(200 if found else 404)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.port = free_port()
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def replicas(tiny_model_dir: Path) -> Iterator[list[VllmStandIn]]:
    started = [VllmStandIn(str(tiny_model_dir)) for _ in range(2)]
    yield started
    for replica in started:
        replica.stop()


def _messages(caplog: pytest.LogCaptureFixture, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == level]


def test_a_dead_replica_is_logged_once_until_it_answers_again(
    tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    replica = VllmStandIn(str(tiny_model_dir))
    port = replica.port
    replica.stop()
    replicas = ReplicaSet([f"http://127.0.0.1:{port}"], {}, 2.0)
    try:
        with caplog.at_level(logging.DEBUG, logger=LOGGER):
            for _ in range(3):  # three turns' worth of best-effort calls
                with pytest.raises(Exception, match="cannot be reached"):
                    replicas.best_effort("GET", "/v1/models", {}, lambda answer: answer)
            warnings = _messages(caplog, logging.WARNING)
            back = VllmStandIn(str(tiny_model_dir), port=port)
            try:
                assert replicas.best_effort("GET", "/v1/models", {}, lambda answer: answer)[0]["object"] == "list"
                replicas.best_effort("GET", "/v1/models", {}, lambda answer: answer)
            finally:
                back.stop()
    finally:
        replicas.close()
    assert len(warnings) == 1
    assert warnings[0].startswith(f"the engine replica http://127.0.0.1:{port} cannot be reached: ")
    assert warnings[0].endswith("; it is skipped until it answers again (logged once)")
    assert len(_messages(caplog, logging.DEBUG)) == 3  # each skipped call, at debug
    assert _messages(caplog, logging.INFO) == [f"the engine replica http://127.0.0.1:{port} answers again"]
    assert _messages(caplog, logging.WARNING) == warnings  # nothing more once it answered


async def test_the_routers_list_is_read_again(
    replicas: list[VllmStandIn], tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first, second = replicas
    router = RouterStandIn([first.url])
    engine = RemoteEngine(router.url, model=str(tiny_model_dir), timeout_s=2.0)
    try:
        await engine.start()
        assert engine._replicas.urls == [first.url]
        with caplog.at_level(logging.INFO, logger=LOGGER):
            router.workers = [first.url, second.url]
            engine.refresh_replicas()
            assert engine._replicas.urls == sorted([first.url, second.url])
            engine.refresh_replicas()  # no change: no line
            router.workers = [second.url]
            engine.refresh_replicas()
            assert engine._replicas.urls == [second.url]
            report = engine.reset_prefix_caches([second.url])
        assert [r.replica for r in report.results] == [second.url]
    finally:
        await engine.stop()
        router.stop()
    assert _messages(caplog, logging.INFO) == [
        f"the router's replicas changed: added {second.url}; removed none",
        f"the router's replicas changed: added none; removed {first.url}",
    ]
