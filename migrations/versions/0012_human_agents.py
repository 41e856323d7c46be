"""human agents: ``agents``, ``handoffs``, ``agent_notes``; ``api_keys.agent_id``, ``messages.agent_id``

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-05 04:00:00.000000

- ``agents``: the people of a tenant who answer hand-offs (a name, unique in the tenant, shown to the customer);
- ``api_keys.agent_id``: an ``agent`` key's person (deleting the person deletes their keys);
- ``messages.agent_id``: the person who wrote a message of role ``agent`` (kept as NULL when the person goes);
- ``handoffs``: each hand-off of a session to the inbox: why, when it was asked for, who holds it, when it was first
  claimed and first answered, and how it ended (the queue, the expected wait and the time to a human's reply);
- ``agent_notes``: private notes on a session (agents and admins only);
- ``tenant_handoff_settings``: when the bot hands off on its own (N bot turns on one topic, a failed tool call).

Downgrade drops the tables and the columns: the agents' messages stay, as rows of role ``agent`` that earlier code
does not put in a prompt, and the agent keys stay, revoked (earlier code would take them for nothing).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012"
down_revision: str | None = "0011"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "agents",
        sa.Column("id", sa.String(length=36), nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=100), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_agents_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agents")),
        sa.UniqueConstraint("tenant_id", "name", name="uq_agents_tenant_name"),
    )
    op.create_index(op.f("ix_agents_tenant_id"), "agents", ["tenant_id"], unique=False)
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_id", sa.String(length=36), nullable=True))
        batch_op.create_index(batch_op.f("ix_api_keys_agent_id"), ["agent_id"], unique=False)
        batch_op.create_foreign_key(
            batch_op.f("fk_api_keys_agent_id_agents"), "agents", ["agent_id"], ["id"], ondelete="CASCADE"
        )
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("agent_id", sa.String(length=36), nullable=True))
        batch_op.create_foreign_key(
            batch_op.f("fk_messages_agent_id_agents"), "agents", ["agent_id"], ["id"], ondelete="SET NULL"
        )
    op.create_table(
        "handoffs",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("reason", sa.String(length=32), nullable=False),
        sa.Column("requested_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("holder", sa.String(length=80), nullable=True),
        sa.Column("holder_name", sa.String(length=100), nullable=True),
        sa.Column("first_claimed_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("first_reply_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("outcome", sa.String(length=16), nullable=True),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_handoffs_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.ForeignKeyConstraint(
            ["session_id"], ["chat_sessions.id"], name=op.f("fk_handoffs_session_id_chat_sessions"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_handoffs")),
    )
    op.create_index(op.f("ix_handoffs_session_id"), "handoffs", ["session_id"], unique=False)
    op.create_index("ix_handoffs_tenant_ended", "handoffs", ["tenant_id", "ended_at"], unique=False)
    op.create_table(
        "agent_notes",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), autoincrement=True, nullable=False),
        sa.Column("session_id", sa.String(length=36), nullable=False),
        sa.Column("author", sa.String(length=100), nullable=False),
        sa.Column("agent_id", sa.String(length=36), nullable=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["session_id"],
            ["chat_sessions.id"],
            name=op.f("fk_agent_notes_session_id_chat_sessions"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["agent_id"], ["agents.id"], name=op.f("fk_agent_notes_agent_id_agents"), ondelete="SET NULL"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_agent_notes")),
    )
    op.create_index(op.f("ix_agent_notes_session_id"), "agent_notes", ["session_id"], unique=False)
    op.create_table(
        "tenant_handoff_settings",
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("no_progress_turns", sa.Integer(), nullable=False),
        sa.Column("on_tool_failure", sa.Boolean(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_handoff_settings_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_handoff_settings")),
    )


def downgrade() -> None:
    op.drop_table("tenant_handoff_settings")
    op.drop_index(op.f("ix_agent_notes_session_id"), table_name="agent_notes")
    op.drop_table("agent_notes")
    op.drop_index("ix_handoffs_tenant_ended", table_name="handoffs")
    op.drop_index(op.f("ix_handoffs_session_id"), table_name="handoffs")
    op.drop_table("handoffs")
    # NOTE: revoked, not deleted: the audit still names them, and earlier code must not authenticate them as nothing
    op.execute(
        sa.text("UPDATE api_keys SET revoked_at = CURRENT_TIMESTAMP WHERE agent_id IS NOT NULL AND revoked_at IS NULL")
    )
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_messages_agent_id_agents"), type_="foreignkey")
        batch_op.drop_column("agent_id")
    with op.batch_alter_table("api_keys", schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f("fk_api_keys_agent_id_agents"), type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_api_keys_agent_id"))
        batch_op.drop_column("agent_id")
    op.drop_index(op.f("ix_agents_tenant_id"), table_name="agents")
    op.drop_table("agents")
