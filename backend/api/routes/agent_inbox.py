"""The inbox, for agents (an ``agent`` key) and admins (an ``admin`` key acts as the support team): the queue of
sessions waiting for a person, claim / release / transfer / hand back / resolve, the agent's replies, the session's
transcript and private notes. Each route is one call into ``backend/chat/agent_desk.py``.

Refusals (``backend/services/inbox_errors.py``): a second agent's claim is 409 ``claimed_by_other`` naming the
holder; a reply to a session one does not hold is 409 ``not_claimed``, to a closed session 409 ``session_closed``, to
another tenant's session 404 ``session_not_found``; nothing is stored then.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field, field_validator

from backend.api.deps import ActorDep, StateDep
from backend.chat.agent_desk import entry_frame
from backend.chat.agent_protocol import InboxEntry
from backend.chat.protocol import MessageOut
from backend.chat.service import message_out
from backend.core.limits import SafeText, SessionId
from backend.db.models import AgentNote
from backend.services.inbox import HandoffChange

router = APIRouter(prefix="/inbox", tags=["agents: inbox"])

SessionPath = Annotated[SessionId, Path(description="the session's id")]
_CONFLICTS: dict[int | str, dict[str, str]] = {
    409: {"description": "claimed_by_other (names the holder), not_claimed, not_waiting or session_closed"},
    404: {"description": "session_not_found: no such session of the tenant"},
}


class TextIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    text: Annotated[SafeText, Field(min_length=1, max_length=8_000)]

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("text must not be blank")
        return value


class TransferIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    agent_id: Annotated[SafeText, Field(min_length=1, max_length=36, description="the agent's id or name")]


class HandoffOut(BaseModel):
    session_id: str
    status: str
    reason: str
    holder_name: str | None

    @classmethod
    def of(cls, c: HandoffChange) -> HandoffOut:
        return cls(session_id=c.session_id, status=c.status.value, reason=c.reason.value, holder_name=c.holder_name)


class NoteOut(BaseModel):
    id: int
    author: str
    text: str
    created_at: datetime

    @classmethod
    def of(cls, n: AgentNote) -> NoteOut:
        return cls(id=n.id, author=n.author, text=n.text, created_at=n.created_at)


class MeOut(BaseModel):
    name: str
    agent_id: str | None = Field(description="None: an admin key, acting as the support team")


@router.get("/me", response_model=MeOut)
async def me(actor: ActorDep) -> MeOut:
    return MeOut(name=actor.name, agent_id=actor.agent_id)


@router.get("", response_model=list[InboxEntry])
async def get_queue(actor: ActorDep, state: StateDep) -> list[InboxEntry]:
    """The tenant's sessions in the inbox, oldest request first: waiting (``agent_requested``) and held
    (``agent_active``), each with the wait so far, the customer's last message and the session's topic."""
    return [entry_frame(e) for e in await state.chat.desk.queue(actor)]


@router.post("/{session_id}/claim", response_model=HandoffOut, responses=_CONFLICTS)
async def claim(session_id: SessionPath, actor: ActorDep, state: StateDep) -> HandoffOut:
    """Take the session (one person at a time); the customer is told who joined."""
    return HandoffOut.of(await state.chat.desk.claim(actor, session_id))


@router.post("/{session_id}/release", response_model=HandoffOut, responses=_CONFLICTS)
async def release(session_id: SessionPath, actor: ActorDep, state: StateDep) -> HandoffOut:
    """Put the session back in the queue, at its first place."""
    return HandoffOut.of(await state.chat.desk.release(actor, session_id))


@router.post("/{session_id}/transfer", response_model=HandoffOut, responses=_CONFLICTS)
async def transfer(session_id: SessionPath, body: TransferIn, actor: ActorDep, state: StateDep) -> HandoffOut:
    """Give the session to another agent of the tenant."""
    return HandoffOut.of(await state.chat.desk.transfer(actor, session_id, body.agent_id))


@router.post("/{session_id}/hand-back", response_model=HandoffOut, responses=_CONFLICTS)
async def hand_back(session_id: SessionPath, actor: ActorDep, state: StateDep) -> HandoffOut:
    """The bot answers the customer's next message, with this conversation as its history."""
    return HandoffOut.of(await state.chat.desk.hand_back(actor, session_id))


@router.post("/{session_id}/resolve", response_model=HandoffOut, responses=_CONFLICTS)
async def resolve(session_id: SessionPath, actor: ActorDep, state: StateDep) -> HandoffOut:
    return HandoffOut.of(await state.chat.desk.resolve(actor, session_id))


@router.post("/{session_id}/messages", response_model=MessageOut, status_code=201, responses=_CONFLICTS)
async def reply(session_id: SessionPath, body: TextIn, actor: ActorDep, state: StateDep) -> MessageOut:
    """Answer the customer (role ``agent``): streamed to their sockets on every worker as ``agent.message``."""
    message = await state.chat.desk.reply(actor, session_id, body.text)
    return message_out(message, {actor.agent_id: actor.name} if actor.agent_id else {})


@router.get("/{session_id}/messages", response_model=list[MessageOut], responses=_CONFLICTS)
async def transcript(session_id: SessionPath, actor: ActorDep, state: StateDep) -> list[MessageOut]:
    messages, names = await state.chat.desk.transcript(actor, session_id)
    return [message_out(m, names) for m in messages]


@router.post("/{session_id}/notes", response_model=NoteOut, status_code=201, responses=_CONFLICTS)
async def add_note(session_id: SessionPath, body: TextIn, actor: ActorDep, state: StateDep) -> NoteOut:
    """A private note: agents and admins read it; never the customer, never the bot's prompt."""
    return NoteOut.of(await state.chat.desk.add_note(actor, session_id, body.text))


@router.get("/{session_id}/notes", response_model=list[NoteOut], responses=_CONFLICTS)
async def notes(session_id: SessionPath, actor: ActorDep, state: StateDep) -> list[NoteOut]:
    return [NoteOut.of(n) for n in await state.chat.desk.notes(actor, session_id)]
