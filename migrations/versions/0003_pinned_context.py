"""pinned context: ``chat_sessions.pinned_context``, the customer facts an admin pins to a session

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 16:32:00.000000

The context builder puts it right after the tenant's system prompt; editing it bumps ``context_version`` and frees
the session's cached blocks from there on.
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("chat_sessions", schema=None) as batch_op:
        batch_op.add_column(sa.Column("pinned_context", sa.Text(), nullable=False, server_default=""))


def downgrade() -> None:
    with op.batch_alter_table("chat_sessions", schema=None) as batch_op:
        batch_op.drop_column("pinned_context")
