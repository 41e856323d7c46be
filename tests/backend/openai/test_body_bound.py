"""The largest useful ``/v1`` body: the prompt limit times the most JSON bytes one token's text takes, plus room for
the fields that are not prompt text."""

from __future__ import annotations

import json

from backend.openai.body_bound import LOGIT_BIAS_BYTES_PER_ID, NON_PROMPT_BYTES, max_body_bytes

EXTRA = NON_PROMPT_BYTES + 10 * LOGIT_BIAS_BYTES_PER_ID  # (a vocabulary of 10 ids)


def test_byte_level_pieces_count_each_byte_as_json_escapes_it() -> None:
    # GPT-2's byte-level spelling: "Ġ" is a space (1 byte in JSON), "Ċ" a newline (\n: 2), "ĉ" a tab (\t: 2),
    # "ā" the control byte 0x01 (\u0001: 6), "Ã©" the two bytes of "é" (\u00e9: 6, counted 3 a byte).
    assert max_body_bytes(["ĠĠĠĠ"], 100, 10) == 100 * 4 + EXTRA
    assert max_body_bytes(["Ċĉ", "ab"], 100, 10) == 100 * 4 + EXTRA
    assert max_body_bytes(["ā"], 100, 10) == 100 * 6 + EXTRA
    assert max_body_bytes(["Ã©", "x"], 100, 10) == 100 * 6 + EXTRA
    assert max_body_bytes(['"'], 100, 10) == 100 * 2 + EXTRA


def test_the_bound_holds_for_the_text_json_dumps_writes() -> None:
    pieces = ["Ġthe", "Ċ", "Ã©", "ā", "ĠĠ"]
    text = " the\n" + "é" + "\x01" + "  "  # (one of each piece: 5 tokens)
    body = json.dumps({"messages": [{"role": "user", "content": text}]})
    assert len(body.encode()) <= max_body_bytes(pieces, 5, 10)


def test_other_spellings_count_every_unusual_character_as_an_escaped_surrogate_pair() -> None:
    assert max_body_bytes(["▁hello"], 10, 10) == 10 * (12 + 5) + EXTRA
