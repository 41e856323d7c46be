"""ORM models. The schema itself only ever changes through Alembic (migrations/versions). The values their string
columns hold (statuses, roles, reasons) are the enums of ``backend/domain.py``."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from backend.domain import HistoryPolicy, MessageStatus, SessionStatus

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return str(uuid.uuid4())


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class Tenant(Base):
    __tablename__ = "tenants"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    name: Mapped[str] = mapped_column(String(200), unique=True)
    system_prompt: Mapped[str] = mapped_column(Text, default="")
    # Rendered right after the system prompt: together they are part 1 of every prompt (backend/context/builder.py).
    policy_text: Mapped[str] = mapped_column(Text, default="", server_default="")
    # "private" (the tenant's own cache namespace) or "public" (the shared one): backend/core/namespaces.py.
    cache_scope: Mapped[str] = mapped_column(String(16), default="private", server_default="private")
    # Keep the system + policy prefix pinned in the engine's memory tier (backend/services/cache_admin.py).
    pin_prefix: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # Bumped by every handbook edit (backend/services/handbook.py): the version the section cache and audit name.
    handbook_version: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # "report" or "reset_cache": erasing a session on a replica without a per-session erase (backend/domain.py).
    replica_erase: Mapped[str] = mapped_column(String(16), default="report", server_default="report")
    # /v1 replies pass the contact guard (backend/context/contact_guard.py); chat replies always do.
    v1_contact_guard: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # "on", "off" or "default" (the engine's switch): suffix drafts for the tenant's replies (backend/domain.py).
    drafts: Mapped[str] = mapped_column(String(8), default="default", server_default="default")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class HandbookSection(Base):
    """One section of a tenant's handbook (``backend/context/handbook.py``), in the handbook's order."""

    __tablename__ = "handbook_sections"
    __table_args__ = (UniqueConstraint("tenant_id", "title", name="uq_handbook_sections_tenant_title"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    position: Mapped[int] = mapped_column(Integer)
    title: Mapped[str] = mapped_column(String(200))
    text: Mapped[str] = mapped_column(Text)
    content_hash: Mapped[str] = mapped_column(String(64))  # of title and text: what the prompt holds
    examples: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")  # customer questions, JSON list
    version: Mapped[int] = mapped_column(Integer)  # the handbook version that last changed it


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    # NOTE: only a sha256 of the key is stored; the key itself is shown once, when it is created.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(12))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    # an ``agent`` key's person (``agents``); None for chat and admin keys
    agent_id: Mapped[str | None] = mapped_column(ForeignKey("agents.id", ondelete="CASCADE"), nullable=True, index=True)


class ChatSession(Base):
    __tablename__ = "chat_sessions"
    __table_args__ = (Index("ix_chat_sessions_tenant_status", "tenant_id", "status"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    external_ref: Mapped[str | None] = mapped_column(String(200), nullable=True)
    status: Mapped[str] = mapped_column(String(32), default=SessionStatus.BOT_ACTIVE.value)
    context_version: Mapped[int] = mapped_column(Integer, default=0)
    # The topic tracker's state (backend/context/topic.py): None until the first customer message.
    semantic_temperature: Mapped[float | None] = mapped_column(Float, nullable=True)
    topic_epoch: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    # Customer facts an admin pinned to the session (the context builder's part 2); editing bumps context_version.
    pinned_context: Mapped[str] = mapped_column(Text, default="", server_default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_active_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    closed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)


class Message(Base):
    __tablename__ = "messages"
    __table_args__ = (
        UniqueConstraint("session_id", "seq", name="uq_messages_session_seq"),
        UniqueConstraint("session_id", "client_msg_id", name="uq_messages_session_client_msg_id"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("chat_sessions.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(16))
    content: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), default=MessageStatus.COMPLETE.value)
    client_msg_id: Mapped[str | None] = mapped_column(String(100), nullable=True)
    reply_to_seq: Mapped[int | None] = mapped_column(Integer, nullable=True)
    prompt_tokens: Mapped[int] = mapped_column(Integer, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, default=0)
    cached_tokens: Mapped[int] = mapped_column(Integer, default=0)
    # a reply that called tools: the calls and results it was generated after (backend/services/tool_exchange.py)
    tool_exchange: Mapped[str | None] = mapped_column(Text, nullable=True)
    # role ``agent``: the person who wrote it (None: an admin key, or an agent deleted since)
    agent_id: Mapped[str | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"), nullable=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantContextSettings(Base):
    """A tenant's context-layer settings; no row means the defaults (``backend/context`` dataclasses)."""

    __tablename__ = "tenant_context_settings"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    history_policy: Mapped[str] = mapped_column(String(16), default=HistoryPolicy.EPOCH.value)
    similarity_backend: Mapped[str] = mapped_column(String(16))
    shift_threshold: Mapped[float] = mapped_column(Float)
    start_temperature: Mapped[float] = mapped_column(Float)
    shift_temperature: Mapped[float] = mapped_column(Float)
    min_block_length: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class SplitterRule(Base):
    """A splitter rule (``backend/context/rules.py``); ``tenant_id`` None = a global rule every tenant gets."""

    __tablename__ = "splitter_rules"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_splitter_rules_tenant_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str | None] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True, index=True
    )
    name: Mapped[str] = mapped_column(String(100))
    pattern: Mapped[str] = mapped_column(Text)
    block_type: Mapped[str] = mapped_column(String(32))
    priority: Mapped[int] = mapped_column(Integer)
    language: Mapped[str] = mapped_column(String(8), default="any")
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    # NOTE: bumped on every ORM update: with the row count it is the version the compiled-rule cache checks.
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class SemanticBlock(Base):
    """One typed block of a stored message; ``parent_id`` is the block it refers back to (same session)."""

    __tablename__ = "semantic_blocks"
    __table_args__ = (
        UniqueConstraint("message_id", "block_index", name="uq_semantic_blocks_message_index"),
        Index("ix_semantic_blocks_session_epoch", "session_id", "topic_epoch"),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    # NOTE: session_id repeats the message's session so the builder reads a session's blocks without a join.
    session_id: Mapped[str] = mapped_column(ForeignKey("chat_sessions.id", ondelete="CASCADE"))
    message_id: Mapped[int] = mapped_column(ForeignKey("messages.id", ondelete="CASCADE"))
    block_index: Mapped[int] = mapped_column(Integer)
    block_type: Mapped[str] = mapped_column(String(32))
    char_start: Mapped[int] = mapped_column(Integer)
    char_end: Mapped[int] = mapped_column(Integer)
    token_count: Mapped[int] = mapped_column(Integer)
    content_hash: Mapped[str] = mapped_column(String(64))
    topic_epoch: Mapped[int] = mapped_column(Integer)
    parent_id: Mapped[int | None] = mapped_column(ForeignKey("semantic_blocks.id", ondelete="SET NULL"), nullable=True)


class TopicHistory(Base):
    """The semantic temperature after each customer message of a session."""

    __tablename__ = "topic_history"
    __table_args__ = (UniqueConstraint("session_id", "message_seq", name="uq_topic_history_session_seq"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("chat_sessions.id", ondelete="CASCADE"))
    message_seq: Mapped[int] = mapped_column(Integer)
    similarity: Mapped[float | None] = mapped_column(Float, nullable=True)  # None: the session's first message
    temperature: Mapped[float] = mapped_column(Float)
    shift: Mapped[bool] = mapped_column(Boolean)
    topic_epoch: Mapped[int] = mapped_column(Integer)
    # The handbook sections the topic's prompt holds after this message: their titles, a JSON list (at most two).
    sections: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class InvalidationEvent(Base):
    """Cached context the engine freed, and why. Kept when the session is deleted (``session_id`` goes NULL)."""

    __tablename__ = "invalidation_events"
    __table_args__ = (Index("ix_invalidation_events_tenant_created", "tenant_id", "created_at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_id: Mapped[str | None] = mapped_column(
        ForeignKey("chat_sessions.id", ondelete="SET NULL"), nullable=True, index=True
    )
    reason: Mapped[str] = mapped_column(String(32))
    actor: Mapped[str] = mapped_column(String(200))  # "system", or the admin key's prefix
    blocks_freed: Mapped[int] = mapped_column(Integer, default=0)
    tokens_freed: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AdminAudit(Base):
    """One admin write action: who (the admin key's prefix), what, on which target, when, and how it ended.

    ``tenant_id`` is None for an operator action (engine-global settings), which belongs to no tenant.
    """

    __tablename__ = "admin_audit"
    __table_args__ = (Index("ix_admin_audit_tenant_at", "tenant_id", "at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    tenant_id: Mapped[str | None] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), nullable=True)
    actor: Mapped[str] = mapped_column(String(200))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str | None] = mapped_column(String(200), nullable=True)
    result: Mapped[str] = mapped_column(String(64))  # "ok", or the error's stable code
    detail: Mapped[str | None] = mapped_column(String(500), nullable=True)  # what it did, when a route says
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantReplySettings(Base):
    """A tenant's reply settings (``backend/services/reply_settings.py``); no row means the server's defaults."""

    __tablename__ = "tenant_reply_settings"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    temperature: Mapped[float] = mapped_column(Float)
    top_p: Mapped[float] = mapped_column(Float)
    top_k: Mapped[int] = mapped_column(Integer)
    min_p: Mapped[float] = mapped_column(Float)
    repetition_penalty: Mapped[float] = mapped_column(Float)
    repetition_penalty_scope: Mapped[str] = mapped_column(String(8), default="all")  # all | reply
    presence_penalty: Mapped[float] = mapped_column(Float)
    frequency_penalty: Mapped[float] = mapped_column(Float)
    stop: Mapped[str] = mapped_column(Text, default="[]")  # a JSON list of stop strings
    tool_choice: Mapped[str] = mapped_column(String(16), default="auto")  # auto | required | none
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class TenantTool(Base):
    """An HTTP endpoint the bot may call during a turn (``backend/services/tenant_tools.py``).

    ``secret_value`` is sent in the ``secret_header`` of every call; the admin API never shows it again.
    """

    __tablename__ = "tenant_tools"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_tenant_tools_tenant_name"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(64))
    description: Mapped[str] = mapped_column(Text, default="")
    parameters: Mapped[str] = mapped_column(Text)  # the JSON schema of the arguments, as JSON text
    url: Mapped[str] = mapped_column(String(2000))
    secret_header: Mapped[str | None] = mapped_column(String(100), nullable=True)
    secret_value: Mapped[str | None] = mapped_column(String(1000), nullable=True)
    timeout_s: Mapped[float] = mapped_column(Float, default=5.0)
    enabled: Mapped[bool] = mapped_column(Boolean, default=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class TenantFairShare(Base):
    """A tenant's weight and quotas (``backend/core/tenant_quota.py``); no row means weight 1 and no limits."""

    __tablename__ = "tenant_fair_share"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    weight: Mapped[float] = mapped_column(Float, default=1.0)
    tokens_per_minute: Mapped[int | None] = mapped_column(Integer, nullable=True)
    max_concurrent: Mapped[int | None] = mapped_column(Integer, nullable=True)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)


class Agent(Base):
    """A person of a tenant who answers hand-offs; their ``agent`` keys are ``api_keys`` rows with ``agent_id``."""

    __tablename__ = "agents"
    __table_args__ = (UniqueConstraint("tenant_id", "name", name="uq_agents_tenant_name"),)

    id: Mapped[str] = mapped_column(String(36), primary_key=True, default=new_id)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str] = mapped_column(String(100))  # shown to the customer ("Dana joined the chat")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class Handoff(Base):
    """One hand-off of a session to the inbox, from the request to its end (``backend/services/inbox.py``).

    A session has at most one open hand-off (``ended_at`` None); ``holder`` is who holds it now: an agent's id, or
    ``admin:<key id>`` for an admin key acting as an agent.
    """

    __tablename__ = "handoffs"
    __table_args__ = (Index("ix_handoffs_tenant_ended", "tenant_id", "ended_at"),)

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    session_id: Mapped[str] = mapped_column(ForeignKey("chat_sessions.id", ondelete="CASCADE"), index=True)
    reason: Mapped[str] = mapped_column(String(32))  # HandoffReason
    requested_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    holder: Mapped[str | None] = mapped_column(String(80), nullable=True)
    holder_name: Mapped[str | None] = mapped_column(String(100), nullable=True)
    # NOTE: the first claim's time stays when the session is released or transferred: it is the wait the customer
    # had, which the expected wait of the next customers is computed from.
    first_claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    first_reply_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)
    outcome: Mapped[str | None] = mapped_column(String(16), nullable=True)  # HandoffOutcome


class AgentNote(Base):
    """A private note on a session: agents and admins read it; the customer and the prompt never do."""

    __tablename__ = "agent_notes"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("chat_sessions.id", ondelete="CASCADE"), index=True)
    author: Mapped[str] = mapped_column(String(100))
    agent_id: Mapped[str | None] = mapped_column(ForeignKey("agents.id", ondelete="SET NULL"), nullable=True)
    text: Mapped[str] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class TenantHandoffSettings(Base):
    """When the bot hands a session to a person on its own (``backend/services/handoff_settings.py``); no row: never
    (only the customer's request does)."""

    __tablename__ = "tenant_handoff_settings"

    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True)
    no_progress_turns: Mapped[int] = mapped_column(Integer, default=0)  # 0: off
    on_tool_failure: Mapped[bool] = mapped_column(Boolean, default=False)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow, onupdate=utcnow)
