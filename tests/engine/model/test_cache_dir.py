"""One cache folder for models and kernels: ``KVCHAT_CACHE_DIR``; the old ``KVCHAT_MODEL_CACHE_DIR`` for one release."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from engine.model import build, loader


@pytest.fixture(autouse=True)
def _fresh_warning() -> None:
    loader._warn_model_cache_dir_once.cache_clear()


def test_the_cache_dir_variable_holds_models_and_kernels(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KVCHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("KVCHAT_MODEL_CACHE_DIR", str(tmp_path / "ignored"))
    build.use_cache_dir(None)
    assert loader.default_cache_dir() == tmp_path
    assert build.cache_dir() == tmp_path


def test_the_old_variable_is_read_once_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("KVCHAT_CACHE_DIR", raising=False)
    monkeypatch.setenv("KVCHAT_MODEL_CACHE_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="engine.model.loader"):
        assert loader.default_cache_dir() == tmp_path
        assert loader.default_cache_dir() == tmp_path
    assert [r.getMessage() for r in caplog.records] == [
        "KVCHAT_MODEL_CACHE_DIR is deprecated and will be removed in the next release: it is read as "
        "KVCHAT_CACHE_DIR (models and kernels, for every command); set that instead"
    ]


def test_unset_is_the_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVCHAT_CACHE_DIR", raising=False)
    monkeypatch.delenv("KVCHAT_MODEL_CACHE_DIR", raising=False)
    assert loader.default_cache_dir() == Path.home() / ".cache" / "kvchat"
