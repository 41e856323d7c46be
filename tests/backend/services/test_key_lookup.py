"""``KeyLookup`` on SQLite and Postgres: simultaneous lookups of one key share one query; ``recent`` remembers a key's
tenant for refusals only, forgets it after the TTL or once the key is revoked, and never remembers a bad key."""

from __future__ import annotations

import asyncio

import pytest

from backend.db.engine import create_db_engine, create_sessionmaker
from backend.domain import KeyKind
from backend.services.key_lookup import TTL_S, KeyLookup
from backend.services.revocation import KeyWatch
from backend.services.tenants import bootstrap_default_tenant

pytestmark = pytest.mark.anyio

TOKEN = "kvc_chat_lookup-test"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


async def test_a_burst_of_lookups_costs_one_query_and_is_remembered_for_refusals_only(db_url: str) -> None:
    engine = create_db_engine(db_url)
    try:
        maker = create_sessionmaker(engine)
        boot = await bootstrap_default_tenant(maker, TOKEN, None)
        clock, watch = Clock(), KeyWatch()
        lookup = KeyLookup(maker, watch, clock)
        assert lookup.recent(TOKEN, KeyKind.CHAT) is None  # nothing known before a lookup
        owners = await asyncio.gather(*(lookup.owner(TOKEN, KeyKind.CHAT) for _ in range(50)))
        assert lookup.queries == 1
        assert {o.tenant.id for o in owners if o is not None} == {boot.tenant_id} and None not in owners
        known = lookup.recent(TOKEN, KeyKind.CHAT)
        assert known is not None and (known.tenant_id, known.key_id) == (boot.tenant_id, owners[0].key_id)
        assert lookup.recent(TOKEN, KeyKind.ADMIN) is None  # remembered per kind
        await lookup.owner(TOKEN, KeyKind.CHAT)
        assert lookup.queries == 2  # a later lookup asks the database again: memory never admits
        clock.now += TTL_S
        assert lookup.recent(TOKEN, KeyKind.CHAT) is None  # too old
        await lookup.owner(TOKEN, KeyKind.CHAT)
        watch.revoked([owners[0].key_id])
        assert lookup.recent(TOKEN, KeyKind.CHAT) is None  # revoked since
        assert await asyncio.gather(*(lookup.owner("kvc_chat_bad", KeyKind.CHAT) for _ in range(5))) == [None] * 5
        assert lookup.recent("kvc_chat_bad", KeyKind.CHAT) is None
        assert await lookup.owner("", KeyKind.CHAT) is None
    finally:
        await engine.dispose()
