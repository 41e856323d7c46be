"""a tenant's handbook: ``handbook_sections``, ``tenants.handbook_version``, ``topic_history.sections``

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-05 04:50:00.000000

- ``handbook_sections``: one row per section of a tenant's handbook (title unique per tenant, position, text, a
  sha256 of title and text, example customer questions as a JSON list, the handbook version that last changed it);
- ``tenants.handbook_version``: bumped by every edit; the section cache and the audit log name it;
- ``topic_history.sections``: the titles of the sections the topic's prompt held after the message (JSON list).

Downgrade drops them (earlier code builds prompts without a handbook; the sections' cached blocks go unused).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "handbook_sections",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("content_hash", sa.String(length=64), nullable=False),
        sa.Column("examples", sa.Text(), server_default="[]", nullable=False),
        sa.Column("version", sa.Integer(), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_handbook_sections_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_handbook_sections")),
        sa.UniqueConstraint("tenant_id", "title", name="uq_handbook_sections_tenant_title"),
    )
    op.create_index(op.f("ix_handbook_sections_tenant_id"), "handbook_sections", ["tenant_id"], unique=False)
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("handbook_version", sa.Integer(), server_default="0", nullable=False))
    with op.batch_alter_table("topic_history", schema=None) as batch_op:
        batch_op.add_column(sa.Column("sections", sa.Text(), server_default="[]", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("topic_history", schema=None) as batch_op:
        batch_op.drop_column("sections")
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("handbook_version")
    op.drop_index(op.f("ix_handbook_sections_tenant_id"), table_name="handbook_sections")
    op.drop_table("handbook_sections")
