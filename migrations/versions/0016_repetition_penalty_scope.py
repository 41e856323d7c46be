"""reply settings: the repetition penalty's scope, ``tenant_reply_settings.repetition_penalty_scope``

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-06 07:40:00.000000

- ``repetition_penalty_scope``: ``all`` (every token seen, the prompt's included: vLLM's semantics) or ``reply``
  (the reply's own tokens only, so the prompt's wording stays free to quote and to be drafted). Stored settings get
  ``all``, what they had before.

Downgrade drops the column (every tenant's penalty covers the prompt again).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: str | None = "0015"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenant_reply_settings", schema=None) as batch_op:
        batch_op.add_column(
            sa.Column("repetition_penalty_scope", sa.String(length=8), server_default="all", nullable=False)
        )


def downgrade() -> None:
    with op.batch_alter_table("tenant_reply_settings", schema=None) as batch_op:
        batch_op.drop_column("repetition_penalty_scope")
