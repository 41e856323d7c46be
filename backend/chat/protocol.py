"""The chat websocket protocol: typed JSON envelopes, each with a ``type`` field.

Client → server: ``hello`` (first frame: auth + optional resume), ``user.message``, ``cancel``, ``ping``, ``typing``.
Server → client: ``welcome``, ``message.ack``, ``message.delta``, ``message.completed``, ``session.status``,
``session.topic``, ``error``, ``pong``; and human agents' frames (``backend/chat/agent_protocol.py``):
``agent.message``, ``session.agent``, ``typing``, ``session.queue``.

Close codes (named here, used by the connection handler): 1008 policy (Origin not allowed), 1009 message too big,
1011 internal error, 1012 server restarting, 1013 try again later (connection cap), 4401 unauthorized,
4404 session not found.
"""

from __future__ import annotations

import json
from datetime import datetime
from enum import IntEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from backend.chat.agent_protocol import (
    AgentMessageFrame,
    InboxChangedFrame,
    InboxHandoffFrame,
    InboxMessageFrame,
    SessionAgentFrame,
    SessionQueueFrame,
    TypingFrame,
)
from backend.core.errors import error_location, error_problem
from backend.core.limits import ExternalRef, Identifier, SafeText, Seq, SessionId, json_too_deep, text_problem


class CloseCode(IntEnum):
    NORMAL = 1000
    POLICY = 1008
    TOO_BIG = 1009
    INTERNAL = 1011
    RESTART = 1012
    TRY_AGAIN_LATER = 1013
    UNAUTHORIZED = 4401
    SESSION_NOT_FOUND = 4404


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


# ---------------------------------------------------------------- client → server


class _ClientFrame(_Frame):
    # NOTE: strict: "5" is not a seq and "yes" is not a flag; a client that sends them has a bug worth hearing about.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class Hello(_ClientFrame):
    type: Literal["hello"]
    token: Annotated[SafeText, Field(min_length=1, max_length=512)]
    session_id: SessionId | None = None
    last_seq: Seq = 0
    external_ref: ExternalRef | None = None


class UserMessage(_ClientFrame):
    type: Literal["user.message"]
    client_msg_id: Identifier
    text: Annotated[SafeText, Field(min_length=1)]

    @field_validator("text")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("text must not be blank")
        return value


class Cancel(_ClientFrame):
    type: Literal["cancel"]
    client_msg_id: Identifier | None = None


class Ping(_ClientFrame):
    type: Literal["ping"]
    nonce: Annotated[SafeText, Field(max_length=100)] | None = None


class Typing(_ClientFrame):
    """The customer is typing (shown to the agent holding the session; send it at most every few seconds)."""

    type: Literal["typing"]


AnyClientFrame = Hello | UserMessage | Cancel | Ping | Typing
ClientFrame = Annotated[AnyClientFrame, Field(discriminator="type")]
CLIENT_FRAME: TypeAdapter[AnyClientFrame] = TypeAdapter(ClientFrame)
CLIENT_FRAME_TYPES = frozenset({"hello", "user.message", "cancel", "ping", "typing"})


# ---------------------------------------------------------------- server → client


class MessageOut(_Frame):
    seq: int
    role: str
    content: str
    status: str
    client_msg_id: str | None = None
    reply_to_seq: int | None = None
    created_at: datetime
    agent_name: str | None = None  # role ``agent``: the person who wrote it


class InFlight(_Frame):
    client_msg_id: str
    text: str  # what the assistant said so far


class Topic(_Frame):
    """The session's topic: its epoch and semantic temperature (None until the first customer message), and the
    titles of the tenant's handbook sections its prompt holds (in ``message.completed``; at most two)."""

    epoch: int
    temperature: float | None = None
    section: list[str] = Field(default_factory=list)


class Welcome(_Frame):
    type: Literal["welcome"] = "welcome"
    session_id: str
    status: str
    messages: list[MessageOut]
    last_seq: int
    in_flight: InFlight | None = None
    # seqs of the user messages in ``messages`` whose reply was cut off (a crash, a shutdown, an engine failure)
    # and stored ``incomplete``: the client can offer to ask again
    cut_off: list[int] = Field(default_factory=list)
    topic: Topic | None = None


class MessageAck(_Frame):
    type: Literal["message.ack"] = "message.ack"
    client_msg_id: str
    seq: int
    duplicate: bool = False


class MessageDelta(_Frame):
    type: Literal["message.delta"] = "message.delta"
    client_msg_id: str  # the user message this reply answers
    text: str


class Usage(_Frame):
    prompt_tokens: int
    cached_tokens: int
    prefilled_tokens: int
    completion_tokens: int
    ttft_ms: float
    steps_ms: dict[str, float] | None = None  # the turn's path timed, from the frame taken (chat/turn_marks.py)


class MessageCompleted(_Frame):
    type: Literal["message.completed"] = "message.completed"
    client_msg_id: str
    seq: int
    text: str
    status: str  # complete | cancelled | incomplete
    finish_reason: str
    usage: Usage | None = None
    topic: Topic | None = None  # the topic of the message this reply answers


class SessionStatusFrame(_Frame):
    type: Literal["session.status"] = "session.status"
    session_id: str
    status: str


class SessionTopicFrame(_Frame):
    """A customer message (``seq``) started a new topic epoch."""

    type: Literal["session.topic"] = "session.topic"
    session_id: str
    seq: int
    topic: Topic


class ErrorFrame(_Frame):
    type: Literal["error"] = "error"
    code: str
    message: str
    retry_after_ms: int | None = None
    client_msg_id: str | None = None


class Pong(_Frame):
    type: Literal["pong"] = "pong"
    nonce: str | None = None


ServerFrame = (
    Welcome
    | MessageAck
    | MessageDelta
    | MessageCompleted
    | SessionStatusFrame
    | SessionTopicFrame
    | ErrorFrame
    | Pong
    # (human agents': backend/chat/agent_protocol.py)
    | AgentMessageFrame
    | SessionAgentFrame
    | TypingFrame
    | SessionQueueFrame
    | InboxHandoffFrame
    | InboxChangedFrame
    | InboxMessageFrame
)


def parse_client_frame(text: str) -> AnyClientFrame | ErrorFrame:
    """One client frame, or the ``ErrorFrame`` that refuses it (codes ``bad_json``, ``unknown_type``,
    ``invalid_frame``). Never raises: whatever a client sends, the socket answers and stays open."""
    if json_too_deep(text):
        return ErrorFrame(code="bad_json", message="frame is nested too deeply")
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        return ErrorFrame(code="bad_json", message=f"frame is not valid JSON: {getattr(exc, 'msg', 'unreadable')}")
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        return ErrorFrame(code="invalid_frame", message="a frame must be a JSON object with a string 'type'")
    kind: str = raw["type"]
    if kind not in CLIENT_FRAME_TYPES:
        shown = kind[:40] if text_problem(kind) is None else "(unprintable)"
        return ErrorFrame(code="unknown_type", message=f"unknown frame type {shown!r}")
    try:
        return CLIENT_FRAME.validate_python(raw)
    except ValidationError as exc:
        return ErrorFrame(code="invalid_frame", message=describe_validation_error(exc, kind))


def describe_validation_error(exc: ValidationError, kind: str) -> str:
    """``"<frame type>: <field>: <problem>"`` for the first problem (never echoes the offending value)."""
    detail = exc.errors(include_input=False, include_url=False)[0]
    loc = error_location(detail["loc"][1:])
    return f"{kind}: {loc}: {error_problem(detail)}" if loc else f"{kind}: {error_problem(detail)}"
