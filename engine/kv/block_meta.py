"""Semantic labels of token positions, and what one cached block covers.

The backend splits a prompt into typed segments (``engine.prompt``); the tokenizer turns them into ``TokenSpan``s over
token positions. A ``SpanMap`` answers, for any range of positions, how many tokens of each block type it holds and
which semantic block ids it touches; a published block keeps that answer as its ``BlockMeta``.

Block types are plain strings: the engine does not know the backend's enum, only a few labels of its own.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

TEMPLATE = "template"  # chat-template tokens: role markers, the generation prompt
UNTYPED = "untyped"  # a prompt given as a string or token ids (no segments)
GENERATED = "generated"  # tokens the model sampled (a reply that stays in a session's chain)


@dataclass(frozen=True, slots=True)
class TokenSpan:
    """Token positions ``start .. end - 1`` belong to one semantic block of ``block_type``."""

    start: int
    end: int
    block_type: str
    block_id: int | None = None
    parent_id: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"bad span [{self.start}, {self.end})")


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """Tokens per block type (sorted by type) and the semantic block ids one cached block covers."""

    type_tokens: tuple[tuple[str, int], ...] = ()
    block_ids: frozenset[int] = frozenset()

    @property
    def block_types(self) -> frozenset[str]:
        return frozenset(t for t, _ in self.type_tokens)


class SpanMap:
    """Sorted, non-overlapping spans; positions no span covers count as ``fill``."""

    def __init__(self, spans: Sequence[TokenSpan] = (), fill: str = UNTYPED) -> None:
        self.spans = tuple(sorted(spans, key=lambda s: s.start))
        for a, b in zip(self.spans, self.spans[1:], strict=False):
            if b.start < a.end:
                raise ValueError(f"overlapping spans {a} and {b}")
        self.fill = fill
        self._starts = [s.start for s in self.spans]

    def tokens_by_type(self, start: int, end: int) -> dict[str, int]:
        """How many of the positions ``start .. end - 1`` carry each block type."""
        counts: Counter[str] = Counter()
        covered = 0
        for span in self._overlapping(start, end):
            n = min(end, span.end) - max(start, span.start)
            counts[span.block_type] += n
            covered += n
        if end - start > covered:
            counts[self.fill] += end - start - covered
        return dict(counts)

    def block_meta(self, start: int, end: int) -> BlockMeta:
        ids = frozenset(s.block_id for s in self._overlapping(start, end) if s.block_id is not None)
        return BlockMeta(tuple(sorted(self.tokens_by_type(start, end).items())), ids)

    def _overlapping(self, start: int, end: int) -> list[TokenSpan]:
        i = max(0, bisect.bisect_right(self._starts, start) - 1)
        out = []
        for span in self.spans[i:]:
            if span.start >= end:
                break
            if span.end > start and span.end > span.start:
                out.append(span)
        return out
