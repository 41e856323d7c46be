"""The shared input constraints: storable text, strict numbers, bounded JSON nesting."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, ValidationError

from backend.core.limits import (
    INT64_MAX,
    MAX_JSON_DEPTH,
    Identifier,
    NonNegativeInt64,
    QueryOffset,
    SafeText,
    json_too_deep,
    text_problem,
)


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("plain text, 中文, emoji 🙂", None),
        ("", None),
        ("a\x00b", "must not contain NUL characters"),
        ("\ud800", "must not contain lone UTF-16 surrogates"),
        ("ok \udfff tail", "must not contain lone UTF-16 surrogates"),
    ],
)
def test_text_problem(value: str, problem: str | None) -> None:
    assert text_problem(value) == problem


@pytest.mark.parametrize(
    ("text", "too_deep"),
    [
        ("[]", False),
        ("[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH, False),
        ("[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1), True),
        ('{"a":' * (MAX_JSON_DEPTH + 1) + "1" + "}" * (MAX_JSON_DEPTH + 1), True),
        ("[" * 100_000, True),  # unterminated: refused before any parser sees it
        (json.dumps({"text": "[" * 10_000}), False),  # brackets inside a string do not nest
        (json.dumps({"text": '\\"[[[' * 1000}), False),  # nor after escaped quotes
        ("[]" * 100_000, False),  # many siblings are shallow
    ],
)
def test_json_too_deep(text: str, too_deep: bool) -> None:
    assert json_too_deep(text) is too_deep
    assert json_too_deep(text.encode()) is too_deep


class _Body(BaseModel):
    name: Identifier
    text: SafeText
    count: NonNegativeInt64 = 0


@pytest.mark.parametrize(
    "body",
    [
        {"name": "a\x00", "text": "x"},
        {"name": "", "text": "x"},
        {"name": "n" * 101, "text": "x"},
        {"name": "n", "text": "\ud83d"},
        {"name": "n", "text": "x", "count": "5"},
        {"name": "n", "text": "x", "count": True},
        {"name": "n", "text": "x", "count": 5.0},
        {"name": "n", "text": "x", "count": INT64_MAX + 1},
        {"name": "n", "text": "x", "count": -1},
    ],
)
def test_hostile_fields_are_refused(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        _Body.model_validate(body)


def test_valid_fields_pass() -> None:
    assert _Body.model_validate({"name": "n", "text": "x 中", "count": INT64_MAX}).count == INT64_MAX


class _Query(BaseModel):
    offset: QueryOffset = 0


def test_query_numbers_parse_text_but_stay_in_int64() -> None:
    assert _Query.model_validate({"offset": "12"}).offset == 12
    with pytest.raises(ValidationError):
        _Query.model_validate({"offset": str(INT64_MAX + 1)})
