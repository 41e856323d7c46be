"""per-tenant reply settings and tools: ``tenant_reply_settings``, ``tenant_tools``

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-03 12:00:00.000000

- ``tenant_reply_settings``: one row per tenant that changed its reply settings (sampling, penalties, stop strings,
  how the bot uses its tools); no row means the server's defaults (``KVCHAT_REPLY_*``);
- ``tenant_tools``: the HTTP endpoints a tenant registered for the bot to call (name, argument schema, URL, a secret
  header), unique by name within the tenant.

Downgrade drops both tables (the settings and tools are lost; earlier code has nowhere to keep them).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_reply_settings",
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("top_p", sa.Float(), nullable=False),
        sa.Column("top_k", sa.Integer(), nullable=False),
        sa.Column("min_p", sa.Float(), nullable=False),
        sa.Column("repetition_penalty", sa.Float(), nullable=False),
        sa.Column("presence_penalty", sa.Float(), nullable=False),
        sa.Column("frequency_penalty", sa.Float(), nullable=False),
        sa.Column("stop", sa.Text(), nullable=False),
        sa.Column("tool_choice", sa.String(length=16), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"],
            ["tenants.id"],
            name=op.f("fk_tenant_reply_settings_tenant_id_tenants"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_reply_settings")),
    )
    op.create_table(
        "tenant_tools",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("description", sa.Text(), nullable=False),
        sa.Column("parameters", sa.Text(), nullable=False),
        sa.Column("url", sa.String(length=2000), nullable=False),
        sa.Column("secret_header", sa.String(length=100), nullable=True),
        sa.Column("secret_value", sa.String(length=1000), nullable=True),
        sa.Column("timeout_s", sa.Float(), nullable=False),
        sa.Column("enabled", sa.Boolean(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_tools_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_tenant_tools")),
        sa.UniqueConstraint("tenant_id", "name", name="uq_tenant_tools_tenant_name"),
    )
    with op.batch_alter_table("tenant_tools", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_tenant_tools_tenant_id"), ["tenant_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("tenant_tools", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_tenant_tools_tenant_id"))
    op.drop_table("tenant_tools")
    op.drop_table("tenant_reply_settings")
