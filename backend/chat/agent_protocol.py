"""The frames of human agents, on both sockets (typed JSON envelopes, each with a ``type``, like
``backend/chat/protocol.py``, whose ``ServerFrame`` includes the server's so the fan-out carries them to every worker).

To the customer (``/ws/chat``): ``agent.message`` (a person's reply), ``session.agent`` (who the customer talks to
now: a person joined, left, or the bot is back), ``typing`` (the agent is typing), ``session.queue`` (the place in
the queue and the expected wait while waiting for a person).

To agents (``/ws/agent``, one socket per agent, the tenant's inbox): ``agent.welcome`` (who, and the inbox now),
``inbox.handoff`` (a session asks for a person), ``inbox.changed`` (claimed, released, transferred, handed back,
resolved, closed), ``inbox.message`` (a customer wrote in a session of the inbox), ``agent.message`` and ``typing``
(the customer is typing). Client → server on ``/ws/agent``: ``hello`` (the agent's key), ``typing``, ``ping``.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from backend.core.limits import SafeText, SessionId


class _Frame(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def inbox_channel(tenant_id: str) -> str:
    """The hub key the tenant's agent sockets subscribe to (a session's key is its uuid: the two never meet)."""
    return f"inbox:{tenant_id}"


# ---------------------------------------------------------------- server → client


class AgentMessageFrame(_Frame):
    """A person's reply in a session (stored with role ``agent`` and ``seq``)."""

    type: Literal["agent.message"] = "agent.message"
    session_id: str
    seq: int
    agent_name: str
    text: str
    created_at: datetime


class SessionAgentFrame(_Frame):
    """Who the customer talks to now: ``agent_name`` joined (joined, transferred) or left (left: back in the queue;
    handed_back: the bot answers again; resolved)."""

    type: Literal["session.agent"] = "session.agent"
    session_id: str
    event: Literal["joined", "left", "transferred", "handed_back", "resolved"]
    agent_name: str | None = None


class TypingFrame(_Frame):
    type: Literal["typing"] = "typing"
    session_id: str
    who: Literal["agent", "customer"]
    name: str | None = None


class SessionQueueFrame(_Frame):
    """The customer's place among the tenant's sessions waiting for a person (1 = next)."""

    type: Literal["session.queue"] = "session.queue"
    session_id: str
    position: int
    expected_wait_s: float | None = None  # None: no recent claim to estimate from


class InboxEntry(_Frame):
    session_id: str
    status: str
    reason: str
    requested_at: datetime
    waited_s: float
    holder_name: str | None = None
    last_customer_message: str | None = None
    topic_epoch: int
    temperature: float | None = None


class InboxHandoffFrame(_Frame):
    type: Literal["inbox.handoff"] = "inbox.handoff"
    entry: InboxEntry


class InboxChangedFrame(_Frame):
    type: Literal["inbox.changed"] = "inbox.changed"
    session_id: str
    event: Literal["claimed", "released", "transferred", "handed_back", "resolved", "closed"]
    status: str
    holder_name: str | None = None


class InboxMessageFrame(_Frame):
    """A customer message in a session of the inbox."""

    type: Literal["inbox.message"] = "inbox.message"
    session_id: str
    seq: int
    text: str
    created_at: datetime


class AgentWelcome(_Frame):
    type: Literal["agent.welcome"] = "agent.welcome"
    agent_name: str
    queue: list[InboxEntry]


# ---------------------------------------------------------------- client → server (/ws/agent)


class _ClientFrame(_Frame):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class AgentHello(_ClientFrame):
    type: Literal["hello"]
    token: Annotated[SafeText, Field(min_length=1, max_length=512)]


class AgentTyping(_ClientFrame):
    type: Literal["typing"]
    session_id: SessionId


class AgentPing(_ClientFrame):
    type: Literal["ping"]
    nonce: Annotated[SafeText, Field(max_length=100)] | None = None


AGENT_CLIENT_FRAME: TypeAdapter[AgentHello | AgentTyping | AgentPing] = TypeAdapter(
    Annotated[AgentHello | AgentTyping | AgentPing, Field(discriminator="type")]
)
