"""A bot turn in flight: which message it answers, the engine request it runs, what it has published so far, and
whether it was cancelled or cut off (``backend/chat/turns.py`` keeps them; ``backend/chat/turn.py`` runs them)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

from backend.chat.protocol import Topic
from backend.context.contact_guard import ContactGuard
from backend.services.context_service import SessionContext


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(slots=True, eq=False)
class Turn:
    session_id: str
    tenant_id: str
    client_msg_id: str
    user_seq: int
    context: SessionContext | None = None  # read when the message was observed (reused while it is current)
    namespace: str = ""  # the tenant's cache namespace, read with the turn's context (backend/core/namespaces.py)
    # NOTE: the engine request running now (a turn that calls tools runs one per step): what a cancel aborts.
    request_id: str = field(default_factory=new_request_id)
    parts: list[str] = field(default_factory=list)  # what was published: exactly what is stored
    cancelled: bool = False
    interrupted: bool = False  # cut off by shutdown: stored incomplete
    task: asyncio.Task[None] | None = None
    topic: Topic | None = None  # the topic of the message it answers (known once the prompt is built)
    guard: ContactGuard | None = None  # what the reply passes through before it is published (with the prompt)

    @property
    def text(self) -> str:
        return "".join(self.parts)
