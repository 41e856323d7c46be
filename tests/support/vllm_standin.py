"""A stand-in for a vLLM replica, for the tests that need one where vLLM is not installed: an HTTP server on loopback
that answers what vLLM's OpenAI server answers and nothing of kvchat's (``/kvchat/*`` is a 404, as on vLLM).

- ``GET /v1/models``: one model card with its ``max_model_len`` (what ``RemoteEngine`` reads to size prompts);
- ``POST /v1/completions``: a one-token SSE stream (token 42, ``finish_reason`` length), with ``usage``;
- ``POST /reset_prefix_cache``: 200 with an empty body when ``dev_mode`` (vLLM serves it only with
  ``VLLM_SERVER_DEV_MODE=1``), else 404;
- ``GET /health``: 200; anything else: 404 ``{"detail": "Not Found"}`` (FastAPI's, as vLLM answers it).

``info``, when given, is answered at ``GET /kvchat/info``: then the server poses as a kvchat replica whose cache
control is gone (every other ``/kvchat/*`` call fails), e.g. to stop it after the client started.
Every request's method and path (with its query) is kept in ``requests``, in order.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from support.server import free_port

MAX_MODEL_LEN = 2048


def _completion_stream() -> bytes:
    delta = {"choices": [{"index": 0, "text": "x", "token_ids": [42], "finish_reason": None}]}
    usage = {"prompt_tokens": 4, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 0}}
    final = {"choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": "length"}], "usage": usage}
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in (delta, final)) + b"data: [DONE]\n\n"


class VllmStandIn:
    """Started at construction; ``stop()`` closes it (a stopped stand-in refuses connections)."""

    def __init__(
        self, model: str, *, dev_mode: bool = False, info: dict[str, Any] | None = None, port: int | None = None
    ) -> None:
        self.model, self.dev_mode, self.info = model, dev_mode, info
        self.requests: list[tuple[str, str]] = []
        self.port = port or free_port()  # (a given port: a replica that comes back where it was)
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), _handler(self))
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def received(self, method: str, path: str) -> int:
        """How many requests with this method and path (query included) it received."""
        return self.requests.count((method, path))

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(10)

    def answer(self, method: str, path: str) -> tuple[int, str, bytes]:
        """Status, content type and body for one request."""
        self.requests.append((method, path))
        route = path.split("?", 1)[0]
        if (method, route) == ("GET", "/v1/models"):
            card = {"id": self.model, "object": "model", "max_model_len": MAX_MODEL_LEN}
            return 200, "application/json", json.dumps({"object": "list", "data": [card]}).encode()
        if (method, route) == ("POST", "/v1/completions"):
            return 200, "text/event-stream", _completion_stream()
        if (method, route) == ("POST", "/reset_prefix_cache") and self.dev_mode:
            return 200, "text/plain", b""
        if (method, route) == ("GET", "/health"):
            return 200, "text/plain", b""
        if (method, route) == ("GET", "/kvchat/info") and self.info is not None:
            return 200, "application/json", json.dumps(self.info).encode()
        return 404, "application/json", b'{"detail": "Not Found"}'


def _handler(standin: VllmStandIn) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self) -> None:
            length = int(self.headers.get("content-length") or 0)
            self.rfile.read(length)
            status, kind, body = standin.answer(self.command, self.path)
            self.send_response(status)
            self.send_header("content-type", kind)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _serve

        def log_message(self, format: str, *args: Any) -> None:  # (quiet: the tests read ``requests``)
            pass

    return Handler
