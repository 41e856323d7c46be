"""The prompt encoder's count of system-message tokens: the leading ids every conversation of a deployment shares."""

from __future__ import annotations

import pytest

from engine.prompt import Segment, SegmentedPrompt, TokenizedPrompt
from engine.prompt_encoder import PromptEncoder
from engine.testing import FAMILIES, build_family_tokenizer
from engine.tokenizer import Tokenizer

SYSTEM = {"role": "system", "content": "Be brief. Refunds are paid within 14 days."}
TURNS = [{"role": "user", "content": "Where is my order?"}, {"role": "assistant", "content": "It ships today."}]


def encoder_for(tok: Tokenizer) -> PromptEncoder:
    return PromptEncoder(tok, vocab_size=len(tok.hf), max_model_len=4096, pool_tokens=4096)


# NOTE: the families whose template renders a system message on its own; Llama 2 folds it into the first user turn
# and Mistral's template has no system role.
SYSTEM_ALONE = sorted(set(FAMILIES) - {"llama2", "mistral"})


def family_tokenizer(family: str, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer(build_family_tokenizer(tmp_path_factory.mktemp(family), family))


@pytest.fixture(scope="module", params=SYSTEM_ALONE)
def tok(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return family_tokenizer(request.param, tmp_path_factory)


def test_the_system_tokens_are_the_system_message_rendered_alone(tok: Tokenizer) -> None:
    encoded = encoder_for(tok).encode([SYSTEM, *TURNS])
    alone = tok.apply_chat_template([SYSTEM], add_generation_prompt=False)
    n = encoded.system_tokens
    assert 0 < n <= len(alone)
    assert encoded.token_ids[:n] == alone[:n]
    assert n == len(alone) or encoded.token_ids[n] != alone[n]  # the longest shared prefix
    other = encoder_for(tok).encode([SYSTEM, {"role": "user", "content": "Can I pay by card?"}])
    assert other.system_tokens == n


def test_a_segmented_prompt_counts_like_its_plain_messages(tok: Tokenizer) -> None:
    segmented = SegmentedPrompt.of(
        ("system", [Segment("Be brief.", "system_prompt"), Segment(" Refunds are paid within 14 days.", "policy")]),
        ("user", [Segment("Where is my order?", "question")]),
    )
    encoder = encoder_for(tok)
    assert encoder.encode(segmented).system_tokens == encoder.encode(segmented.as_messages()).system_tokens > 0


def test_prompts_without_a_leading_system_message_have_none(tok: Tokenizer) -> None:
    encoder = encoder_for(tok)
    assert encoder.encode(TURNS).system_tokens == 0
    assert encoder.encode([TURNS[0], SYSTEM]).system_tokens == 0  # (only a leading one counts)
    assert encoder.encode("Where is my order?").system_tokens == 0
    assert encoder.encode([5, 6, 7]).system_tokens == 0


def test_a_tokenized_prompt_keeps_its_count_within_its_ids(tok: Tokenizer) -> None:
    encoder = encoder_for(tok)
    encoded = encoder.encode([SYSTEM, *TURNS])
    assert encoder.encode(encoded).system_tokens == encoded.system_tokens
    assert encoder.encode(TokenizedPrompt([5, 6, 7], system_tokens=99)).system_tokens == 3


def test_a_template_that_folds_the_system_message_into_the_user_turn_counts_none(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tok = family_tokenizer("llama2", tmp_path_factory)
    assert encoder_for(tok).encode([SYSTEM, *TURNS]).system_tokens == 0  # (so a release keeps nothing, as before)
