"""A chat turn's grounding (``backend/context/grounding.py``): the texts its reply may take contact details from.

The tenant's system prompt, policy text and whole handbook, the session's pinned context, every customer message and
every human agent's, and the tool results of its earlier replies (this turn's results join while the turn runs:
``ToolTurn``).
NOTE: the customer's messages are sources: repeating the customer's order number or address back is not inventing it.
"""

from __future__ import annotations

import logging

from backend.context.grounding import Grounding
from backend.domain import MessageRole
from backend.services.context_service import SessionContext
from backend.services.tool_exchange import ToolExchange

log = logging.getLogger("kvchat.chat")


def turn_grounding(ctx: SessionContext) -> Grounding:
    texts = [ctx.system_prompt, ctx.policy_text, ctx.pinned_context]
    texts += [s.text for s in ctx.handbook.sections]  # NOTE: the whole handbook, not only the topic's sections
    for m in ctx.messages:
        if m.role in (MessageRole.USER.value, MessageRole.AGENT.value):  # NOTE: a person's words are not invented
            texts.append(m.content)
        elif m.tool_exchange:
            texts += _tool_results(m.tool_exchange)
    return Grounding(tuple(t for t in texts if t))


def _tool_results(raw: str) -> list[str]:
    try:
        exchange = ToolExchange.from_json(raw)
    except ValueError:  # NOTE: a stored exchange that does not parse grounds nothing; the turn goes on
        log.warning("a stored tool exchange does not parse; its results ground nothing")
        return []
    return [result for step in exchange.steps for result in step.results]
