"""Semantic blocks: the typed pieces a message is split into, and their identity inside a session."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum


class BlockType(StrEnum):
    """What a block is; the context builder keeps, drops and pins by type."""

    QUESTION = "question"
    STEP = "step"
    SECTION = "section"
    CLAUSE_REFERENCE = "clause_reference"
    IDENTIFIER = "identifier"
    CODE = "code"
    HANDOFF = "handoff"  # the customer asks for a human agent (``acts.HANDOFF``)
    GREETING = "greeting"  # a sentence that only greets (``acts.GREETING``)
    CONTEXT = "context"  # the fallback: text no rule claimed


@dataclass(frozen=True, slots=True, order=True)
class BlockKey:
    """Where a block lives in its session: the message's ``seq`` and the block's index inside that message."""

    seq: int
    index: int


@dataclass(frozen=True, slots=True)
class Block:
    """One block of one message. ``text`` is ``message[start:end]``; ``parent`` is the block it refers back to."""

    key: BlockKey
    type: BlockType
    start: int
    end: int
    text: str
    token_count: int
    content_hash: str
    epoch: int
    parent: BlockKey | None = None

    @property
    def index(self) -> int:
        return self.key.index


def content_hash(text: str) -> str:
    """sha256 of the block's text (hex): equal text, equal hash, whatever message it came from."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
