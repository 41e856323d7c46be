"""Dialogue acts: greetings and hand-off requests in English and Chinese."""

from __future__ import annotations

import re

import pytest

from backend.context.acts import GREETING, asks_for_human


@pytest.mark.parametrize(
    "text",
    [
        "我要转人工客服！",
        "请帮我转接人工。",
        "能不能找人工？",
        "I want to talk to a human please",
        "Can I speak with a manager?",
        "Get me a live agent now",
    ],
)
def test_a_request_for_a_person_is_a_handoff(text: str) -> None:
    assert asks_for_human(text)


@pytest.mark.parametrize("text", ["我要退货", "人工智能是什么？", "Where is my order?", "I talked to the courier"])
def test_other_messages_are_not_a_handoff(text: str) -> None:
    assert not asks_for_human(text)


@pytest.mark.parametrize(
    ("text", "greeting"),
    [
        ("Hi!", True),
        ("Good morning, team.", True),
        ("hello?", True),
        ("Dear customer service,", True),
        ("您好！", True),
        ("在吗？", True),
        ("Hi, my parcel is late", False),
        ("您好，我的包裹没到", False),
        ("Hitachi fridge", False),
    ],
)
def test_a_greeting_is_a_sentence_that_only_greets(text: str, greeting: bool) -> None:
    assert (re.search(GREETING, text) is not None) == greeting
