"""One websocket chat session of a tenant, for tests that drive whole turns: hello, then a message until its reply
completes."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

TIMEOUT_S = 60.0


class Chat:
    def __init__(self, ws: Any, timeout_s: float = TIMEOUT_S) -> None:
        self.ws = ws
        self.timeout_s = timeout_s
        self.session_id = ""

    async def hello(self, token: str) -> str:
        await self.ws.send(json.dumps({"type": "hello", "token": token}))
        welcome = json.loads(await asyncio.wait_for(self.ws.recv(), self.timeout_s))
        assert welcome["type"] == "welcome", welcome
        self.session_id = str(welcome["session_id"])
        return self.session_id

    async def turn(self, text: str, client_msg_id: str | None = None) -> dict[str, Any]:
        """Send ``text``; the ``message.completed`` frame of its reply (which must be complete)."""
        msg_id = client_msg_id or uuid.uuid4().hex
        await self.ws.send(json.dumps({"type": "user.message", "client_msg_id": msg_id, "text": text}))
        while True:
            frame: dict[str, Any] = json.loads(await asyncio.wait_for(self.ws.recv(), self.timeout_s))
            if frame["type"] == "message.completed":
                assert frame["status"] == "complete", frame
                return frame
