"""A chat turn's grounding (backend/chat/grounding.py): which of the session's texts (the tenant's whole handbook
among them) a reply may take contact details from."""

from __future__ import annotations

from backend.chat.grounding import turn_grounding
from backend.context.handbook import Section
from backend.context.rules import RuleSet
from backend.context.sections import SectionIndex
from backend.db.models import Message
from backend.services.context_service import SessionContext
from backend.services.context_store import ContextSettings
from backend.services.tool_exchange import ToolExchange, ToolStep
from backend.tools.types import ToolCall


def _message(seq: int, role: str, content: str, tool_exchange: str | None = None) -> Message:
    return Message(seq=seq, role=role, content=content, status="complete", tool_exchange=tool_exchange)


def _context(messages: list[Message], pinned: str = "") -> SessionContext:
    return SessionContext(
        tenant_id="t1",
        session_id="s1",
        namespace="ns",
        system_prompt="You help Example Shop.",
        policy_text="Returns: https://shop.example.com/returns",
        epoch=0,
        temperature=None,
        pinned_context=pinned,
        messages=messages,
        epochs={},
        temperatures={},
        blocks=[],
        block_ids={},
        settings=ContextSettings(),
        rules=RuleSet.compile(()),
        handbook=SectionIndex([Section("Shipping", "Call the carrier at 800-555-0100.")]),
        sections={},
    )


def test_prompt_policy_pinned_customer_messages_and_tool_results_ground_the_reply() -> None:
    exchange = ToolExchange((ToolStep("", (ToolCall("lookup", "{}", "c1"),), ('{"phone": "555-123-4567"}',)),))
    messages = [
        _message(1, "user", "My order is 302-1234567."),
        _message(2, "assistant", "Found it: call 555-123-4567.", exchange.to_json()),
        _message(3, "assistant", "Call 1-800-999-0000."),  # the bot's own words ground nothing
        _message(4, "user", "Thanks!"),
    ]
    grounding = turn_grounding(_context(messages, pinned="VIP customer, account jo@mail.com"))
    assert grounding.texts == (
        "You help Example Shop.",
        "Returns: https://shop.example.com/returns",
        "VIP customer, account jo@mail.com",
        "Call the carrier at 800-555-0100.",
        "My order is 302-1234567.",
        '{"phone": "555-123-4567"}',
        "Thanks!",
    )


def test_empty_texts_and_a_stored_exchange_that_does_not_parse_ground_nothing() -> None:
    messages = [_message(1, "assistant", "Hi.", "not json")]
    assert turn_grounding(_context(messages)).texts == (
        "You help Example Shop.",
        "Returns: https://shop.example.com/returns",
        "Call the carrier at 800-555-0100.",
    )
