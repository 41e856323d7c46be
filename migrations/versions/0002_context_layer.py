"""context layer: splitter rules (seeded), semantic blocks, topic history, invalidation events, context settings

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 15:45:32.575051

Also adds ``chat_sessions.semantic_temperature`` / ``topic_epoch``.

NOTE: the seed rules below are a frozen copy of ``backend.context.rules.DEFAULT_RULES`` as of this revision, not an
import: a migration is history, and must insert the same rows on a fresh database in a year as it did in production
today, whatever ``rules.py`` says by then (and must not break if that module is renamed). When the defaults change,
a new migration updates the table; ``tests/migrations/test_migrations.py`` fails while the two copies differ, so the
drift cannot go unnoticed.
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, pattern, block_type, priority, language): global rules (tenant_id NULL), all enabled.
SEED_RULES: tuple[tuple[str, str, str, int, str], ...] = (
    (
        "code_fence",
        r"^\s*```",
        "code",
        100,
        "any",
    ),
    (
        "json_object",
        r'^\s*[\[{][\s\S]*"[^"\n]+"\s*:[\s\S]*[\]}]\s*$',
        "code",
        100,
        "any",
    ),
    (
        "order_number",
        r"(?<![\w-])#?\d{3}-\d{5,7}-\d{4,7}(?![\w-])|#\d{6,}(?!\d)|(?i:\border\s*("
        r"?:id|no\.?|number)?\s*[:#]?\s*)[A-Z0-9-]*\d[A-Z0-9-]{4,}",
        "identifier",
        90,
        "en",
    ),
    (
        "account_or_ticket",
        r"(?i)\b(?:account|acct|ticket|case|tracking|awb|invoice|refund|membership"
        r"|reference|ref)\s*(?:id|no\.?|number|#)?\s*[:#]?\s*(?=[A-Z0-9-]*\d)[A-Z0"
        r"-9][A-Z0-9-]{4,}\b",
        "identifier",
        90,
        "en",
    ),
    (
        "prefixed_code",
        r"\b[A-Z]{2,4}-?\d{8,}\b",
        "identifier",
        90,
        "any",
    ),
    (
        "order_number_zh",
        r"(?:订单号?|工单号?|单号|运单号?|账号|账户|会员号)(?:码|编号)?\s*(?:是|为)?\s*[:：#]?\s*[A-Za-z0-"
        r"9-]*\d[A-Za-z0-9-]{4,}",
        "identifier",
        90,
        "zh",
    ),
    (
        "email",
        r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\[email\s+protected\]",
        "identifier",
        90,
        "any",
    ),
    (
        "phone",
        r"(?<![\w-])\+?\d(?:[\s().-]?\d){9,14}(?![\w-])",
        "identifier",
        85,
        "any",
    ),
    (
        "header_bracket",
        r"^\s*(?:\[[^\]\n]{1,80}\]|【[^】\n]{1,80}】)\s*[:：]?",
        "section",
        80,
        "any",
    ),
    (
        "header_markdown",
        r"^\s*#{1,6}\s+\S",
        "section",
        80,
        "any",
    ),
    (
        "step_numbered",
        r"^\s*(?P<ref>\d{1,2})(?:[.)](?!\d)|、)\s*\S",
        "step",
        70,
        "any",
    ),
    (
        "step_word",
        r"(?i)^\s*step\s+(?P<ref>\d{1,2})\b",
        "step",
        70,
        "en",
    ),
    (
        "step_zh",
        r"^\s*第(?P<ref>[0-9一二三四五六七八九十百零两]+)步",
        "step",
        70,
        "zh",
    ),
    (
        "clause_reference",
        r"(?i)\b(?:according\s+to|as\s+per|per|under|see|in|following)\s+(?:the\s+"
        r")?(?:section|clause|article|paragraph|§)\s*(?P<ref>\d+(?:\.\d+)*)",
        "clause_reference",
        60,
        "en",
    ),
    (
        "clause_reference_zh",
        r"(?:按照|根据|依据|依照)\s*第\s*(?P<ref>[0-9一二三四五六七八九十百零两]+)\s*条",
        "clause_reference",
        60,
        "zh",
    ),
    (
        "clause_reference_zh_terms",
        r"(?:根据|按照|依据)[^。！？\n]{0,30}?条款",
        "clause_reference",
        59,
        "zh",
    ),
    (
        "question_en",
        r"\?",
        "question",
        50,
        "en",
    ),
    (
        "question_zh",
        r"？|[吗呢嘛][。.!！]?\s*$",
        "question",
        50,
        "zh",
    ),
)


def upgrade() -> None:
    rules = op.create_table(
        "splitter_rules",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=True),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("pattern", sa.Text(), nullable=False),
        sa.Column("block_type", sa.String(length=32), nullable=False),
        sa.Column("priority", sa.Integer(), nullable=False),
        sa.Column("language", sa.String(length=8), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_splitter_rules_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_splitter_rules")),
        sa.UniqueConstraint("tenant_id", "name", name="uq_splitter_rules_tenant_name"),
    )
    with op.batch_alter_table("splitter_rules", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_splitter_rules_tenant_id"), ["tenant_id"], unique=False)
    now = datetime.now(UTC)
    op.bulk_insert(
        rules,
        [
            {
                "tenant_id": None,
                "name": name,
                "pattern": pattern,
                "block_type": block_type,
                "priority": priority,
                "language": language,
                "enabled": True,
                "updated_at": now,
            }
            for name, pattern, block_type, priority, language in SEED_RULES
        ],
    )

    op.create_table(
        "tenant_context_settings",
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("history_policy", sa.String(length=16), nullable=False),
        sa.Column("similarity_backend", sa.String(length=16), nullable=False),
        sa.Column("shift_threshold", sa.Float(), nullable=False),
        sa.Column("start_temperature", sa.Float(), nullable=False),
        sa.Column("shift_temperature", sa.Float(), nullable=False),
        sa.Column("min_block_length", sa.Integer(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tenant_context_settings_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_context_settings")),
    )
    op.create_table(
        "invalidation_events",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=True),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("actor", sa.String(length=200), nullable=False),
        sa.Column("blocks_freed", sa.Integer(), nullable=False),
        sa.Column("tokens_freed", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chat_sessions.id"],
            name=op.f("fk_invalidation_events_session_id_chat_sessions"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_invalidation_events_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_invalidation_events")),
    )
    with op.batch_alter_table("invalidation_events", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_invalidation_events_session_id"), ["session_id"], unique=False)
        batch_op.create_index("ix_invalidation_events_tenant_created", ["tenant_id", "created_at"], unique=False)

    op.create_table(
        "topic_history",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("message_seq", sa.Integer(), nullable=False),
        sa.Column("similarity", sa.Float(), nullable=True),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("shift", sa.Boolean(), nullable=False),
        sa.Column("topic_epoch", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chat_sessions.id"],
            name=op.f("fk_topic_history_session_id_chat_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_topic_history")),
        sa.UniqueConstraint("session_id", "message_seq", name="uq_topic_history_session_seq"),
    )
    op.create_table(
        "semantic_blocks",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("message_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=False),
        sa.Column("block_index", sa.Integer(), nullable=False),
        sa.Column("block_type", sa.String(length=32), nullable=False),
        sa.Column("char_start", sa.Integer(), nullable=False),
        sa.Column("char_end", sa.Integer(), nullable=False),
        sa.Column("token_count", sa.Integer(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("topic_epoch", sa.Integer(), nullable=False),
        sa.Column("parent_id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), nullable=True),
        sa.ForeignKeyConstraint(
            ["message_id"], ["messages.id"], name=op.f("fk_semantic_blocks_message_id_messages"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["parent_id"],
            ["semantic_blocks.id"],
            name=op.f("fk_semantic_blocks_parent_id_semantic_blocks"),
            ondelete="SET NULL",
        ),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chat_sessions.id"],
            name=op.f("fk_semantic_blocks_session_id_chat_sessions"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_semantic_blocks")),
        sa.UniqueConstraint("message_id", "block_index", name="uq_semantic_blocks_message_index"),
    )
    with op.batch_alter_table("semantic_blocks", schema=None) as batch_op:
        batch_op.create_index("ix_semantic_blocks_session_epoch", ["session_id", "topic_epoch"], unique=False)

    with op.batch_alter_table("chat_sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("semantic_temperature", sa.Float(), nullable=True))
        # NOTE: a server default so existing sessions get epoch 0; the ORM sets it for new rows anyway.
        batch_op.add_column(sa.Column("topic_epoch", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    with op.batch_alter_table("chat_sessions", schema=None) as batch_op:
        batch_op.drop_column("topic_epoch")
        batch_op.drop_column("semantic_temperature")

    with op.batch_alter_table("semantic_blocks", schema=None) as batch_op:
        batch_op.drop_index("ix_semantic_blocks_session_epoch")
    op.drop_table("semantic_blocks")
    op.drop_table("topic_history")
    with op.batch_alter_table("invalidation_events", schema=None) as batch_op:
        batch_op.drop_index("ix_invalidation_events_tenant_created")
        batch_op.drop_index(batch_op.f("ix_invalidation_events_session_id"))
    op.drop_table("invalidation_events")
    op.drop_table("tenant_context_settings")
    with op.batch_alter_table("splitter_rules", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_splitter_rules_tenant_id"))
    op.drop_table("splitter_rules")
