"""Structured output: a request's grammar as a token mask, with llguidance.

Why llguidance (``bench/grammar_libs.py``, ``docs/benchmarks/grammar_libs.json``): on this CPU it computes a mask
in tens of microseconds per token on SmolLM2's 49k vocabulary with no per-schema precompilation (a new JSON schema
is ready in milliseconds), it reads Lark grammars with embedded JSON schemas (what tool-call formats need), and it
is one 8 MB wheel with no dependencies. xgrammar's masks are faster once a schema is compiled but it pulls in
triton (1 GB); outlines-core precompiles each schema into a vocabulary-wide index (hundreds of milliseconds).

``GrammarCompiler`` is made once per engine around the tokenizer; its token table (about a second for a 49k
vocabulary) is built at the first grammar request, not at load. ``compile`` turns a ``StructuredOutput`` into a
``GrammarMatcher``, the per-request state the sampler masks with and advances with each sampled token.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from engine.errors import InvalidSamplingParamsError
from engine.sampling_params import GrammarKind, StructuredOutput

# NOTE: JSON on one line with json.dumps's separators: what models were trained to write, and no run of whitespace
# for a small model to loop in (llguidance's flexible whitespace lets a model emit newlines for ever).
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Compiles grammars for one tokenizer (thread-safe: requests are registered from any thread)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf = hf_tokenizer
        self._vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _ll_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self._vocab_size, eos_token=self._eos)
            return self._tokenizer

    def compile(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher for ``spec``; raises ``InvalidSamplingParamsError`` with llguidance's reason."""
        import llguidance

        tokenizer = self._ll_tokenizer()
        try:
            if spec.kind is GrammarKind.LARK:
                grammar = llguidance.LLMatcher.grammar_from_lark(spec.spec)
            else:
                schema: Any = {"type": "object"} if spec.kind is GrammarKind.JSON_OBJECT else json.loads(spec.spec)
                grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            error = matcher.get_error() if matcher.is_error() else ""
        except (ValueError, TypeError, RuntimeError) as exc:  # NOTE: llguidance reports most errors via is_error()
            error = str(exc)
        if error:
            reason = error.strip().splitlines()[0] if error.strip() else "unknown error"
            raise InvalidSamplingParamsError(f"the {spec.kind.value} grammar cannot be used: {reason}")
        return GrammarMatcher(matcher, self._vocab_size)


class GrammarMatcher:
    """One request's position in its grammar."""

    __slots__ = ("_matcher", "_vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size

    def allowed(self) -> torch.Tensor:
        """A bool tensor over the vocabulary: the tokens the grammar allows next (EOS only once it is complete)."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return torch.from_numpy(np.unpackbits(bits, bitorder="little")[: self._vocab_size].astype(np.bool_))

    def apply(self, row: torch.Tensor) -> bool:
        """Mask the disallowed tokens of ``row`` to -inf in place; False when the grammar allows no token at all."""
        allowed = self.allowed()
        if not bool(allowed.any()):
            return False
        row.masked_fill_(~allowed.to(row.device), float("-inf"))
        return True

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token (one the mask allowed, so the grammar accepts it)."""
        self._matcher.consume_token(token_id)

    @property
    def is_error(self) -> bool:
        return bool(self._matcher.is_error())
