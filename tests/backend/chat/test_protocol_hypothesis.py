"""The websocket envelope parser under hostile input (issue 20): whatever text a client sends, ``parse_client_frame``
returns a frame or an ``ErrorFrame`` with a stable code, never raises, and never lets through a value the database or
the tokenizer cannot take (NUL, lone surrogates, numbers outside the columns, lax types)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from backend.chat.protocol import Cancel, ErrorFrame, Hello, Ping, UserMessage, parse_client_frame

STABLE_CODES = {"bad_json", "invalid_frame", "unknown_type"}
FRAME_TYPES = ("hello", "user.message", "cancel", "ping")
FIELDS = ("type", "token", "session_id", "last_seq", "external_ref", "client_msg_id", "text", "nonce")
INT32_MAX = 2**31 - 1

# Every code point, lone surrogates included (a JSON "\ud800" escape decodes to one); st.characters() leaves them out.
ANY_CHAR = st.characters() | st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF) | st.just("\x00")
ANY_TEXT = st.text(ANY_CHAR, max_size=30)
SAFE_CHAR = st.characters(codec="utf-8", exclude_characters="\x00")  # (utf-8 has no lone surrogates)
JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4),
    max_leaves=12,
)
# Objects shaped like frames: a known or odd type, and known field names holding any JSON value.
FRAME_LIKE = st.fixed_dictionaries(
    {"type": st.sampled_from(FRAME_TYPES) | ANY_TEXT | JSON_VALUES},
    optional={name: JSON_VALUES for name in FIELDS[1:]},
)

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _storable(value: str) -> bool:
    return "\x00" not in value and not any(0xD800 <= ord(c) <= 0xDFFF for c in value)


def _check_result(result: object, raw: Any) -> None:
    """The property: a typed frame whose values are exactly what was sent, or a refusal that can go on the wire."""
    if isinstance(result, ErrorFrame):
        assert result.code in STABLE_CODES, result
        result.model_dump_json()  # the refusal itself must be sendable (no lone surrogate echoed back)
        assert _storable(result.message), result.message
        return
    assert isinstance(result, (Hello, UserMessage, Cancel, Ping)), type(result)
    assert isinstance(raw, dict)
    for key, sent in raw.items():
        kept = getattr(result, key)
        # Strict: no coercion ("5" → 5, true → 1, 1.0 → 1), so the value and its type are what the client sent.
        assert (kept, type(kept)) == (sent, type(sent)), (key, sent, kept)
        if isinstance(kept, str):
            assert _storable(kept), (key, kept)
    if isinstance(result, Hello):
        assert 0 <= result.last_seq <= INT32_MAX


@SETTINGS
@given(st.text(ANY_CHAR, max_size=200))
@example("")
@example("{")
@example("[" * 100_000)
@example("\ud800")  # a lone surrogate in the text itself (not reachable over a socket, but a str can hold it)
def test_any_text_gets_a_frame_or_a_stable_refusal(text: str) -> None:
    result = parse_client_frame(text)
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError):
        assert isinstance(result, ErrorFrame) and result.code == "bad_json", result
        return
    _check_result(result, raw)


@SETTINGS
@given(JSON_VALUES)
def test_any_json_value_gets_a_frame_or_a_stable_refusal(value: Any) -> None:
    result = parse_client_frame(json.dumps(value))
    _check_result(result, value)
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        assert isinstance(result, ErrorFrame) and result.code == "invalid_frame", result


@SETTINGS
@given(FRAME_LIKE)
def test_frame_shaped_objects_get_a_frame_or_a_stable_refusal(value: dict[str, Any]) -> None:
    result = parse_client_frame(json.dumps(value))
    _check_result(result, value)
    if isinstance(value["type"], str) and value["type"] not in FRAME_TYPES:
        assert isinstance(result, ErrorFrame) and result.code == "unknown_type", result


SAFE_ID = st.text(SAFE_CHAR, min_size=1, max_size=64)
VALID_FRAMES = st.one_of(
    st.fixed_dictionaries(
        {"type": st.just("hello"), "token": st.text(SAFE_CHAR, min_size=1, max_size=512)},
        optional={
            "session_id": SAFE_ID,
            "last_seq": st.integers(0, INT32_MAX),
            "external_ref": st.text(SAFE_CHAR, max_size=200),
        },
    ),
    st.fixed_dictionaries(
        {
            "type": st.just("user.message"),
            "client_msg_id": st.text(SAFE_CHAR, min_size=1, max_size=100),
            "text": st.text(SAFE_CHAR, max_size=50).filter(lambda s: s.strip() != ""),
        }
    ),
    st.fixed_dictionaries({"type": st.just("cancel")}, optional={"client_msg_id": SAFE_ID}),
    st.fixed_dictionaries({"type": st.just("ping")}, optional={"nonce": st.text(SAFE_CHAR, max_size=100)}),
)


@SETTINGS
@given(VALID_FRAMES, st.booleans())
def test_valid_frames_are_accepted_exactly(value: dict[str, Any], ascii_only: bool) -> None:
    result = parse_client_frame(json.dumps(value, ensure_ascii=ascii_only))
    assert not isinstance(result, ErrorFrame), (value, result)
    assert result.type == value["type"]
    _check_result(result, value)


# ---------------------------------------------------------------- the hostile classes of issue 20, one by one


def _frame(**fields: Any) -> str:
    return json.dumps(fields)


HELLO = {"type": "hello", "token": "t"}
MESSAGE = {"type": "user.message", "client_msg_id": "m1", "text": "hi"}
# Where a string field lives: the frame it belongs to, filled in with valid values for the other fields.
STRING_FIELDS = [
    ("hello", "token", HELLO),
    ("hello", "session_id", HELLO),
    ("hello", "external_ref", HELLO),
    ("user.message", "client_msg_id", MESSAGE),
    ("user.message", "text", MESSAGE),
    ("cancel", "client_msg_id", {"type": "cancel"}),
    ("ping", "nonce", {"type": "ping"}),
]
HOSTILE_STRINGS = {
    "nul": "abc\x00def",
    "only-nul": "\x00",
    "lone-high-surrogate": "abc\ud800",
    "lone-low-surrogate": "\udfffabc",
    "reversed-pair": "\udc00\ud800",
}


@pytest.mark.parametrize("bad", HOSTILE_STRINGS.values(), ids=HOSTILE_STRINGS.keys())
@pytest.mark.parametrize(("kind", "field", "base"), STRING_FIELDS, ids=[f"{k}.{f}" for k, f, _ in STRING_FIELDS])
def test_unstorable_strings_are_refused_in_every_field(kind: str, field: str, base: dict[str, Any], bad: str) -> None:
    for ascii_only in (True, False):  # "\ud800" escaped (as browsers send it) and raw (ensure_ascii=False)
        text = json.dumps({**base, field: bad}, ensure_ascii=ascii_only)
        result = parse_client_frame(text)
        assert isinstance(result, ErrorFrame), (field, bad, result)
        assert result.code == "invalid_frame"
        assert result.message.startswith(f"{kind}: {field}"), result.message
        result.model_dump_json()


def test_a_proper_surrogate_pair_is_text_not_a_lone_surrogate() -> None:
    result = parse_client_frame('{"type": "user.message", "client_msg_id": "m1", "text": "ok \\ud83d\\ude00"}')
    assert result == UserMessage(type="user.message", client_msg_id="m1", text="ok \U0001f600")


@pytest.mark.parametrize(
    "last_seq",
    [2**31, 2**63 - 1, 2**63, 2**64, 10**30, -1, -(2**63) - 1, "5", True, False, 1.0, "yes", None, [1], {"a": 1}],
    ids=repr,
)
def test_out_of_range_and_lax_numbers_are_refused(last_seq: object) -> None:
    result = parse_client_frame(_frame(**HELLO, last_seq=last_seq))
    assert isinstance(result, ErrorFrame), result
    assert (result.code, result.message.split(":")[:2]) == ("invalid_frame", ["hello", " last_seq"])


def test_the_largest_seq_is_accepted() -> None:
    assert parse_client_frame(_frame(**HELLO, last_seq=INT32_MAX)) == Hello(type="hello", token="t", last_seq=INT32_MAX)


@pytest.mark.parametrize("depth", [1_000, 10_000, 100_000])
@pytest.mark.parametrize("opening", ["[", "{"])
def test_deep_nesting_is_bad_json_without_recursing(depth: int, opening: str) -> None:
    nested = "[" * depth + "]" * depth if opening == "[" else '{"a":' * depth + "1" + "}" * depth
    for text in (nested, '{"type": "ping", "nonce": ' + nested + "}"):
        result = parse_client_frame(text)
        assert isinstance(result, ErrorFrame), result
        assert result.code == "bad_json"


def test_brackets_inside_strings_do_not_count_as_nesting() -> None:
    text = _frame(type="user.message", client_msg_id="m1", text="[" * 5_000 + "{" * 5_000)
    assert parse_client_frame(text) == UserMessage(
        type="user.message", client_msg_id="m1", text="[" * 5_000 + "{" * 5_000
    )


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("not json", "bad_json"),
        ('{"type": "ping"', "bad_json"),
        ("[]", "invalid_frame"),
        ("5", "invalid_frame"),
        ('"hello"', "invalid_frame"),
        ("null", "invalid_frame"),
        ('{"token": "t"}', "invalid_frame"),
        ('{"type": 5}', "invalid_frame"),
        ('{"type": null}', "invalid_frame"),
        ('{"type": "ping", "extra": 1}', "invalid_frame"),
        ('{"type": "user.message", "client_msg_id": "m1", "text": "   "}', "invalid_frame"),
        ('{"type": "hello", "token": ""}', "invalid_frame"),
        ('{"type": "hello", "token": "t", "session_id": "' + "s" * 65 + '"}', "invalid_frame"),
        ('{"type": "nope"}', "unknown_type"),
        ('{"type": "hello\\u0000"}', "unknown_type"),
        ('{"type": "\\ud800"}', "unknown_type"),
    ],
)
def test_malformed_frames_get_their_stable_code(text: str, code: str) -> None:
    result = parse_client_frame(text)
    assert isinstance(result, ErrorFrame), result
    assert result.code == code, result
    result.model_dump_json()
