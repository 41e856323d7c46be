"""a reply's tool calls and their results: ``messages.tool_exchange``

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 05:00:00.000000

- ``messages.tool_exchange`` (nullable text, JSON): on a bot reply that called the tenant's tools, the calls and
  their results as the model read them (``backend/services/tool_exchange.py``). The next turn's prompt writes them
  back before the reply, so it extends the prompt the reply was generated from and the prefix cache serves it.

Downgrade drops the column (earlier code builds prompts without the calls; their cached blocks just go unused).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.add_column(sa.Column("tool_exchange", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("messages", schema=None) as batch_op:
        batch_op.drop_column("tool_exchange")
