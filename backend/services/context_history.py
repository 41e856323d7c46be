"""A session's stored messages as the context builder reads them: in conversation order, each with its topic epoch,
a reply that called tools with its calls and results (``backend/services/context_service.py``'s helpers)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from backend.context.blocks import Block
from backend.context.builder import HistoryMessage
from backend.db.models import Message
from backend.domain import MessageRole
from backend.services.tool_exchange import ToolExchange
from backend.tools.types import ToolFamily

log = logging.getLogger("kvchat.context")


def conversation_order(m: Message) -> float:
    # NOTE: a reply's seq can be later than a following user message (the customer typed while the bot answered);
    # in the prompt the reply belongs right after the message it answers.
    return m.reply_to_seq + 0.5 if m.reply_to_seq is not None else float(m.seq)


def history_message(m: Message, epoch: int, blocks: tuple[Block, ...], family: ToolFamily) -> HistoryMessage:
    """A stored message as context: a reply that called tools comes with its calls and results, then its answer."""
    # NOTE: a human agent's reply is an assistant turn of the prompt: chat templates know no other speaker, and the
    # customer was answered by "the assistant" either way.
    role = MessageRole.ASSISTANT if m.role == MessageRole.AGENT.value else MessageRole(m.role)
    if not m.tool_exchange:
        return HistoryMessage(m.seq, role, m.content, epoch, blocks)
    try:
        exchange = ToolExchange.from_json(m.tool_exchange)
    except ValueError:
        log.warning("message %s/%d: its stored tool calls are unreadable; left out", m.session_id, m.seq)
        return HistoryMessage(m.seq, role, m.content, epoch, blocks)
    return HistoryMessage(m.seq, role, exchange.answer(m.content), epoch, blocks, exchange.messages(family))


def in_order(messages: Sequence[Message]) -> list[Message]:
    return sorted(messages, key=conversation_order)


def epochs_of(messages: Sequence[Message], customer: dict[int, int]) -> dict[int, int]:
    """Each message's topic epoch: a customer message's from the topic history, a reply's from the message it
    answers. A message without a history row (stored before the context layer, or its observation failed) takes the
    epoch of the message before it, so the newest message is never left in an older epoch."""
    epochs: dict[int, int] = {}
    last = 0
    for m in in_order(messages):
        if m.role == MessageRole.USER.value:
            last = customer.get(m.seq, last)
        elif m.reply_to_seq is not None:
            last = epochs.get(m.reply_to_seq, last)
        epochs[m.seq] = last
    return epochs
