"""Stateless requests (/v1) get semantic blocks too: the same token ids as plain messages, typed segments."""

from __future__ import annotations

from backend.context.stateless import segment_messages
from engine.llm_engine import LLMEngine

MESSAGES = [
    {"role": "system", "content": "You are a support agent."},
    {"role": "user", "content": "My order #617-8899001-1122334 never arrived. Where is it?"},
    {"role": "assistant", "content": "Sorry to hear that. 1. Check the tracking page. 2. Ask your neighbours."},
    {"role": "user", "content": ""},
]


def test_segments_cover_each_message_exactly_and_carry_types() -> None:
    prompt = segment_messages(MESSAGES)
    assert prompt.as_messages() == MESSAGES
    types = {s.block_type for s in prompt.segments}
    assert {"identifier", "step"} <= types, types


def test_the_token_ids_are_those_of_the_plain_messages(tiny_engine: LLMEngine) -> None:
    segmented = tiny_engine.tokenize_prompt(segment_messages(MESSAGES))
    assert segmented.token_ids == tiny_engine.tokenize(MESSAGES)
    labelled = {span.block_type for span in segmented.spans}
    assert "identifier" in labelled
    # a tokenized prompt passes through submit-side tokenizing unchanged (what the /v1 path hands the engine)
    again = tiny_engine.tokenize_prompt(segmented)
    assert again.token_ids == segmented.token_ids and again.spans == segmented.spans
