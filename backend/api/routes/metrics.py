"""``/metrics``: Prometheus text exposition of the engine's and the backend's metrics (backend/core/metrics.py).

NOTE: an operator surface, not a tenant one: its counters add up every tenant's traffic (cache hits included), so a
tenant must not read them. With ``KVCHAT_METRICS_TOKEN`` set, a scraper sends it as a bearer token; without one,
only clients on this machine (loopback) are answered, e.g. a Prometheus agent beside the server.
"""

from __future__ import annotations

import hmac
import ipaddress

from fastapi import APIRouter, HTTPException, Request, Response, status

from backend.api.deps import StateDep, bearer_token
from backend.core.metrics import CONTENT_TYPE

router = APIRouter(tags=["operations"])


@router.get(
    "/metrics",
    response_class=Response,
    responses={
        200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Prometheus text"},
        401: {"description": "KVCHAT_METRICS_TOKEN is set and the request does not carry it"},
        403: {"description": "no KVCHAT_METRICS_TOKEN is set and the client is not on this machine"},
    },
)
async def metrics(request: Request, state: StateDep) -> Response:
    """Engine and backend metrics in Prometheus' text format (no identifiers in labels)."""
    expected = state.settings.metrics_token
    if expected is not None:
        if not hmac.compare_digest(bearer_token(request).encode(), expected.encode()):
            raise HTTPException(status.HTTP_401_UNAUTHORIZED, "send the metrics token as a bearer token")
    elif not _loopback(request):
        raise HTTPException(status.HTTP_403_FORBIDDEN, "set KVCHAT_METRICS_TOKEN to scrape /metrics from elsewhere")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)


def _loopback(request: Request) -> bool:
    host = request.client.host if request.client is not None else ""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
