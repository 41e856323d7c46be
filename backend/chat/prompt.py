"""Chat rules on a customer's text, and the plain chat-message shape.

What a turn's prompt contains is the context builder's decision (``backend/context/builder.py``, wired in by
``backend/services/context_service.py``). A request for a human agent, in English or Chinese, is a dialogue act of
the context layer (``backend/context/acts.py``); the chat service stops the bot on it.
"""

from __future__ import annotations

from backend.context.acts import asks_for_human

ChatMessage = dict[str, str]

__all__ = ["ChatMessage", "asks_for_human"]
