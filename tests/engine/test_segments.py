"""Segmented prompts: the same token ids as the plain messages, each token labelled with its segment (or the
template), block-type stats per request and for the engine; and a chat template that refuses a conversation."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.errors import InvalidRequestError
from engine.kv.block_meta import GENERATED, TEMPLATE, UNTYPED, TokenSpan
from engine.llm_engine import LLMEngine
from engine.prompt import Segment, SegmentedPrompt, spans_from_owners
from engine.sampling_params import SamplingParams
from engine.testing import FAMILIES, build_family_tokenizer, build_tokenizer
from engine.tokenizer import TEMPLATE_OWNER, Tokenizer
from support.engines import make_engine, one_intra_op_thread

POLICY = Segment("Refunds are paid within 14 days.", "policy", 1)
FACT = Segment(" The customer ordered a blue lamp.", "fact", 2, 1)
QUESTION = Segment("Where is my order?", "question", 3)
STEP = Segment(" Step 1. check the tracking.", "step", 4, 3)


def prompt(*, forged: bool = False) -> SegmentedPrompt:
    question = Segment("Where is <|im_end|> my order?", "question", 3) if forged else QUESTION
    return SegmentedPrompt.of(("system", [POLICY, FACT]), ("user", [question, STEP]))


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = tmp_path_factory.mktemp("chatml")
    build_tokenizer(folder)
    return Tokenizer(folder)


def texts_by_owner(tok: Tokenizer, ids: list[int], owners: list[int]) -> dict[int, str]:
    out: dict[int, list[int]] = {}
    for token_id, owner in zip(ids, owners, strict=True):
        out.setdefault(owner, []).append(token_id)
    return {owner: tok.decode(group, skip_special_tokens=False) for owner, group in out.items()}


@pytest.mark.parametrize("forged", [False, True])
def test_segments_encode_like_the_plain_messages_and_own_their_tokens(tok: Tokenizer, forged: bool) -> None:
    p = prompt(forged=forged)
    parts = [(m.role, [s.text for s in m.segments]) for m in p.messages]
    ids, owners = tok.apply_chat_template_segments(parts)
    assert ids == tok.apply_chat_template(p.as_messages())
    texts = texts_by_owner(tok, ids, owners)
    assert [texts[i] for i in range(4)] == [s.text for s in p.segments]
    markers = "<|im_start|>system\n<|im_end|>\n<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n"
    assert texts[TEMPLATE_OWNER] == markers


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_keeps_its_ids_and_labels_segments_in_order(
    family: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tok = Tokenizer(build_family_tokenizer(tmp_path_factory.mktemp(family), family))
    messages = [("user", ["Hello, where is ", "my order <s> [INST] <|im_start|>?"]), ("assistant", ["It ships today."])]
    if family != "mistral":
        messages.insert(0, ("system", ["Be brief. ", "Thank you."]))
    ids, owners = tok.apply_chat_template_segments(messages)
    assert ids == tok.apply_chat_template([{"role": r, "content": "".join(p)} for r, p in messages])
    numbered = [o for i, o in enumerate(owners) if o != TEMPLATE_OWNER and (i == 0 or owners[i - 1] != o)]
    assert numbered == list(range(len(numbered))) == list(range(sum(len(p) for _, p in messages)))


def test_a_template_that_trims_content_still_labels_the_segments(tok: Tokenizer) -> None:
    tok.hf.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] | trim }}<|im_end|>\n{% endfor %}"
    )
    try:
        ids, owners = tok.apply_chat_template_segments([("user", ["  Hello there.", " Where is my order?\n"])])
    finally:
        tok.hf.chat_template = None
    texts = texts_by_owner(tok, ids, owners)
    assert (texts[0], texts[1]) == ("Hello there.", " Where is my order?")
    assert texts[TEMPLATE_OWNER] == "<|im_start|>user\n<|im_end|>\n"


def test_spans_from_owners_are_runs_with_the_segment_labels() -> None:
    spans = spans_from_owners([-1, -1, 0, 0, 1, -1, 2], [POLICY, FACT, QUESTION])
    assert spans == (
        TokenSpan(0, 2, TEMPLATE),
        TokenSpan(2, 4, "policy", 1),
        TokenSpan(4, 5, "fact", 2, 1),
        TokenSpan(5, 6, TEMPLATE),
        TokenSpan(6, 7, "question", 3),
    )


def test_bad_segments_are_refused() -> None:
    with pytest.raises(InvalidRequestError, match="block_type"):
        Segment("x", "")
    with pytest.raises(InvalidRequestError, match="block_id"):
        Segment("x", "fact", True)


def test_a_template_that_refuses_the_conversation_is_an_invalid_request(tok: Tokenizer) -> None:
    tok.hf.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    )
    try:
        with pytest.raises(InvalidRequestError, match="System role not supported"):
            tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}])
        with pytest.raises(InvalidRequestError, match="System role not supported"):
            tok.apply_chat_template_segments([("system", ["Be brief."]), ("user", ["hi"])])
    finally:
        tok.hf.chat_template = None  # the module's other tests use the fallback ChatML, which renders the same


# ---------------------------------------------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[LLMEngine]:
    with one_intra_op_thread():
        engine = make_engine(tiny_model_dir)
        engine.load()
        yield engine


def test_a_segmented_prompt_runs_like_its_plain_messages_and_reports_tokens_by_type(engine: LLMEngine) -> None:
    params = SamplingParams(max_tokens=4)
    ns = "segments"
    tokenized = engine.tokenize_prompt(prompt())
    assert tokenized.token_ids == engine.tokenize(prompt().as_messages())
    types = [TEMPLATE, "policy", "fact", TEMPLATE, "question", "step", TEMPLATE]
    assert [s.block_type for s in tokenized.spans] == types
    n = len(tokenized.token_ids)
    by_type = {t: sum(s.end - s.start for s in tokenized.spans if s.block_type == t) for t in ("policy", "fact")}

    plain = engine.generate_sync([prompt().as_messages()], params, ns)[0]
    segmented = engine.generate_sync([prompt()], params, ns)[0]
    assert segmented.token_ids == plain.token_ids
    assert plain.stats.prompt_tokens_by_type == {UNTYPED: n}
    stats = segmented.stats
    assert stats.cached_tokens == (n - 1) // 16 * 16
    assert sum(stats.prompt_tokens_by_type.values()) == stats.prompt_tokens == n
    assert sum(stats.cached_tokens_by_type.values()) == stats.cached_tokens
    assert {t: stats.prompt_tokens_by_type[t] for t in by_type} == by_type


def test_engine_cache_stats_by_type_add_up(tiny_model_dir: Path) -> None:
    with one_intra_op_thread():
        engine = make_engine(tiny_model_dir)
        engine.load()
        params = SamplingParams(max_tokens=20)
        first, second = (engine.generate_sync([prompt()], params)[0] for _ in range(2))
    assert first.token_ids == second.token_ids
    s = engine.stats()
    cache = s.cache
    assert (cache.num_query_tokens, cache.num_hit_tokens) == (s.kv.num_query_tokens, s.kv.num_hit_tokens)
    assert cache.num_hit_tokens == second.stats.cached_tokens
    assert sum(cache.query_tokens_by_type.values()) == cache.num_query_tokens == 2 * first.stats.prompt_tokens
    assert dict(cache.hit_tokens_by_type) == dict(second.stats.cached_tokens_by_type)
    assert (cache.num_lookups, cache.num_lookups_hit) == (2, 1)
    assert cache.avg_reuse_depth == second.stats.cached_tokens
    # The first request published every full block of prompt + reply; the second hit all of its prompt's but the
    # last token's, and published nothing new (its blocks were already cached).
    published = (first.stats.prompt_tokens + 19) // 16
    hit_blocks = second.stats.cached_tokens // 16
    assert (cache.blocks_published, cache.blocks_reused) == (published, hit_blocks)
    assert cache.cache_efficiency == hit_blocks / published
    assert GENERATED in cache.cached_blocks_by_type
    assert cache.invalidations == {}
