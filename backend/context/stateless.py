"""Semantic blocks for stateless requests (the OpenAI-compatible API): each message split by the default rules.

A ``/v1`` request carries its whole conversation and no session, so there is no topic history, pinned context or
stored blocks to build from; the messages are sent as they came, but as a ``SegmentedPrompt`` whose segments carry
block types, so the engine's cache statistics by block type count ``/v1`` traffic too. The token ids are exactly those
of the plain messages (the segments cover each message's text), so nothing changes for the prefix cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache

from backend.context.blocks import Block
from backend.context.builder import HistoryMessage, message_segments
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.splitter import Splitter, word_count
from backend.domain import MessageRole
from backend.engine_client.values import SegmentedPrompt

_ROLES = {r.value for r in MessageRole}


@cache
def _default_splitter() -> Splitter:
    # NOTE: words stand in for tokens when short fragments are merged: tokenizing every fragment of a request twice
    # would cost more than the statistics are worth, and the split only labels the text, it never changes it.
    return Splitter(RuleSet.compile(DEFAULT_RULES), word_count)


def segment_messages(messages: Sequence[dict[str, str]]) -> SegmentedPrompt:
    """The messages as a ``SegmentedPrompt`` with a block type per segment (the same token ids as the plain ones)."""
    splitter = _default_splitter()
    history: list[Block] = []
    parts = []
    for seq, m in enumerate(messages, start=1):
        blocks = splitter.split(m["content"], seq=seq, epoch=0, history=history) if m["content"] else []
        history += blocks
        # NOTE: a role the store has no name for (Llama 3's ipython: a tool's result) is split like a user message.
        role = MessageRole(m["role"]) if m["role"] in _ROLES else MessageRole.USER
        message = HistoryMessage(seq, role, m["content"], 0, tuple(blocks))
        parts.append((m["role"], message_segments(message, {})))
    return SegmentedPrompt.of(*parts)
