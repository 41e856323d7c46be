"""The tool format comes from the chat template."""

from __future__ import annotations

import pytest

from backend.tools.family import detect_family
from backend.tools.types import ToolFamily
from engine.testing import FAMILIES


@pytest.mark.parametrize(
    ("template", "family"),
    [
        ("{{- '<tool_call>\\n' }}", ToolFamily.HERMES),
        ("{%- if message.role == 'ipython' %}<|python_tag|>{% endif %}", ToolFamily.LLAMA3_JSON),
        (FAMILIES["smollm2"].template, ToolFamily.HERMES),  # no tools in the template: the fallback
        (None, ToolFamily.HERMES),
    ],
    ids=["qwen", "llama3.1", "smollm2", "none"],
)
def test_the_family_is_read_from_the_template(template: str | None, family: ToolFamily) -> None:
    assert detect_family(template) is family
