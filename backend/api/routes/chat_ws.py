"""``/ws/chat``: the customer chat websocket (protocol in backend/chat/protocol.py)."""

from __future__ import annotations

import asyncio
import contextlib

from fastapi import APIRouter, WebSocket

from backend.api.state import AppState
from backend.chat.connection import ChatConnection, ConnectionLimits
from backend.chat.protocol import CloseCode, ErrorFrame
from backend.core.errors import StartingError

router = APIRouter(tags=["chat"])
_HELLO_WAIT_S = 10.0


@router.websocket("/ws/chat")
async def chat_socket(ws: WebSocket) -> None:
    state: AppState | None = getattr(ws.app.state, "kvchat", None)
    if state is None:  # the server listens while it starts (kvchat serve): say so, and when to come back
        await _refuse_starting(ws, StartingError(ws.app.state.startup.phase))
        return
    s = state.settings
    limits = ConnectionLimits(
        max_message_bytes=s.ws_max_message_bytes,
        rate_per_s=s.ws_rate_per_second,
        burst=s.ws_rate_burst,
        max_connections_per_tenant=s.max_connections_per_tenant,
        max_connections_per_client=s.max_connections_per_client,
        max_queued_frames=s.ws_max_queued_frames,
        max_queued_bytes=s.ws_max_queued_bytes,
        allowed_origins=tuple(s.allowed_origins),
    )
    await ChatConnection(ws, state.chat, limits, state.metrics, state.heap.closed).serve()


async def _refuse_starting(ws: WebSocket, exc: StartingError) -> None:
    """The answer to the client's first frame (its ``hello``): an ``error`` frame (code ``starting``, with
    ``retry_after_ms``), then close 1013 (try again later).

    NOTE: after the hello, not before: a client sends its hello as soon as the socket opens, and one that finds the
    socket closed under it by then hears nothing but a failed send.
    """
    await ws.accept()
    with contextlib.suppress(TimeoutError):
        if (await asyncio.wait_for(ws.receive(), _HELLO_WAIT_S))["type"] == "websocket.disconnect":
            return
    frame = ErrorFrame(code=exc.code, message=str(exc), retry_after_ms=exc.retry_after_s * 1000)
    await ws.send_text(frame.model_dump_json())
    await ws.close(CloseCode.TRY_AGAIN_LATER, "kvchat is starting")
