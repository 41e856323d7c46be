"""tenant cache settings: ``tenants.policy_text``, ``cache_scope``, ``pin_prefix``; operator rows and details in
``admin_audit``

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01 18:30:00.000000

- ``policy_text``: the tenant's policy, rendered right after its system prompt (the prompt's part 1);
- ``cache_scope``: ``private`` (the tenant's own cache namespace) or ``public`` (the shared one, an opt-in);
- ``pin_prefix``: keep the tenant's system + policy prefix pinned in the engine's memory tier;
- ``admin_audit.tenant_id`` becomes nullable: an operator action (engine-global cache settings) belongs to no tenant;
- ``admin_audit.detail``: what an action did, in a few words (e.g. the blocks an erasure removed from each tier).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("policy_text", sa.Text(), nullable=False, server_default=""))
        batch_op.add_column(sa.Column("cache_scope", sa.String(length=16), nullable=False, server_default="private"))
        batch_op.add_column(sa.Column("pin_prefix", sa.Boolean(), nullable=False, server_default=sa.false()))
    with op.batch_alter_table("admin_audit", schema=None) as batch_op:
        batch_op.alter_column("tenant_id", existing_type=sa.String(length=36), nullable=True)
        batch_op.add_column(sa.Column("detail", sa.String(length=500), nullable=True))


def downgrade() -> None:
    # NOTE: operator rows have no tenant to keep them under once the column is NOT NULL again: they go.
    op.execute("DELETE FROM admin_audit WHERE tenant_id IS NULL")
    with op.batch_alter_table("admin_audit", schema=None) as batch_op:
        batch_op.drop_column("detail")
        batch_op.alter_column("tenant_id", existing_type=sa.String(length=36), nullable=False)
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("pin_prefix")
        batch_op.drop_column("cache_scope")
        batch_op.drop_column("policy_text")
