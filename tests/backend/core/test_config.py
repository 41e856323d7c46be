"""Settings: env prefix, URL normalisation, refusal of default secrets outside development."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from backend.core.config import DEV_SECRET, Environment, Settings, normalize_database_url


def test_env_prefix_is_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_PORT", "9123")
    monkeypatch.setenv("KVCHAT_HOST", "0.0.0.0")
    settings = Settings()
    assert (settings.host, settings.port) == ("0.0.0.0", 9123)


def test_default_database_is_sqlite_under_data_dir(tmp_path: Path) -> None:
    url = Settings(data_dir=tmp_path).resolved_database_url
    assert url == f"sqlite+aiosqlite:///{(tmp_path / 'kvchat.db').resolve()}"


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("postgres://u:p@h:5432/db", "postgresql+asyncpg://u:p@h:5432/db"),
        ("postgresql://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("sqlite:////tmp/x.db", "sqlite+aiosqlite:////tmp/x.db"),
    ],
)
def test_database_url_normalisation(given: str, expected: str) -> None:
    assert normalize_database_url(given) == expected


def test_production_refuses_default_secret() -> None:
    with pytest.raises(ValidationError, match="KVCHAT_SECRET_KEY must be set"):
        Settings(env=Environment.PRODUCTION)
    with pytest.raises(ValidationError, match="KVCHAT_ENV=test"):
        Settings(env=Environment.TEST)
    assert Settings(env=Environment.PRODUCTION, secret_key="s3cret").secret_key == "s3cret"
    with pytest.raises(ValidationError, match="KVCHAT_SECRET_KEY must be set"):
        Settings(env=Environment.PRODUCTION, secret_key=DEV_SECRET)  # the old development value is no secret
    assert Settings(env=Environment.DEVELOPMENT).secret_key is None  # a generated one is kept in data_dir


def test_bad_port_is_rejected() -> None:
    with pytest.raises(ValidationError):
        Settings(port=70000)


def test_the_commit_delay_test_hook_is_refused_in_production() -> None:
    with pytest.raises(ValidationError, match="test hook"):
        Settings(env="production", secret_key="s" * 32, test_commit_delay_seconds=1.0)
    assert Settings(env="test", secret_key="s" * 32, test_commit_delay_seconds=1.0).test_commit_delay_seconds == 1.0


def test_the_cache_folder_is_one_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_CACHE_DIR", "/srv/kvchat-cache")
    settings = Settings()
    assert settings.resolved_cache_dir == "/srv/kvchat-cache"
    assert settings.engine_config().cache_dir == "/srv/kvchat-cache"
    assert settings.deprecated_settings() == []


def test_the_old_model_cache_variable_is_read_with_a_deprecation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCHAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("KVCHAT_MODEL_CACHE_DIR", "/srv/old-cache")
    settings = Settings()
    assert settings.engine_config().cache_dir == "/srv/old-cache"
    assert settings.deprecated_settings() == [
        "KVCHAT_MODEL_CACHE_DIR is deprecated and will be removed in the next release: it is read as "
        "KVCHAT_CACHE_DIR (models and kernels, for every command); set that instead"
    ]


def test_with_both_cache_variables_the_new_one_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCHAT_CACHE_DIR", "/srv/new")
    monkeypatch.setenv("KVCHAT_MODEL_CACHE_DIR", "/srv/old")
    settings = Settings()
    assert settings.resolved_cache_dir == "/srv/new"
    assert settings.deprecated_settings() == [
        "KVCHAT_MODEL_CACHE_DIR is deprecated and ignored: KVCHAT_CACHE_DIR is set and holds every cache"
    ]


def test_the_engine_mode_follows_the_engine_url_unless_it_is_set(tmp_path: Path) -> None:
    assert Settings().resolved_engine_mode == "inproc"
    assert Settings(engine_url="http://router:8200").resolved_engine_mode == "remote"
    process = Settings(engine_mode="process", data_dir=tmp_path)
    assert process.resolved_engine_mode == "process"
    assert process.resolved_engine_process_dir == tmp_path / "engine"
    with pytest.raises(ValidationError, match="KVCHAT_ENGINE_MODE=remote needs KVCHAT_ENGINE_URL"):
        Settings(engine_mode="remote")
