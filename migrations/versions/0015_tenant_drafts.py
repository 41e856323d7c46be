"""per-tenant suffix drafts: ``tenants.drafts``

Revision ID: 0015
Revises: 0012
Create Date: 2026-12-06 00:45:00.000000

- ``drafts``: ``on``, ``off`` or ``default`` (follow the engine's switch, ``KVCHAT_ENGINE_DRAFTS``): whether the
  tenant's replies decode with suffix drafts (``engine/spec``; verified exactly, so the output is the same either
  way). Stored tenants get ``default``, what they had before.

Downgrade drops the column (every tenant follows the engine's switch again).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0015"
down_revision: str | None = "0012"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("drafts", sa.String(length=8), server_default="default", nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("drafts")
