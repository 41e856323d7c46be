"""The largest ``/v1/chat/completions`` body that can hold a request the model accepts: a larger one is refused from
its ``Content-Length`` (413) before a byte of it is read.

Why (issue 42): a 32 MiB body held the GIL for about 0.4 s while it was joined, parsed and validated (measured:
``json.loads`` 120 ms, pydantic 155 ms, under load), on the event loop or in a thread alike (these are C and Rust
calls that never let the GIL go), and ``/livez`` waited 2 s (p50) while such bodies came in back to back. Its prompt
could never fit anyway: every character of a message's text is part of some token, and the prompt holds at most
``prompt_limit`` tokens. So a body's useful size is bounded by ``prompt_limit`` times the most JSON bytes one token's
text can take, plus room for the fields that are not prompt text (``logit_bias`` over the whole vocabulary, a
``response_format`` schema, stop strings). Escapes are counted as JSON encoders write them (``json.dumps``,
``JSON.stringify``): a client that escapes every character as ``\\uXXXX`` needs up to six times the room, and may
be refused. With SmolLM2's vocabulary and an 8,192-token limit the bound is 1.7 MB.
"""

from __future__ import annotations

from collections.abc import Iterable

from backend.engine_client.protocol import EngineClient

NON_PROMPT_BYTES = 256 * 1024  # a response_format schema, stop strings, tool choice, the JSON around the messages
LOGIT_BIAS_BYTES_PER_ID = 16  # '"49151": -100.0, '
_ESCAPED_CONTROL = 6  # \u0001
_SHORT_ESCAPES = frozenset(b'"\\\b\f\n\r\t')
_NON_ASCII_PER_BYTE = 3  # json.dumps' ensure_ascii: \uXXXX (6) per 2- or 3-byte char, \uXXXX\uXXXX (12) per 4-byte


def max_body_bytes(pieces: Iterable[str], prompt_limit: int, vocab_size: int) -> int:
    """The bound for a vocabulary of ``pieces`` (the tokenizer's own spelling of each token)."""
    per_token = max((_piece_json_bytes(p) for p in pieces), default=_ESCAPED_CONTROL)
    return prompt_limit * per_token + vocab_size * LOGIT_BIAS_BYTES_PER_ID + NON_PROMPT_BYTES


def _byte_json_bytes(byte: int) -> int:
    """The most bytes one byte of UTF-8 text takes in a JSON string, as JSON encoders escape (\\n, \\", \\u0001)."""
    if byte in _SHORT_ESCAPES:
        return 2
    if byte < 0x20:
        return _ESCAPED_CONTROL
    return 1 if byte < 0x80 else _NON_ASCII_PER_BYTE


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spelling: each byte is one printable character (the byte itself when it is printable)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_alphabet()


def _piece_json_bytes(piece: str) -> int:
    """The most JSON bytes the text of one vocabulary piece takes: byte by byte for a byte-level piece; otherwise
    (SentencePiece and the like) as if each character were escaped, with room for a surrogate pair."""
    if all(c in _BYTE_LEVEL for c in piece):
        return sum(_byte_json_bytes(_BYTE_LEVEL[c]) for c in piece)
    return sum(1 if " " <= c <= "~" and c not in '"\\' else 12 for c in piece)


def for_engine(engine: EngineClient) -> int | None:
    """The bound for ``engine``'s tokenizer and prompt limit (about 0.1 s for a 49k vocabulary: call it off the
    loop); None when the tokenizer lists no vocabulary (then only ``KVCHAT_MAX_REQUEST_BYTES`` applies)."""
    get_vocab = getattr(engine.tokenizer.hf, "get_vocab", None)
    vocab: dict[str, int] = get_vocab() if callable(get_vocab) else {}
    if not vocab:
        return None
    return max_body_bytes(vocab, engine.prompt_limit, max(engine.info.vocab_size, len(vocab)))
