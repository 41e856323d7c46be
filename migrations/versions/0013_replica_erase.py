"""tenant setting ``tenants.replica_erase``: how a session is erased on an engine replica without a per-session erase

Revision ID: 0013
Revises: 0010
Create Date: 2026-12-05 04:00:00.000000

- ``replica_erase``: ``report`` (the default: nothing is erased there, and the erasure names the replica) or
  ``reset_cache`` (that replica's whole prefix cache is reset: vLLM's ``/reset_prefix_cache``; docs/scale-out.md).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0013"
down_revision: str | None = "0010"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("replica_erase", sa.String(length=16), nullable=False, server_default="report"))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("replica_erase")
