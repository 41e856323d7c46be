"""the contact guard on ``/v1``: ``tenants.v1_contact_guard``

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-05 04:00:00.000000

- ``tenants.v1_contact_guard`` (boolean, false by default): whether ``/v1/chat/completions`` replies pass the
  contact guard (``backend/context/contact_guard.py``), as chat replies always do. Off by default: an API client may
  want the model's raw output. On the tenant's row, not its reply settings: ``/v1`` reads the row with the key
  anyway, so the setting costs no query per request.

Downgrade drops the column (earlier code never guards ``/v1``).
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0014"
down_revision: str | None = "0013"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.add_column(sa.Column("v1_contact_guard", sa.Boolean(), server_default=sa.false(), nullable=False))


def downgrade() -> None:
    with op.batch_alter_table("tenants", schema=None) as batch_op:
        batch_op.drop_column("v1_contact_guard")
