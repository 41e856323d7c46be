"""Cache namespaces: the salt every engine call carries, derived here on the server and nowhere else.

    namespace = HMAC-SHA256(secret, b"tenant:" + tenant_id)   scope "private" (the default)
    namespace = HMAC-SHA256(secret, b"public")                scope "public": an explicit per-tenant opt-in

The secret is ``KVCHAT_SECRET_KEY``; unset (development only, ``Settings`` refuses it elsewhere) a random key is
generated once and kept in ``<data_dir>/cache_secret`` (mode 0600), so the namespaces, and with them the engine's disk
cache, survive restarts. No request field, header or key reaches the derivation: only the tenant id the server
authenticated and the tenant's stored ``cache_scope``.

NOTE: the two messages are domain-separated (``tenant:`` prefix vs the bare word), so no tenant id, whatever it is,
can derive the public namespace, and the namespace, an HMAC, tells nothing about the tenant without the secret. A
different secret gives every tenant a new namespace: the old cache is then unreachable (as after a model change).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

log = logging.getLogger("kvchat")

SECRET_FILE = "cache_secret"
_TAG_MESSAGE = b"kvchat: workers on one database share this secret"
_PUBLIC = b"public"
_TENANT = b"tenant:"


class CacheScope(StrEnum):
    """Which namespace a tenant's requests use: its own (``private``) or the shared ``public`` one (opt-in)."""

    PRIVATE = "private"
    PUBLIC = "public"


def cache_namespace(tenant_id: str, secret: bytes, scope: CacheScope) -> str:
    """The engine namespace of ``tenant_id``'s requests under ``scope`` (64 hex characters)."""
    message = _PUBLIC if scope is CacheScope.PUBLIC else _TENANT + tenant_id.encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


@dataclass(frozen=True, slots=True)
class Namespaces:
    """The server's secret, bound once at start: ``namespaces.of(tenant.id, scope)``."""

    secret: bytes

    def of(self, tenant_id: str, scope: CacheScope | str) -> str:
        return cache_namespace(tenant_id, self.secret, CacheScope(scope))


class SecretMismatchError(ValueError):
    """Another worker on the same database derives its namespaces from another secret: refused at start."""


def secret_tag(secret: bytes) -> str:
    """A short keyed digest of the secret, put in the worker's database connection name so that a second worker can
    check it shares the first's secret. NOTE: 32 bits of an HMAC: it tells nothing about the secret, and two workers
    with different secrets differ here but for a 1-in-4-billion collision."""
    return hmac.new(secret, _TAG_MESSAGE, hashlib.sha256).hexdigest()[:8]


def check_shared_secret(own_tag: str, peers: dict[str, str]) -> None:
    """Refuse to serve beside a worker (``peers``: name -> tag) whose secret differs: its tenants' namespaces would
    differ from this worker's, so their cached blocks would be unreachable, or found twice, depending on the worker."""
    other = sorted(name for name, tag in peers.items() if tag != own_tag)
    if other:
        raise SecretMismatchError(
            f"another kvchat worker on this database ({other[0]}) uses another KVCHAT_SECRET_KEY: every worker on one "
            "database must share it (the cache namespaces derive from it); set the same KVCHAT_SECRET_KEY here"
        )


def load_secret(configured: str | None, data_dir: Path) -> bytes:
    """``KVCHAT_SECRET_KEY`` when set; else the key kept in ``data_dir``, generated (0600) on the first start."""
    if configured:
        return configured.encode()
    path = data_dir / SECRET_FILE
    if path.exists():
        return _read_key(path)
    data_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32).encode()
    try:
        # NOTE: O_EXCL: two workers starting together on a fresh data dir must end up with one key, not two.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_key(path)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
        f.flush()
        os.fsync(f.fileno())
    log.info("KVCHAT_SECRET_KEY is unset: generated a cache secret in %s (keep it to keep the disk cache)", path)
    return key


def _read_key(path: Path) -> bytes:
    # NOTE: another worker may have created the file an instant ago and not written it yet: wait for its key.
    for _ in range(100):
        key = path.read_bytes().strip()
        if key:
            return key
        time.sleep(0.01)
    raise RuntimeError(f"{path} is empty: delete it (a new cache secret is generated) or set KVCHAT_SECRET_KEY")
