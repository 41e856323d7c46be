"""Shared-secret auth between the backend and its engine replicas: ``Authorization: Bearer <KVCHAT_ENGINE_SECRET>``.

Every route but ``/health`` (which vllm-router polls without headers, and which says nothing but up or down) needs
the secret when one is set. A replica without a secret listens on loopback only (``kvchat engine-serve`` refuses any
other host without one): the namespace header is trusted, so whoever can reach the replica picks the namespace.
"""

from __future__ import annotations

import hmac

from fastapi import Request

from backend.engine_server.errors import Unauthorized


def require_secret(request: Request) -> None:
    """The FastAPI dependency every guarded route carries."""
    secret: str | None = request.app.state.engine_secret
    if secret is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), secret.encode()):
        raise Unauthorized("missing or wrong engine secret (send Authorization: Bearer <KVCHAT_ENGINE_SECRET>)")


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")
