"""``/metrics``: Prometheus text exposition of the engine's and the backend's metrics (backend/core/metrics.py).

NOTE: an operator surface, not a tenant one: its counters add up every tenant's traffic (cache hits included), so a
tenant must not read them. With ``KVCHAT_METRICS_TOKEN`` set, a scraper sends it as a bearer token; without one,
only clients on this machine (loopback) are answered, e.g. a Prometheus agent beside the server.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from backend.api.deps import StateDep, operator_access
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
    operator_access(request, state.settings.metrics_token, "KVCHAT_METRICS_TOKEN")
    return Response(state.metrics.render(), media_type=CONTENT_TYPE)
