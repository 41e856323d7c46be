"""The chat websocket protocol: typed JSON envelopes, each with a ``type`` field.

Client → server: ``hello`` (first frame: auth + optional resume), ``user.message``, ``cancel``, ``ping``.
Server → client: ``welcome``, ``message.ack``, ``message.delta``, ``message.completed``, ``session.status``,
``error``, ``pong``.

Close codes (named here, used by the connection handler): 1008 policy (Origin not allowed), 1009 message too big,
1011 internal error, 1012 server restarting, 1013 try again later (connection cap), 4401 unauthorized,
4404 session not found.
"""

from __future__ import annotations

from datetime import datetime
from enum import IntEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, field_validator


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


class Hello(_Frame):
    type: Literal["hello"]
    token: str = Field(min_length=1, max_length=512)
    session_id: str | None = Field(default=None, max_length=64)
    last_seq: int = Field(default=0, ge=0, le=2**31 - 1)  # seq is a 32-bit column
    external_ref: str | None = Field(default=None, max_length=200)


class UserMessage(_Frame):
    type: Literal["user.message"]
    client_msg_id: str = Field(min_length=1, max_length=100)
    text: str = Field(min_length=1)

    @field_validator("text")
    @classmethod
    def _printable(cls, value: str) -> str:
        if "\x00" in value:
            raise ValueError("text must not contain NUL characters")
        if not value.strip():
            raise ValueError("text must not be blank")
        return value


class Cancel(_Frame):
    type: Literal["cancel"]
    client_msg_id: str | None = Field(default=None, max_length=100)


class Ping(_Frame):
    type: Literal["ping"]
    nonce: str | None = Field(default=None, max_length=100)


ClientFrame = Annotated[Hello | UserMessage | Cancel | Ping, Field(discriminator="type")]
CLIENT_FRAME: TypeAdapter[Hello | UserMessage | Cancel | Ping] = TypeAdapter(ClientFrame)


# ---------------------------------------------------------------- server → client


class MessageOut(_Frame):
    seq: int
    role: str
    content: str
    status: str
    client_msg_id: str | None = None
    reply_to_seq: int | None = None
    created_at: datetime


class InFlight(_Frame):
    client_msg_id: str
    text: str  # what the assistant said so far


class Welcome(_Frame):
    type: Literal["welcome"] = "welcome"
    session_id: str
    status: str
    messages: list[MessageOut]
    last_seq: int
    in_flight: InFlight | None = None


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


class MessageCompleted(_Frame):
    type: Literal["message.completed"] = "message.completed"
    client_msg_id: str
    seq: int
    text: str
    status: str  # complete | cancelled | incomplete
    finish_reason: str
    usage: Usage | None = None


class SessionStatusFrame(_Frame):
    type: Literal["session.status"] = "session.status"
    session_id: str
    status: str


class ErrorFrame(_Frame):
    type: Literal["error"] = "error"
    code: str
    message: str
    retry_after_ms: int | None = None
    client_msg_id: str | None = None


class Pong(_Frame):
    type: Literal["pong"] = "pong"
    nonce: str | None = None


ServerFrame = Welcome | MessageAck | MessageDelta | MessageCompleted | SessionStatusFrame | ErrorFrame | Pong
