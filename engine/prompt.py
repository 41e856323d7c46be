"""A typed prompt the backend hands the engine: chat messages whose content is made of labelled segments.

The backend's context builder splits the conversation into semantic blocks (a policy paragraph, a customer fact, a
question); each becomes a ``Segment`` with its block type (a plain string: the engine does not know the backend's
enum), the backend's block id and the id of the block it refers back to. The engine renders the messages with the
model's chat template exactly as it renders the same plain messages (same token ids, so the prefix cache is shared
with plain prompts) and maps every token to the segment it came from: ``TokenizedPrompt.spans``. Template tokens (role
markers, the generation prompt) are labelled ``TEMPLATE``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine.errors import InvalidRequestError
from engine.kv.block_meta import TEMPLATE, TokenSpan

__all__ = [
    "TEMPLATE",
    "Segment",
    "SegmentedMessage",
    "SegmentedPrompt",
    "TokenizedPrompt",
    "common_prefix",
    "spans_from_owners",
]


@dataclass(frozen=True, slots=True)
class Segment:
    text: str
    block_type: str
    block_id: int | None = None
    parent_id: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise InvalidRequestError(f"segment text must be a string, got {type(self.text).__name__}")
        if not isinstance(self.block_type, str) or not self.block_type:
            raise InvalidRequestError(f"segment block_type must be a non-empty string, got {self.block_type!r}")
        for name in ("block_id", "parent_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise InvalidRequestError(f"segment {name} must be an integer or None, got {value!r}")


@dataclass(frozen=True, slots=True)
class SegmentedMessage:
    role: str
    segments: tuple[Segment, ...]

    @property
    def content(self) -> str:
        return "".join(s.text for s in self.segments)


@dataclass(frozen=True, slots=True)
class SegmentedPrompt:
    """Chat messages made of segments; renders to the same ids as ``as_messages()`` given as a plain prompt."""

    messages: tuple[SegmentedMessage, ...]
    add_generation_prompt: bool = True

    @classmethod
    def of(cls, *messages: tuple[str, Sequence[Segment]], add_generation_prompt: bool = True) -> SegmentedPrompt:
        """``SegmentedPrompt.of(("system", [Segment(...), ...]), ("user", [...]))``."""
        return cls(tuple(SegmentedMessage(role, tuple(segs)) for role, segs in messages), add_generation_prompt)

    @property
    def segments(self) -> list[Segment]:
        """Every segment, in conversation order (the numbering the tokenizer's owners use)."""
        return [s for m in self.messages for s in m.segments]

    def as_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True, slots=True)
class TokenizedPrompt:
    """Token ids plus the spans that label them (empty for a prompt given without segments), and how many leading
    ids are the chat's system message(s) (0 for a prompt given as a string or ids): what every conversation of a
    deployment starts with, so a closed session's release keeps them cached."""

    token_ids: list[int]
    spans: tuple[TokenSpan, ...] = ()
    system_tokens: int = 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading token ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    if tuple(a[:n]) == tuple(b[:n]):  # (the usual case for prompts that extend each other: compared in C)
        return n
    return next(i for i in range(n) if a[i] != b[i])


def spans_from_owners(owners: Sequence[int], segments: Sequence[Segment]) -> tuple[TokenSpan, ...]:
    """Runs of tokens with one owner (a segment number, or a negative number for the template) as ``TokenSpan``s."""
    spans: list[TokenSpan] = []
    start = 0
    for i in range(1, len(owners) + 1):
        if i < len(owners) and owners[i] == owners[start]:
            continue
        owner = owners[start]
        if owner < 0:
            spans.append(TokenSpan(start, i, TEMPLATE))
        else:
            seg = segments[owner]
            spans.append(TokenSpan(start, i, seg.block_type, seg.block_id, seg.parent_id))
        start = i
    return tuple(spans)
