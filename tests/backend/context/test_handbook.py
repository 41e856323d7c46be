"""Handbook parsing and limits (pure): Markdown sections per heading, ABCD-style JSON per subflow, clear errors."""

from __future__ import annotations

import json

import pytest

from backend.context.errors import HandbookError, HandbookLimitError
from backend.context.handbook import (
    HandbookFormat,
    HandbookLimits,
    Section,
    check,
    parse,
    parse_abcd,
    parse_markdown,
)

MD = """Welcome text before any heading.

# Returns
Return within 30 days.

## Damaged items
Send a photo.
```
# not a heading inside a fence
```
# Empty

# Shipping ###
Ships in 3 days.
"""


def test_markdown_has_a_section_per_heading_and_skips_empty_ones() -> None:
    sections = parse_markdown(MD)
    assert [s.title for s in sections] == ["Overview", "Returns", "Damaged items", "Shipping"]
    assert sections[1].text == "Return within 30 days."
    assert sections[2].text == "Send a photo.\n```\n# not a heading inside a fence\n```"
    assert sections[3].rendered() == "Handbook: Shipping\nShips in 3 days."


def test_abcd_json_has_a_section_per_subflow_with_numbered_actions() -> None:
    body = {
        "Product Defect": {
            "description": "refunds and returns",
            "subflows": {
                "Initiate Refund": {
                    "instructions": ["Ask for the reason.", "Wrap up nicely."],
                    "actions": [{"text": "Pull up  the account", "subtext": ["Name", ""]}, {"text": "Offer refund"}],
                }
            },
        }
    }
    (section,) = parse_abcd(body)
    assert section.title == "Product Defect: Initiate Refund"
    assert section.text == (
        "Covers: refunds and returns.\nAsk for the reason.\n1. Pull up the account\n   - Name\n2. Offer refund\n"
        "Wrap up nicely."
    )
    assert parse(json.dumps(body), HandbookFormat.ABCD) == [section]


@pytest.mark.parametrize(
    ("content", "fmt", "message"),
    [
        ("{not json", HandbookFormat.ABCD, "the handbook is not valid JSON: Expecting property name"),
        ("[1, 2]", HandbookFormat.ABCD, "an ABCD handbook is a JSON object of flows"),
        ('{"F": {"subflows": 3}}', HandbookFormat.ABCD, "flow 'F': expected an object with 'subflows'"),
        ('{"F": {"subflows": {"S": {"actions": 1}}}}', HandbookFormat.ABCD, "F: S: 'actions' must be a list"),
        ("   \n", HandbookFormat.MARKDOWN, "the handbook has no sections"),
    ],
)
def test_a_handbook_that_does_not_parse_says_why(content: str, fmt: HandbookFormat, message: str) -> None:
    with pytest.raises(HandbookError, match=message):
        parse(content, fmt)


def test_limits_name_the_cap_and_the_section() -> None:
    limits = HandbookLimits(max_sections=2, max_section_chars=10, max_total_chars=15, max_title_chars=5)
    check([Section("a", "x" * 10)], limits)
    with pytest.raises(HandbookLimitError, match="3 sections: at most 2"):
        check([Section(t, "x") for t in "abc"], limits)
    with pytest.raises(HandbookLimitError, match="section 'a' has 11 characters, over 10: split it"):
        check([Section("a", "x" * 11)], limits)
    with pytest.raises(HandbookLimitError, match="the handbook has 20 characters, over 15"):
        check([Section("a", "x" * 10), Section("b", "x" * 10)], limits)
    with pytest.raises(HandbookLimitError, match="section 1: its title has 6 characters, over 5"):
        check([Section("abcdef", "x")], limits)
    with pytest.raises(HandbookError, match="the title 'a' is used twice"):
        check([Section("a", "x"), Section("a", "y")], limits)


def test_the_content_hash_changes_with_title_or_text_only() -> None:
    assert Section("a", "x").content_hash == Section("a", "x").content_hash
    assert len({Section("a", "x").content_hash, Section("b", "x").content_hash, Section("a", "y").content_hash}) == 3
