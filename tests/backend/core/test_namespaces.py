"""Cache namespaces: derived on the server from the tenant and the secret, stable across restarts, never shared
between private tenants; the public namespace is one, shared only by the tenants that opt in."""

from __future__ import annotations

import hashlib
import hmac
import logging
import stat
from pathlib import Path

import pytest

from backend.core.namespaces import (
    SECRET_FILE,
    CacheScope,
    Namespaces,
    SecretMismatchError,
    cache_namespace,
    check_shared_secret,
    load_secret,
    secret_tag,
)
from backend.db.engine import tag_of, worker_name

SECRET = b"k" * 32
PRIVATE, PUBLIC = CacheScope.PRIVATE, CacheScope.PUBLIC


def test_the_namespace_is_an_hmac_of_the_tenant_under_the_secret() -> None:
    expected = hmac.new(SECRET, b"tenant:t1", hashlib.sha256).hexdigest()
    assert cache_namespace("t1", SECRET, PRIVATE) == expected
    assert cache_namespace("t1", SECRET, PRIVATE) == cache_namespace("t1", SECRET, PRIVATE)  # stable
    assert "t1" not in expected and len(expected) == 64


def test_two_tenants_never_share_a_private_namespace() -> None:
    ids = [f"tenant-{i}" for i in range(200)] + ["public", "tenant:", "", "public\x00"]
    names = {cache_namespace(t, SECRET, PRIVATE) for t in ids}
    assert len(names) == len(ids)
    # NOTE: domain-separated: no tenant id, "public" included, derives the public namespace
    assert cache_namespace("x", SECRET, PUBLIC) not in names


def test_another_secret_gives_every_tenant_another_namespace() -> None:
    assert cache_namespace("t1", SECRET, PRIVATE) != cache_namespace("t1", b"other", PRIVATE)
    assert cache_namespace("t1", SECRET, PUBLIC) != cache_namespace("t1", b"other", PUBLIC)


def test_the_public_opt_in_is_one_namespace_for_every_tenant_that_takes_it() -> None:
    ns = Namespaces(SECRET)
    assert ns.of("t1", "public") == ns.of("t2", CacheScope.PUBLIC)
    assert ns.of("t1", "public") != ns.of("t1", "private")
    with pytest.raises(ValueError, match="is not a valid CacheScope"):
        ns.of("t1", "anything-a-client-sends")


def test_a_configured_secret_is_used_as_is(tmp_path: Path) -> None:
    assert load_secret("s3cret", tmp_path) == b"s3cret"
    assert not (tmp_path / SECRET_FILE).exists()


def test_without_a_secret_one_is_generated_once_kept_0600_and_reused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data = tmp_path / "data"
    with caplog.at_level(logging.INFO, logger="kvchat"):
        first = load_secret(None, data)
    path = data / SECRET_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert len(first) == 64
    assert [r.message for r in caplog.records if "cache secret" in r.message] == [
        f"KVCHAT_SECRET_KEY is unset: generated a cache secret in {path} (keep it to keep the disk cache)"
    ]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kvchat"):
        again = load_secret(None, data)  # a restart
    assert again == first and caplog.records == []
    assert load_secret("", data) == first  # an empty env var is unset


def test_an_empty_secret_file_is_refused_not_used(tmp_path: Path) -> None:
    (tmp_path / SECRET_FILE).write_bytes(b"")
    with pytest.raises(RuntimeError, match="is empty"):
        load_secret(None, tmp_path)


def test_the_secret_tag_is_short_keyed_and_stable() -> None:
    assert secret_tag(b"one") == secret_tag(b"one")
    assert secret_tag(b"one") != secret_tag(b"two")
    assert len(secret_tag(b"one")) == 8 and int(secret_tag(b"one"), 16) >= 0


def test_a_peer_with_another_secret_is_refused_and_one_with_the_same_is_not() -> None:
    mine = secret_tag(b"one")
    check_shared_secret(mine, {})
    check_shared_secret(mine, {"kvchat-worker:7:aa:" + mine: mine})
    with pytest.raises(SecretMismatchError, match=r"^another kvchat worker on this database \(kvchat-worker:8:bb:"):
        check_shared_secret(mine, {"kvchat-worker:7:aa:" + mine: mine, "kvchat-worker:8:bb:x": secret_tag(b"two")})


def test_a_worker_name_carries_its_tag() -> None:
    assert tag_of(worker_name("0badc0de")) == "0badc0de"
    assert tag_of(worker_name()) is None  # (a worker of an older release: no tag, nothing to compare)
