"""The Details line of a tool reply: the results' strings and numbers, word for word, in order, bounded."""

from __future__ import annotations

import json

from backend.chat.tool_facts import MAX_FACTS, MAX_VALUE_CHARS, details_line, facts
from support.tool_endpoint import ORDER


def test_the_line_lists_every_value_of_the_results() -> None:
    line = details_line([json.dumps(ORDER)])
    assert line == "Details: order id: A1234; status: shipped; carrier: DHL; eta: 2026-05-03."


def test_nested_keys_lists_and_numbers_are_read_booleans_and_nulls_are_not() -> None:
    result = {"order": {"total_eur": 12.5, "items": [{"sku": "X-1"}, {"sku": "Y-2"}]}, "gift": True, "note": None}
    assert facts(json.dumps(result)) == [
        ("order total eur", "12.5"),
        ("order items sku", "X-1"),
        ("order items sku", "Y-2"),
    ]
    assert details_line([json.dumps("in transit"), json.dumps([])]) == "Details: in transit."
    assert details_line([json.dumps({"ok": True})]) == ""


def test_the_line_is_bounded() -> None:
    many = {f"k{i}": i for i in range(MAX_FACTS + 5)} | {"long": "x" * (MAX_VALUE_CHARS + 1)}
    assert [key for key, _ in facts(json.dumps(many))] == [f"k{i}" for i in range(MAX_FACTS)]
    two = [json.dumps({f"a{i}": i for i in range(MAX_FACTS)}), json.dumps({"b": 1})]
    assert "b: 1" not in details_line(two)
