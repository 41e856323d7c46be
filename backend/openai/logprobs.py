"""Tokens' log-probabilities in OpenAI's shape: ``{"token", "logprob", "bytes", "top_logprobs": [...]}``.

The values are the engine's: the model's raw log-probabilities, before penalties, bias, grammar or temperature
(vLLM's default). A token's text is its own decode (a piece of a multi-byte character decodes to U+FFFD, as in
vLLM); ``bytes`` is that text's UTF-8.
"""

from __future__ import annotations

import math

from backend.engine_client.protocol import TextTokenizer
from backend.engine_client.values import TokenLogprob
from backend.openai import schemas as s

# NOTE: JSON has no -Infinity; OpenAI reports a token too unlikely to matter as -9999.0.
FLOOR = -9999.0


class TokenTexts:
    """Token ids → their text, decoded one id at a time and remembered (a vocabulary holds at most a few 100k)."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._hf = tokenizer.hf
        self._texts: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = str(self._hf.decode([token_id], skip_special_tokens=False))
        return text

    def entry(self, logprob: TokenLogprob) -> s.TokenLogprobOut:
        token = self.text(logprob.token_id)
        top = [self._top(t, v) for t, v in logprob.top]
        return s.TokenLogprobOut(token=token, logprob=_finite(logprob.logprob), bytes=_bytes(token), top_logprobs=top)

    def _top(self, token_id: int, value: float) -> s.TopLogprob:
        token = self.text(token_id)
        return s.TopLogprob(token=token, logprob=_finite(value), bytes=_bytes(token))


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", "surrogatepass"))
