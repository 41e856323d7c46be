"""A tenant's tool endpoint for tests: a real HTTP server on loopback whose paths answer as a tool would — well, late,
with garbage, or with an error — and which records every request it got."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

ORDER = {"order_id": "A1234", "status": "shipped", "carrier": "DHL", "eta": "2026-05-03"}
# (/tracking: JSON that escapes "/", as some encoders do)
TRACKING = b'{"order_id": "A1234", "tracking": "https:\\/\\/track.example.net\\/A1234"}'


@dataclass
class Received:
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class ToolServer:
    port: int
    received: list[Received] = field(default_factory=list)
    slow_s: float = 2.0

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"


@contextmanager
def tool_server(slow_s: float = 2.0) -> Iterator[ToolServer]:
    """Paths: ``/order`` (the order's JSON), ``/slow`` (the same after ``slow_s``), ``/garbage`` (not JSON),
    ``/fail`` (HTTP 500)."""
    state = ToolServer(0, slow_s=slow_s)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            state.received.append(Received(self.path, dict(self.headers), json.loads(raw or b"null")))
            if self.path == "/slow":
                time.sleep(state.slow_s)
            if self.path == "/fail":
                self._answer(500, b'{"error": "down"}')
            elif self.path == "/garbage":
                self._answer(200, b"<html>Internal error</html>")
            elif self.path == "/tracking":
                self._answer(200, TRACKING)
            else:
                self._answer(200, json.dumps(ORDER).encode())

        def _answer(self, status: int, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except OSError:
                pass  # the caller gave up (a timeout test)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    state.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()
