"""Whether a message can ever be answered (``backend/chat/answerable.py``), on the tiny model's real tokenizer: the
exact count decides whenever the bound from the message's length cannot, and an ordinary message is not tokenized."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from backend.chat.answerable import EDGE_SLACK, Answerable, _messages
from backend.core.errors import MessageTooLongError
from engine.llm_engine import LLMEngine

pytestmark = pytest.mark.anyio
SYSTEM = "You are the support assistant of Parcels & Co. Answer briefly and politely."
TEXTS = [
    "Where is my order?",
    "Order #4061234567 was due on Monday — où est mon colis ? 我的包裹在哪里？ 🙂🙂",
    "   spaces\tand\ttabs\n\nnew lines   ",
    "a" * 300,
    "0123456789" * 40,
    "The kettle BROKE!!! ?!?! ...",
]


class Counted:
    """The real engine, its ``tokenize`` calls counted."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenized = 0

    def prompt_token_floor(self, texts: Iterable[str]) -> int:
        return self.engine.prompt_token_floor(texts)

    def tokenize(self, prompt: Any) -> list[int]:
        self.tokenized += 1
        return self.engine.tokenize(prompt)


def _tokens(engine: LLMEngine, text: str) -> int:
    return len(engine.tokenize(_messages(SYSTEM, text)))


def test_the_bound_holds_on_the_models_tokenizer(tiny_engine: LLMEngine) -> None:
    base = _tokens(tiny_engine, "")
    for text in TEXTS:
        assert _tokens(tiny_engine, text) <= base + len(text.encode()) + EDGE_SLACK


async def test_an_ordinary_message_is_not_tokenized_and_a_long_one_is_counted_exactly(
    tiny_engine: LLMEngine,
) -> None:
    counted = Counted(tiny_engine)
    check = Answerable(counted)  # type: ignore[arg-type]
    budget = 200
    await check.check("t", SYSTEM, "Where is my order?", budget)
    await check.check("t", SYSTEM, "And the kettle?", budget)
    assert counted.tokenized == 1  # the system prompt's count, once
    # over the bound, within the budget: the exact count lets it through
    text = "order " * 60
    exact = _tokens(tiny_engine, text)
    assert exact <= budget < _tokens(tiny_engine, "") + len(text.encode()) + EDGE_SLACK, exact
    await check.check("t", SYSTEM, text, budget)
    assert counted.tokenized == 2
    # over the budget by its exact count, under the floor: refused with the exact count
    with pytest.raises(MessageTooLongError) as refused:
        await check.check("t", SYSTEM, text, exact - 1)
    assert (refused.value.tokens, str(refused.value).startswith("message too long: at least")) == (exact, False)
    # over by its length alone: refused without tokenizing
    with pytest.raises(MessageTooLongError, match="at least"):
        await check.check("t", SYSTEM, "x " * 5000, budget)
    assert counted.tokenized == 3
