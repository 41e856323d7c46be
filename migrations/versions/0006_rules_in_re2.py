"""seeded splitter rules in RE2 syntax: the five global rules that used lookarounds, rewritten

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-02 09:00:00.000000

Splitter patterns are compiled with RE2 from this revision on (``backend/context/rules.py``): it matches in linear
time, so no rule can stall a turn, but it has no lookarounds. The five seeded rules that used them are rewritten to
classify the same texts; a global row is only updated while it still holds the seeded pattern (one an operator
changed is left as it is). Tenants' own rules are not touched: one that RE2 refuses is skipped by the chat, with a
log line, until its admin fixes it.

NOTE: frozen copies of the patterns, like 0002's seed: a migration is history, whatever ``rules.py`` says later.
"""

from collections.abc import Sequence
from datetime import UTC, datetime

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# (name, pattern as 0002 seeded it, pattern in RE2 syntax)
REWRITES: tuple[tuple[str, str, str], ...] = (
    (
        "order_number",
        r"(?<![\w-])#?\d{3}-\d{5,7}-\d{4,7}(?![\w-])|#\d{6,}(?!\d)|(?i:\border\s*("
        r"?:id|no\.?|number)?\s*[:#]?\s*)[A-Z0-9-]*\d[A-Z0-9-]{4,}",
        r"(?:^|[^\p{L}\p{N}_-])(?P<value>#?\p{Nd}{3}-\p{Nd}{5,7}-\p{Nd}{4,7})(?:[^\p{L}\p{N}_-]|$)|#\p{Nd}{6,}"
        r"|(?i:\border\s*(?:id|no\.?|number)?\s*[:#]?\s*)[A-Z0-9-]*\d[A-Z0-9-]{4,}",
    ),
    (
        "account_or_ticket",
        r"(?i)\b(?:account|acct|ticket|case|tracking|awb|invoice|refund|membership"
        r"|reference|ref)\s*(?:id|no\.?|number|#)?\s*[:#]?\s*(?=[A-Z0-9-]*\d)[A-Z0"
        r"-9][A-Z0-9-]{4,}\b",
        r"(?i)\b(?:account|acct|ticket|case|tracking|awb|invoice|refund|membership|reference|ref)"
        r"\s*(?:id|no\.?|number|#)?\s*[:#]?\s*"
        r"(?:\d[A-Z0-9-]{4,}|[A-Z](?:[A-Z-]{3,}\d|[A-Z-]{2}\d[A-Z0-9-]|[A-Z-]\d[A-Z0-9-]{2}|\d[A-Z0-9-]{3})"
        r"[A-Z0-9-]*)\b",
    ),
    (
        "email",
        r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\[email\s+protected\]",
        r"[\p{L}\p{N}_.+-]+@[\p{L}\p{N}_-]+(?:\.[\p{L}\p{N}_-]+)+|\[email\s+protected\]",
    ),
    (
        "phone",
        r"(?<![\w-])\+?\d(?:[\s().-]?\d){9,14}(?![\w-])",
        r"(?:^|[^\p{L}\p{N}_-])(?P<value>\+?\p{Nd}(?:[\s().-]?\p{Nd}){9,14})(?:[^\p{L}\p{N}_-]|$)",
    ),
    (
        "step_numbered",
        r"^\s*(?P<ref>\d{1,2})(?:[.)](?!\d)|、)\s*\S",
        r"^\s*(?P<ref>\d{1,2})(?:[.)](?:\s+\S|[^\d\s])|、\s*\S)",
    ),
)


def _replace(pairs: Sequence[tuple[str, str, str]]) -> None:
    """Set each global rule ``name`` that holds ``before`` to ``after`` (and touch ``updated_at``, which tells every
    running server's rule cache to compile again)."""
    rules = sa.table(
        "splitter_rules",
        sa.column("tenant_id", sa.String),
        sa.column("name", sa.String),
        sa.column("pattern", sa.Text),
        sa.column("updated_at", sa.DateTime(timezone=True)),
    )
    now = datetime.now(UTC)
    for name, before, after in pairs:
        op.execute(
            rules.update()
            .where(rules.c.tenant_id.is_(None), rules.c.name == name, rules.c.pattern == before)
            .values(pattern=after, updated_at=now)
        )


def upgrade() -> None:
    _replace(REWRITES)


def downgrade() -> None:
    _replace([(name, after, before) for name, before, after in REWRITES])
