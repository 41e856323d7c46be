"""splitter rules for two dialogue acts: a greeting, and a request for a human agent (English and Chinese)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-02 12:00:00.000000

Adds the global rules ``handoff_request`` (block type ``handoff``) and ``greeting`` (``greeting``), in RE2 syntax.

Downgrade: the two rows go, and so do the block types: stored blocks of type ``greeting`` or ``handoff`` become
``context`` (what the splitter of 0006 called any text no rule claimed), since code of that revision cannot read
the new types.

NOTE: frozen copies of the patterns of ``backend/context/acts.py``, like 0002's seed: a migration is history.
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, pattern, block_type, priority, language)
RULES: tuple[tuple[str, str, str, int, str], ...] = (
    (
        "handoff_request",
        r"(?i)\b(?:human|real\s+person|live\s+(?:agent|person|chat)|representative|human\s+agent"
        r"|(?:speak|talk|chat)\s+(?:to|with)\s+(?:an?\s+)?(?:agent|person|someone|manager|supervisor))\b"
        r"|转人工|转接人工|人工客服|人工服务|真人客服|找人工|要人工|接人工",
        "handoff",
        58,
        "any",
    ),
    (
        "greeting",
        r"(?i)^\s*(?:(?:hi|hello|hey|hiya|hallo|greetings|namaste|good\s+(?:morning|afternoon|evening|day))"
        r"(?:\s*,?\s*(?:there|all|everyone|team|guys|sir|madam|support))?"
        r"|dear\s+(?:sir|madam|team|support|customer\s+(?:service|support|care))"
        r"|你好|您好|哈喽|嗨|在吗|在不在|早上好|下午好|晚上好)"
        r"\s*[.!,。！，~？?]*\s*$",
        "greeting",
        55,
        "any",
    ),
)
NEW_TYPES = ("greeting", "handoff")

_rules = sa.table(
    "splitter_rules",
    sa.column("tenant_id", sa.String),
    sa.column("name", sa.String),
    sa.column("pattern", sa.Text),
    sa.column("block_type", sa.String),
    sa.column("priority", sa.Integer),
    sa.column("language", sa.String),
    sa.column("enabled", sa.Boolean),
    sa.column("updated_at", sa.DateTime(timezone=True)),
)


def upgrade() -> None:
    now = datetime.now(UTC)
    op.bulk_insert(
        _rules,
        [
            {
                "tenant_id": None,
                "name": name,
                "pattern": pattern,
                "block_type": block_type,
                "priority": priority,
                "language": language,
                "enabled": True,
                "updated_at": now,
            }
            for name, pattern, block_type, priority, language in RULES
        ],
    )


def downgrade() -> None:
    blocks = sa.table("semantic_blocks", sa.column("block_type", sa.String))
    op.execute(blocks.update().where(blocks.c.block_type.in_(NEW_TYPES)).values(block_type="context"))
    # NOTE: a tenant's own rule of a new type would be unreadable too: it becomes a context rule, kept for its admin.
    op.execute(_rules.update().where(_rules.c.block_type.in_(NEW_TYPES)).values(block_type="context"))
    op.execute(_rules.delete().where(_rules.c.tenant_id.is_(None), _rules.c.name.in_([r[0] for r in RULES])))
