"""The engine-global cache settings (TTLs per tier, disk cap, free-space floor, eviction policy, block-type weights,
pinned share), read and changed at runtime through ``EngineClient.configure_cache``.

NOTE: operator-only (``/admin/cache/settings`` takes the operator's credential, never a tenant's admin key): one
engine serves every tenant, so these settings are every tenant's at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from backend.core.errors import InvalidCacheSettingsError
from backend.engine_client import control
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import CacheSettings, InvalidRequestError


async def current(engine: EngineClient) -> CacheSettings:
    return await control.cache_settings(engine)


async def configure(engine: EngineClient, changes: Mapping[str, Any]) -> CacheSettings:
    """Apply ``changes`` (the fields given; the rest keep their value) and return the settings now in force.

    A value the engine refuses changes nothing and is an ``InvalidCacheSettingsError`` (422) with the engine's reason.
    """
    if not changes:
        return await control.cache_settings(engine)
    try:
        return await control.configure_cache(engine, **changes)
    except InvalidRequestError as exc:
        raise InvalidCacheSettingsError(str(exc)) from exc


def describe(changes: Mapping[str, Any]) -> str:
    """The audit's note of a change: ``memory_ttl_s=30.0, eviction_policy=lru``."""
    return ", ".join(f"{name}={value}" for name, value in sorted(changes.items()))[:500] or "no change"
