"""per-tenant fair share: ``tenant_fair_share``

Revision ID: 0011
Revises: 0014
Create Date: 2026-12-05 04:00:00.000000

- ``tenant_fair_share``: one row per tenant the operator gave a weight or quotas (tokens per minute, concurrent
  requests); no row means weight 1 and no limits (``backend/core/tenant_quota.py``).

Downgrade drops the table (the weights and quotas are lost; earlier code schedules first come, first served).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0011"
down_revision: str | None = "0014"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "tenant_fair_share",
        sa.Column("tenant_id", sa.String(length=36), nullable=False),
        sa.Column("weight", sa.Float(), nullable=False),
        sa.Column("tokens_per_minute", sa.Integer(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(
            ["tenant_id"], ["tenants.id"], name=op.f("fk_tenant_fair_share_tenant_id_tenants"), ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("tenant_id", name=op.f("pk_tenant_fair_share")),
    )


def downgrade() -> None:
    op.drop_table("tenant_fair_share")
