"""``counted_floor``: a lower bound of a chat prompt's tokens from the encoder alone; None when the text is too short
to pass the limit by its length."""

from __future__ import annotations

from backend.openai.prompt_guard import counted_floor
from engine.llm_engine import LLMEngine


def test_the_count_is_a_lower_bound_and_short_prompts_are_not_counted(tiny_engine: LLMEngine) -> None:
    limit = tiny_engine.prompt_limit
    assert counted_floor(tiny_engine, ["Where is my parcel?"]) is None  # 4 bytes a character cannot pass the limit
    texts = ["[" * limit, "where is my order 1234? " * (limit // 20)]
    floor = counted_floor(tiny_engine, texts)
    messages = [{"role": "user", "content": t} for t in texts]
    exact = len(tiny_engine.tokenize(messages))
    assert floor is not None and limit <= floor <= exact  # over the limit, and never above the true count
