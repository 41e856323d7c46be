"""What the chat layer needs beyond OpenAI (``/kvchat/...``), and ``/health`` and ``/metrics``.

Each route is the ``EngineClient`` method of the same name; bodies and answers are declared once, in
``backend/engine_client/messages.py`` and ``wire.py``. They are
plain ``def`` routes: FastAPI runs them on its thread pool, because invalidation and erasure may delete disk files
(``backend/engine_client/protocol.py`` says which calls block).

NOTE: vllm-router forwards paths it does not know to one worker *without the request's headers* (no secret, no
``X-Session-ID``), so the remote client calls these routes on each replica directly, never through the router.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, generate_latest

from backend.engine_client.engine_metrics import CONTENT_TYPE, EngineCollector, read_in_place
from backend.engine_client.messages import (
    CacheChanges,
    Done,
    Erase,
    Flush,
    InfoAnswer,
    Invalidate,
    InvalidatePrefix,
    Pin,
    Released,
    SessionRef,
    Temperature,
    Unpin,
    Unpinned,
)
from backend.engine_client.protocol import EngineClient
from backend.engine_client.wire import encode
from backend.engine_server.auth import require_secret
from backend.engine_server.completions import EngineDep

router = APIRouter(prefix="/kvchat", dependencies=[Depends(require_secret)])
public = APIRouter()  # /health: vllm-router's health check sends no headers


@public.get("/health")
def health(request: Request) -> JSONResponse:
    engine: EngineClient = request.app.state.engine
    running = engine.is_running
    return JSONResponse({"status": "ok" if running else "stopped"}, status_code=200 if running else 503)


@public.get("/metrics", dependencies=[Depends(require_secret)])
def metrics(request: Request) -> Response:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(read_in_place(request.app.state.engine)))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE)


@router.get("/info")
def info(engine: EngineDep, request: Request) -> Any:
    """What a client checks at start: the model (its fingerprint), the prompt limit, the replica's identity."""
    return encode(InfoAnswer(model=request.app.state.model_id, info=engine.info, prompt_limit=engine.prompt_limit))


@router.get("/stats")
def stats(engine: EngineDep) -> Any:
    return encode(engine.stats())


@router.post("/invalidate")
def invalidate(body: Invalidate, engine: EngineDep) -> Any:
    return encode(
        engine.invalidate(body.namespace, session=body.session, from_position=body.from_position, reason=body.reason)
    )


@router.post("/invalidate-prefix")
def invalidate_prefix(body: InvalidatePrefix, engine: EngineDep) -> Any:
    return encode(engine.invalidate_prefix(body.namespace, body.token_ids, body.from_position, body.reason))


@router.post("/flush")
def flush(body: Flush, engine: EngineDep) -> Any:
    return encode(engine.flush_namespace(body.namespace, body.reason))


@router.post("/sessions/release")
def release(body: SessionRef, engine: EngineDep) -> Any:
    return encode(Released(blocks_freed=engine.release_session(body.session)))


@router.post("/sessions/erase")
def erase(body: Erase, engine: EngineDep) -> Any:
    return encode(engine.erase_session(body.session, body.namespace))


@router.post("/sessions/footprint")
def footprint(body: SessionRef, engine: EngineDep) -> Any:
    return encode(engine.session_footprint(body.session))


@router.post("/sessions/temperature")
def temperature(body: Temperature, engine: EngineDep) -> Any:
    engine.set_session_temperature(body.session, body.temperature)
    return encode(Done())


@router.post("/pin")
def pin(body: Pin, engine: EngineDep) -> Any:
    return encode(engine.pin_prefix(body.namespace, body.token_ids))


@router.post("/unpin")
def unpin(body: Unpin, engine: EngineDep) -> Any:
    return encode(Unpinned(blocks=engine.unpin(body.namespace)))


@router.get("/cache/settings")
def cache_settings(engine: EngineDep) -> Any:
    return encode(engine.cache_settings())


@router.post("/cache/settings")
def configure_cache(body: CacheChanges, engine: EngineDep) -> Any:
    return encode(engine.configure_cache(**body.changes))
