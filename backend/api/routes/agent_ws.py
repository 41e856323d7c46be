"""``/ws/agent``: an agent's live feed of the tenant's inbox (``backend/chat/agent_feed.py``)."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from backend.api.state import AppState
from backend.chat.agent_feed import AgentFeed
from backend.chat.protocol import CloseCode

router = APIRouter(tags=["agents: inbox"])


@router.websocket("/ws/agent")
async def agent_socket(ws: WebSocket) -> None:
    state: AppState | None = getattr(ws.app.state, "kvchat", None)
    if state is None:  # still starting: come back soon
        await ws.accept()
        await ws.close(CloseCode.TRY_AGAIN_LATER, "kvchat is starting")
        return
    await AgentFeed(ws, state.sessionmaker, state.chat.hub, state.chat.desk).serve()
