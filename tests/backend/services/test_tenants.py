"""Default-tenant bootstrap and key authentication, on SQLite and Postgres."""

from __future__ import annotations

import pytest
from sqlalchemy import func, select

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import ApiKey, Tenant
from backend.domain import KeyKind
from backend.services.tenants import authenticate, bootstrap_default_tenant

pytestmark = pytest.mark.anyio


async def test_first_start_generates_keys_once_and_they_authenticate(db_url: str) -> None:
    engine = create_db_engine(db_url)
    maker = create_sessionmaker(engine)
    try:
        first = await bootstrap_default_tenant(maker, None, None)
        assert first.created
        assert first.generated_chat_token and first.generated_chat_token.startswith("kvc_chat_")
        assert first.generated_admin_key and first.generated_admin_key.startswith("kvc_admin_")
        second = await bootstrap_default_tenant(maker, None, None)
        assert (second.created, second.generated_chat_token, second.generated_admin_key) == (False, None, None)
        assert second.tenant_id == first.tenant_id
        async with maker() as db:
            assert await db.scalar(select(func.count()).select_from(Tenant)) == 1
            assert await db.scalar(select(func.count()).select_from(ApiKey)) == 2
            stored = set((await db.execute(select(ApiKey.key_hash))).scalars())
            assert first.generated_chat_token not in stored  # only hashes are stored
            chat = await authenticate(db, first.generated_chat_token, KeyKind.CHAT)
            assert chat is not None and chat.id == first.tenant_id
            assert await authenticate(db, first.generated_chat_token, KeyKind.ADMIN) is None
            assert await authenticate(db, first.generated_admin_key, KeyKind.ADMIN) is not None
            assert await authenticate(db, "kvc_chat_wrong", KeyKind.CHAT) is None
            assert await authenticate(db, "", KeyKind.CHAT) is None
    finally:
        await engine.dispose()


async def test_configured_keys_are_used_and_not_printed(db_url: str) -> None:
    engine = create_db_engine(db_url)
    maker = create_sessionmaker(engine)
    try:
        boot = await bootstrap_default_tenant(maker, "chat-secret-1", "admin-secret-1")
        assert (boot.generated_chat_token, boot.generated_admin_key) == (None, None)
        again = await bootstrap_default_tenant(maker, "chat-secret-1", "admin-secret-1")
        assert not again.created
        async with maker() as db:
            assert await db.scalar(select(func.count()).select_from(ApiKey)) == 2  # idempotent
            assert await authenticate(db, "chat-secret-1", KeyKind.CHAT) is not None
            assert await authenticate(db, "admin-secret-1", KeyKind.ADMIN) is not None
    finally:
        await engine.dispose()
