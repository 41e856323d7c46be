"""Alembic environment (async). The URL comes from ``config.attributes['url']``, ``-x url=``, or kvchat settings."""

from __future__ import annotations

import asyncio
from logging.config import fileConfig

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine

from backend.core.config import Settings, normalize_database_url
from backend.db.models import Base

config = context.config
if config.config_file_name is not None and not config.attributes.get("skip_logging_config"):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata


def _url() -> str:
    url = config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url")
    return normalize_database_url(url) if url else Settings().resolved_database_url


def _configure(connection: Connection | None, url: str | None = None) -> None:
    is_sqlite = (url or "").startswith("sqlite") or (connection is not None and connection.dialect.name == "sqlite")
    context.configure(
        connection=connection,
        url=url,
        target_metadata=target_metadata,
        # NOTE: SQLite cannot ALTER most things in place; batch mode rebuilds the table instead.
        render_as_batch=is_sqlite,
        compare_type=True,
    )


def run_migrations_offline() -> None:
    _configure(None, _url())
    with context.begin_transaction():
        context.run_migrations()


def _run_sync(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def run_migrations_online() -> None:
    engine = create_async_engine(_url())
    try:
        async with engine.connect() as connection:
            await connection.run_sync(_run_sync)
    finally:
        await engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    asyncio.run(run_migrations_online())
