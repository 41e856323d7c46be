"""The words the layers share: the statuses, roles, policies and reasons the database stores as strings and the chat,
the context layer and the admin API speak in. Plain enums, so the context layer needs no database import.
"""

from __future__ import annotations

from enum import StrEnum


class KeyKind(StrEnum):
    CHAT = "chat"  # customers' chat clients and the OpenAI-compatible API
    ADMIN = "admin"  # the admin REST API and dashboard
    AGENT = "agent"  # a human agent of the tenant: the inbox and its sessions (backend/services/inbox.py)


class SessionStatus(StrEnum):
    BOT_ACTIVE = "bot_active"
    AGENT_REQUESTED = "agent_requested"  # waiting in the inbox for a person
    AGENT_ACTIVE = "agent_active"  # a person holds it: the bot sends nothing
    RESOLVED = "resolved"
    CLOSED = "closed"


class MessageRole(StrEnum):
    USER = "user"
    ASSISTANT = "assistant"
    SYSTEM = "system"
    AGENT = "agent"  # a human agent's reply (``messages.agent_id``); the bot's prompt reads it as an assistant turn


class MessageStatus(StrEnum):
    COMPLETE = "complete"
    INCOMPLETE = "incomplete"
    CANCELLED = "cancelled"
    # NOTE: on a user message only: the bot owes it a reply (set when the turn is decided, cleared in the reply's
    # transaction), so a restart finds the turns a crash cut off.
    AWAITING_REPLY = "awaiting_reply"


class HistoryPolicy(StrEnum):
    """Which history the context builder sends (issue 21): everything, the current epoch in full, or a budget."""

    FULL = "full"
    EPOCH = "epoch"  # earlier epochs reduced to their identifier and clause blocks
    BUDGET = "budget"  # the oldest turns go first


class InvalidationReason(StrEnum):
    """Why cached context was freed; one row of ``invalidation_events`` each time."""

    PINNED_CONTEXT_EDITED = "pinned_context_edited"
    MESSAGE_DELETED = "message_deleted"
    MESSAGE_REDACTED = "message_redacted"
    EPOCH_DROPPED = "epoch_dropped"
    SESSION_CLOSED = "session_closed"
    SESSION_TIMED_OUT = "session_timed_out"
    ADMIN_FLUSH = "admin_flush"  # an admin flushed a session's cache, or the whole tenant's
    TENANT_PROMPT_EDITED = "tenant_prompt_edited"  # the system prompt or policy text (every prompt's part 1) changed
    SESSION_ERASED = "session_erased"  # an admin deleted the session: its blocks left every tier
    HANDBOOK_EDITED = "handbook_edited"  # a handbook section changed or went: the blocks that held its old text


class ReplicaErase(StrEnum):
    """A tenant's choice for erasing a session on an engine replica that has no per-session erase (a vLLM replica;
    docs/scale-out.md)."""

    REPORT = "report"  # erase nothing there: the erasure names the replica as not erased (HTTP 207)
    RESET_CACHE = "reset_cache"  # reset that replica's whole prefix cache: every session on it loses its prefixes


class DraftsSetting(StrEnum):
    """A tenant's suffix drafts (engine/spec): verified exactly, so a choice of speed, never of output."""

    ON = "on"  # draft even where the engine's switch (KVCHAT_ENGINE_DRAFTS) is off
    OFF = "off"  # plain one-token steps, even where the switch is on
    DEFAULT = "default"  # follow the engine's switch

    def wanted(self) -> bool | None:
        """The engine's ``SamplingParams.drafts`` for this setting (None: the engine's switch decides)."""
        return {DraftsSetting.ON: True, DraftsSetting.OFF: False}.get(self)


class HandoffReason(StrEnum):
    """Why a session went to the inbox; one ``handoffs`` row each time."""

    CUSTOMER_ASKED = "customer_asked"  # the customer asked for a person (backend/chat/prompt.py's detector)
    NO_PROGRESS = "no_progress"  # the tenant's setting: N bot turns without progress
    TOOL_FAILED = "tool_failed"  # the tenant's setting: a tool call of the bot failed
    ADMIN = "admin"  # an admin set the session's status to ask for a person


class HandoffOutcome(StrEnum):
    """How a hand-off ended."""

    HANDED_BACK = "handed_back"  # the bot answers again
    RESOLVED = "resolved"
    CLOSED = "closed"  # the session closed (idle, an admin) while it waited or was held
