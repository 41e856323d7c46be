"""What a turn's prompt contains: the tenant's system prompt, then as much recent history as the budget allows.

NOTE: the prompt for turn N+1 extends the prompt of turn N with the reply and the new message, token for token, so
the engine's prefix cache serves everything but the new tail. Dropping the *oldest* turns when the budget is hit
breaks that for one turn (the prefix changes); it is the price of a bounded context, paid rarely.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from backend.db.models import Message, MessageRole, MessageStatus

ChatMessage = dict[str, str]

AGENT_REQUEST = re.compile(
    r"\b(human|real person|live (agent|person|chat)|representative"
    r"|(speak|talk|chat) (to|with) (an? )?(agent|person|someone))\b",
    re.IGNORECASE,
)


def asks_for_human(text: str) -> bool:
    """Rule: the customer asks for a human agent (the bot then stops answering)."""
    return AGENT_REQUEST.search(text) is not None


def history_messages(history: Sequence[Message]) -> list[ChatMessage]:
    """User messages and *complete* assistant replies, in order (cancelled/incomplete replies are not context)."""
    out: list[ChatMessage] = []
    for m in history:
        if m.role == MessageRole.USER.value or (
            m.role == MessageRole.ASSISTANT.value and m.status == MessageStatus.COMPLETE.value
        ):
            out.append({"role": m.role, "content": m.content})
    return out


def build_prompt(
    system_prompt: str,
    history: Sequence[Message],
    count_tokens: Callable[[list[ChatMessage]], int],
    budget_tokens: int,
) -> list[ChatMessage]:
    """System prompt + the longest suffix of the history that fits ``budget_tokens`` (always the last message)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    turns = history_messages(history)
    start = 0
    while start < len(turns) - 1 and count_tokens(system + turns[start:]) > budget_tokens:
        start += 1
        # NOTE: never start the context on an assistant reply: chat templates expect a user turn first.
        while start < len(turns) - 1 and turns[start]["role"] == MessageRole.ASSISTANT.value:
            start += 1
    return system + turns[start:]
