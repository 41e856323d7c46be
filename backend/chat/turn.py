"""What every turn shares: the server's reply settings (``ReplyConfig``) and a short database step retried through
a blip (``with_db_retry``). The turn itself reads top to bottom in ``backend/chat/turn_path.py``."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from backend.services.reply_settings import ReplySettings

log = logging.getLogger("kvchat.chat")
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ReplyConfig:
    """The server's reply settings: the reply's length, how tenants without settings of their own sample
    (``KVCHAT_REPLY_*``; a tenant's own: ``/admin/tenant/reply-settings``), and whether tenants' tools may be on
    loopback or private addresses (``KVCHAT_TOOLS_ALLOW_PRIVATE_NETWORKS``)."""

    max_tokens: int = 256
    defaults: ReplySettings = field(default_factory=ReplySettings)
    tools_allow_private_networks: bool = False


async def with_db_retry(
    sessionmaker: async_sessionmaker[AsyncSession], what: str, step: Callable[[AsyncSession], Awaitable[T]]
) -> T:
    """Run ``step`` in a short DB session; when the database went away (a restart, a failover), try again for a few
    seconds. ``step`` must be safe to repeat. A constraint violation is no blip: it is raised at once."""
    for pause in (*_DB_RETRY_PAUSES_S, None):
        try:
            async with sessionmaker() as db:
                return await step(db)
        except IntegrityError:
            raise
        except (DBAPIError, OSError):
            if pause is None:
                raise
            log.warning("%s failed on the database; retrying in %.2fs", what, pause)
            await asyncio.sleep(pause)
    raise AssertionError("unreachable: the last attempt returns or raises")


_DB_RETRY_PAUSES_S = (0.25, 0.5, 1.0, 2.0, 4.0)  # ~8 s: a Postgres restart or failover
