"""A prompt far over the model's context is refused after a count that leaves the GIL free, before the full encoding
that would hold it.

NOTE: why (issue 28, ``/livez`` spikes). The tokenizer's Rust encoder runs without the GIL, but the full encoding of a
prompt then turns every token's id and offsets into Python lists and labels each token with its segment: for a 0.6 MB
bracket string (300,000 to 600,000 tokens) that holds the GIL for 50-230 ms at a stretch, and the event loop, with
every socket and ``/livez``, waits that long. The length-only floor (``prompt_token_floor``) lets such a prompt
through, as one vocabulary entry may stand for 81 characters. Counting the message contents with the encoder alone
builds no lists: a prompt that cannot fit is refused after a count that never held the GIL for long.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from backend.engine_client.protocol import EngineClient

# NOTE: the chat template wraps each message's content in its own tokens; at a content's edges a token may merge with
# the template's text, so the template can take at most a few of the content's tokens: this many is generous.
MARGIN_PER_MESSAGE = 8
_MAX_BYTES_PER_CHAR = 4  # a token stands for one byte at least, a character for four at most (UTF-8)


def counted_floor(engine: EngineClient, texts: Sequence[str]) -> int | None:
    """A lower bound of the tokens the chat-templated ``texts`` encode to, counted by the encoder without building a
    Python list; None when it cannot exceed the model's limit by its length, or the tokenizer has no batch encoder."""
    if sum(len(t) for t in texts) * _MAX_BYTES_PER_CHAR <= engine.prompt_limit:
        return None
    encoder: Any = getattr(engine.tokenizer.hf, "backend_tokenizer", None)  # (a transformers fast tokenizer)
    if encoder is None:
        return None
    encodings = encoder.encode_batch(list(texts), add_special_tokens=False)  # NOTE: Rust, with the GIL released
    return max(0, sum(len(e) for e in encodings) - MARGIN_PER_MESSAGE * len(texts))
