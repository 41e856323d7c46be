"""A bot turn in flight: which message it answers, the engine request it runs, what it has published so far, and
whether it was cancelled or cut off (``backend/chat/turns.py`` keeps them; ``backend/chat/turn_path.py`` runs them)."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.chat.protocol import Topic
from backend.chat.reply_setup import ReplySetup
from backend.chat.turn_marks import TurnMarks
from backend.context.contact_guard import ContactGuard
from backend.db.models import Message
from backend.services.context_service import SessionContext
from backend.services.handoff_settings import HandoffSettings

if TYPE_CHECKING:  # (turn_plan imports tool_turn, which imports this module)
    from backend.chat.turn_plan import Planned


def new_request_id() -> str:
    return uuid.uuid4().hex


@dataclass(slots=True, eq=False)
class Turn:
    session_id: str
    tenant_id: str
    client_msg_id: str
    user_seq: int
    context: SessionContext | None = None  # read with the message, under the session's lock (None: read in the turn)
    message: Message | None = None  # the customer message it answers, as stored
    setup: ReplySetup | None = None  # the tenant's reply settings and tools, read with the context
    handoff: HandoffSettings | None = None  # the tenant's hand-off settings, read with the context
    observe: bool = True  # the message is new: the turn observes it (topic, blocks); a retry's was observed before
    read_again: bool = False  # another turn of the session was in flight at the read: it may store after it
    namespace: str = ""  # the tenant's cache namespace, read with the turn's context (backend/core/namespaces.py)
    # NOTE: the engine request running now (a turn that calls tools runs one per step): what a cancel aborts.
    request_id: str = field(default_factory=new_request_id)
    parts: list[str] = field(default_factory=list)  # what was published: exactly what is stored
    cancelled: bool = False
    interrupted: bool = False  # cut off by shutdown: stored incomplete
    task: asyncio.Task[None] | None = None
    topic: Topic | None = None  # the topic of the message it answers (known once the prompt is built)
    guard: ContactGuard | None = None  # what the reply passes through before it is published (with the prompt)
    marks: TurnMarks = field(default_factory=lambda: TurnMarks(time.perf_counter()))  # its path's steps, timed
    planned: asyncio.Future[Planned] | None = None  # step 7, started by step 2 (``turn_plan.py``); None: plan here

    @property
    def text(self) -> str:
        return "".join(self.parts)
