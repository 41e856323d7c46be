"""``/ws/chat``: the customer chat websocket (protocol in backend/chat/protocol.py)."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from backend.chat.connection import ChatConnection, ConnectionLimits
from backend.core.state import AppState

router = APIRouter(tags=["chat"])


@router.websocket("/ws/chat")
async def chat_socket(ws: WebSocket) -> None:
    state: AppState = ws.app.state.kvchat
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
    await ChatConnection(ws, state.chat, limits, state.metrics).serve()
