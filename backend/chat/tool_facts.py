"""The looked-up data a tool turn's reply carries, whatever the model wrote.

A small model's answer after reading a tool's result cannot be relied on: SmolLM2-135M, given an order that has
shipped, answered that it "has not been shipped yet". So after the answer, the results' own values are added as one
``Details:`` line, word for word: what the customer reads always carries the looked-up data exactly (the model's
wording may still be wrong; the line is the lookup's). The values are the results' strings and numbers (nested keys
joined by spaces, ``_`` read as a space; booleans and nulls are left out), at most ``MAX_FACTS`` of them, each at
most ``MAX_VALUE_CHARS`` long.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

MAX_FACTS = 8
MAX_VALUE_CHARS = 200
DETAILS = "Details: "


def facts(result: str) -> list[tuple[str, str]]:
    """``(key path, value)`` for each string or number of a tool's JSON ``result``, in order (at most MAX_FACTS)."""
    found: list[tuple[str, str]] = []
    _walk(json.loads(result), "", found)
    return found[:MAX_FACTS]


def details_line(results: Sequence[str]) -> str:
    """``Details: key: value; ...`` for the facts of ``results`` ("" when they hold none)."""
    found = [fact for r in results for fact in facts(r)][:MAX_FACTS]
    if not found:
        return ""
    return DETAILS + "; ".join(f"{key}: {value}" if key else value for key, value in found) + "."


def _walk(value: object, path: str, found: list[tuple[str, str]]) -> None:
    if len(found) >= MAX_FACTS:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            _walk(item, f"{path} {str(key).replace('_', ' ')}".strip(), found)
    elif isinstance(value, list):
        for item in value:
            _walk(item, path, found)
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        text = str(value).strip()
        if text and len(text) <= MAX_VALUE_CHARS:
            found.append((path, text))
