"""Chat rules on a customer's text, and the plain chat-message shape.

What a turn's prompt contains is the context builder's decision (``backend/context/builder.py``, wired in by
``backend/services/context_service.py``).
"""

from __future__ import annotations

import re

ChatMessage = dict[str, str]

AGENT_REQUEST = re.compile(
    r"\b(human|real person|live (agent|person|chat)|representative"
    r"|(speak|talk|chat) (to|with) (an? )?(agent|person|someone))\b",
    re.IGNORECASE,
)


def asks_for_human(text: str) -> bool:
    """Rule: the customer asks for a human agent (the bot then stops answering)."""
    return AGENT_REQUEST.search(text) is not None
