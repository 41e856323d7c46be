"""docs/configuration.md is the settings class written out: same fields, same defaults, same descriptions."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import Field
from pydantic_settings import BaseSettings

from backend.core import config_doc
from backend.core.config import Settings


def test_the_committed_page_matches_the_settings_class() -> None:
    assert config_doc.DOC_PATH.read_text(encoding="utf-8") == config_doc.render()


def test_every_setting_has_one_row_with_its_variable() -> None:
    rows = [line for line in config_doc.render().splitlines() if line.startswith("| `KVCHAT_")]
    assert [row.split("`")[1] for row in rows] == [f"KVCHAT_{name.upper()}" for name in Settings.model_fields]


def test_defaults_are_written_as_an_operator_types_them() -> None:
    page = config_doc.render()
    assert "| `KVCHAT_PORT` | `8000` |" in page
    assert "| `KVCHAT_KV_DISK_CACHE` | `true` |" in page
    assert "| `KVCHAT_KV_DISK_TTL_S` | `604800` |" in page
    assert "| `KVCHAT_SECRET_KEY` | unset |" in page
    assert '| `KVCHAT_ALLOWED_ORIGINS` | `["*"]` |' in page


def test_a_field_without_a_description_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class Undocumented(BaseSettings):
        documented: int = Field(default=1, description="yes")
        hidden: int = 2

    monkeypatch.setattr(config_doc, "Settings", Undocumented)
    with pytest.raises(config_doc.MissingDescriptionError, match=r"^Settings.hidden has no description$"):
        config_doc.render()


def test_check_fails_on_a_stale_page(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text("# Configuration\n", encoding="utf-8")
    monkeypatch.setattr(config_doc, "DOC_PATH", stale)
    assert config_doc.main(["--check"]) == 1
    assert "is out of date" in capsys.readouterr().err
    assert config_doc.main([]) == 0
    assert config_doc.main(["--check"]) == 0
