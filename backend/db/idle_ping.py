"""Ping a pooled Postgres connection at checkout only when it sat idle: pre-ping without a round trip per checkout.

SQLAlchemy's ``pool_pre_ping`` tests every connection it hands out with a ``SELECT 1``: one round trip per database
session, ~5 a chat turn, 7 % of the event loop's samples at saturation on Zen 4 (py-spy, ``bench.backend_overhead
--think-s 2 --postgres``). A connection that came back to the pool a moment ago was alive then; the one that waited
longer than ``IDLE_PING_S`` is tested, as before, and replaced when it is dead (a ``DisconnectionError`` from the
checkout event makes the pool discard it and connect again).

NOTE: after a Postgres restart, a connection used within the last ``IDLE_PING_S`` fails its first statement instead;
SQLAlchemy then invalidates every connection the pool holds (its disconnect handling), so the others are replaced
at their next checkout, and the turn path's writes retry (``chat/turn.py``'s ``with_db_retry``).
"""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DisconnectionError

IDLE_PING_S = 2.0
_LAST_IN = "kvchat_last_checkin"


def ping_when_idle(engine: Engine, idle_s: float | None = None) -> None:
    """Listen on ``engine``'s pool: a connection idle for more than ``idle_s`` (``IDLE_PING_S``) is pinged at
    checkout."""
    idle_s = IDLE_PING_S if idle_s is None else idle_s

    def checkin(_dbapi_connection: Any, record: Any) -> None:
        if record is not None:
            record.info[_LAST_IN] = time.monotonic()

    def checkout(dbapi_connection: Any, record: Any, _proxy: Any) -> None:
        last = record.info.get(_LAST_IN)  # (none: a connection made for this checkout)
        if last is None or time.monotonic() - last <= idle_s:
            return
        try:
            engine.dialect.do_ping(dbapi_connection)
        except Exception as exc:
            raise DisconnectionError("a pooled connection did not answer its ping") from exc

    event.listen(engine, "checkin", checkin)
    event.listen(engine, "checkout", checkout)
