"""Drafts verified in the engine: greedy tokens identical to decoding without drafts (fp32 and bf16, 200 turns),
verify rows with the decode rows' bits, rollback of rejected drafts, isolation, and which requests never draft."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.device import cpu_supports_bf16
from engine.llm_engine import LLMEngine
from engine.model_runner import BatchItem, ModelRunner
from engine.request_table import Collector
from engine.sampling_params import GrammarKind, RepetitionScope, SamplingParams, StructuredOutput
from engine.spec import suffix_drafts
from support.engines import make_engine, one_intra_op_thread

pytestmark = pytest.mark.skipif(not suffix_drafts.available(), reason="needs the spec extra (arctic-inference)")

SESSIONS, TURNS, MAX_TOKENS = 20, 10, 24
DTYPES = ["float32"] + (["bfloat16"] if cpu_supports_bf16() else [])
# NOTE: user messages drawn from a few fixed phrases, so later turns repeat text the trees have seen
PHRASES = [[40, 41, 42, 43, 44], [60, 61, 62], [80, 81, 82, 83], [100, 101, 102, 103, 104, 105]]


@pytest.fixture(scope="module", autouse=True)
def _one_intra_op_thread() -> Iterator[None]:
    with one_intra_op_thread():
        yield


def engine_with(model_dir: Path, drafts: bool, dtype: str = "float32", **overrides: Any) -> LLMEngine:
    """An engine whose drafts (when on) are verified at every batch size, so they meet every kind of neighbour."""
    options = {"max_kv_memory_mb": 32, "max_num_seqs": 64, "drafts": drafts, "dtype": dtype}
    engine = make_engine(model_dir, **(options | overrides))
    engine.load()
    if drafts:
        force_drafts(engine)
    return engine


def force_drafts(engine: LLMEngine) -> None:
    """Up to 8 drafts verified at any batch size, whatever the cost model says."""
    engine.core.scheduler.draft_limit = lambda decoding: 8
    assert engine.core.drafter is not None
    engine.core.drafter.cost = None


def replay(engine: LLMEngine, seed: int = 0) -> list[list[tuple[int, ...]]]:
    """``SESSIONS`` conversations of ``TURNS`` greedy turns, all sessions' turn t in one batch; each turn's prompt is
    the conversation so far (earlier replies included). Returns the reply ids per turn and session."""
    rng = random.Random(seed)
    prompts = [[3 + i, *rng.choice(PHRASES), *(rng.randrange(3, 300) for _ in range(8))] for i in range(SESSIONS)]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    out = []
    for _ in range(TURNS):
        collect = Collector()
        ids = [engine.submit(p, params, f"tenant{i % 2}", collect, session=f"s{i}") for i, p in enumerate(prompts)]
        engine.run_until_idle()
        results = collect.results(ids)
        out.append([r.token_ids for r in results])
        prompts = [p + list(r.token_ids) + rng.choice(PHRASES) for p, r in zip(prompts, results, strict=True)]
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_tokens_are_identical_with_drafts_over_200_turns(tiny_model_dir: Path, dtype: str) -> None:
    plain, drafted = engine_with(tiny_model_dir, False, dtype), engine_with(tiny_model_dir, True, dtype)
    assert replay(drafted) == replay(plain)
    stats = drafted.stats()
    assert stats.accepted_tokens > 0.05 * stats.generated_tokens  # drafts were verified and accepted
    assert stats.drafted_tokens > stats.accepted_tokens  # ... and rejected too


@pytest.mark.parametrize("dtype", DTYPES)
def test_verify_rows_get_the_bits_of_decode_rows(tiny_model_dir: Path, dtype: str) -> None:
    runner = ModelRunner(str(tiny_model_dir), num_blocks=32, block_size=16, device="cpu", dtype=dtype)
    rng = random.Random(1)
    prompt, follow = [rng.randrange(3, 300) for _ in range(37)], [rng.randrange(3, 300) for _ in range(9)]
    table = list(range(4))
    runner.forward([BatchItem(prompt, 0, table, True, prompt=True)])
    decoded = torch.cat([runner.forward([BatchItem([t], len(prompt) + i, table, True)]) for i, t in enumerate(follow)])
    runner.forward([BatchItem(prompt, 0, table, True, prompt=True)])
    neighbour = BatchItem(prompt[:20], 0, [10, 11], True, prompt=True)  # a prefill chunk beside the verify rows
    verified = runner.forward([neighbour, BatchItem(follow, len(prompt), table, True, verify=True)])[1:]
    assert torch.equal(verified, decoded)


def test_rejected_drafts_give_their_blocks_back(tiny_model_dir: Path) -> None:
    engine = engine_with(tiny_model_dir, True)
    kv = engine.core.kv
    collect = Collector()
    rid = engine.submit([5, 6, 7, 8, 9, 10, 11, 12] * 4, SamplingParams(max_tokens=96), "t", collect)
    before: list[int] = []
    while engine._step():
        seq = engine.core.scheduler.get(rid)
        if seq is None:
            break
        table = kv.block_table(rid)
        assert len(table) <= kv.blocks_needed(seq.num_tokens)  # nothing held for rejected drafts
        assert kv.num_free_blocks == kv.num_blocks - len(table)
        kept = kv.blocks_needed(seq.num_computed_tokens) - 1  # (the last one may be partly filled)
        assert table[:kept] == before[:kept] or len(before) < kept  # the chain before them is unchanged
        before = table
    stats = engine.stats()
    assert stats.drafted_tokens > stats.accepted_tokens > 0
    assert kv.num_free_blocks == kv.num_blocks


def test_a_seeded_sampled_request_gives_the_tokens_it_gives_without_drafts(tiny_model_dir: Path) -> None:
    """Seeded requests verify no drafts: their tokens must not depend on the batch, and drafting does."""
    params = SamplingParams(max_tokens=64, temperature=0.3, seed=7)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    engine = engine_with(tiny_model_dir, True)
    drafted = engine.generate_sync([prompt], params, "t")[0]
    assert drafted.token_ids == engine_with(tiny_model_dir, False).generate_sync([prompt], params, "t")[0].token_ids
    assert engine.stats().drafted_tokens == 0


def test_unseeded_sampled_requests_verify_drafts(tiny_model_dir: Path) -> None:
    engine = engine_with(tiny_model_dir, True)
    engine.generate_sync([[5, 6, 7, 8, 9, 10, 11, 12] * 4], SamplingParams(max_tokens=64, temperature=0.05), "t")
    assert engine.stats().accepted_tokens > 0


def test_a_tenant_gets_no_drafts_from_another_tenants_replies(tiny_model_dir: Path) -> None:
    """Tenant b asks what tenant a asked and has a's reply's first tokens in its prompt: only a's tree knows the rest.
    (a control: tenant a asking the same gets the rest drafted and accepted)"""
    prompt = [7, 200, 201, 202, 203, 204]
    accepted = {}
    for namespace in ("a", "b"):
        engine = engine_with(tiny_model_dir, True)
        reply = engine.generate_sync([prompt], SamplingParams(max_tokens=32), "a")[0].token_ids
        before = engine.stats().accepted_tokens
        again = engine.generate_sync([prompt + list(reply[:8])], SamplingParams(max_tokens=16), namespace)[0]
        assert again.token_ids == reply[8:24]
        accepted[namespace] = engine.stats().accepted_tokens - before
    assert accepted["a"] >= 12
    assert accepted["b"] < accepted["a"] // 2


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 1.2},
        {"repetition_penalty": 1.2, "repetition_penalty_scope": RepetitionScope.REPLY},
        {"frequency_penalty": 0.5, "presence_penalty": 0.3},
        {"logit_bias": ((40, 2.0), (41, -3.0))},
        {"logprobs": 2},
        {"min_tokens": 20, "ignore_eos": False},
        {"structured": StructuredOutput(GrammarKind.JSON_OBJECT)},
    ],
    ids=["repetition", "repetition-reply", "frequency+presence", "logit_bias", "logprobs", "min_tokens", "grammar"],
)
def test_rows_that_need_processing_verify_drafts_exactly(tiny_model_dir: Path, fields: dict[str, Any]) -> None:
    """Each verified row is processed with the state advanced by the drafts before it: the same tokens (and
    log-probabilities) as decoding without drafts."""
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12] * 4, [40, 41, 42, 43, 44] * 5]
    params = SamplingParams(max_tokens=32, **fields)
    plain = engine_with(tiny_model_dir, False).generate_sync(prompts, params, "t")
    engine = engine_with(tiny_model_dir, True)
    drafted = engine.generate_sync(prompts, params, "t")
    assert [r.token_ids for r in drafted] == [r.token_ids for r in plain]
    assert [r.logprobs for r in drafted] == [r.logprobs for r in plain]
    stats = engine.stats()
    if "structured" not in fields:  # (the tiny model's JSON rarely repeats its prompt)
        assert stats.drafted_tokens > 0
    if "frequency_penalty" not in fields and "structured" not in fields:  # (those two break the tiny model's loops)
        assert stats.accepted_tokens > 0


def test_a_draft_the_grammar_forbids_is_never_accepted(tiny_model_dir: Path) -> None:
    engine = engine_with(tiny_model_dir, True)
    sampler, tokenizer = engine.core.sampler, engine.tokenizer.hf
    state = sampler.new_state(SamplingParams(structured=StructuredOutput(GrammarKind.JSON_OBJECT)), (2,))
    brace, letter = (tokenizer.get_vocab()[t] for t in ("{", "a"))
    logits = torch.zeros(2, engine.info.vocab_size)
    logits[0, letter] = 50.0  # the model "wants" the draft, but no JSON object starts with a letter
    logits[0, brace] = 10.0
    assert sampler.verify(logits, state, [letter]) == [brace]


def test_a_request_can_ask_for_no_drafts(tiny_model_dir: Path) -> None:
    engine = engine_with(tiny_model_dir, True)
    engine.generate_sync([[5, 6, 7, 8, 9, 10, 11, 12] * 4], SamplingParams(max_tokens=32, drafts=False), "t")
    assert engine.stats().drafted_tokens == 0


def test_a_request_that_says_nothing_follows_the_engines_switch(tiny_model_dir: Path) -> None:
    """Beside each other in one batch, with the switch on: the request that asked for none (a tenant with drafts
    off) verifies none, the one that said nothing drafts; with the switch off, only the one that asked drafts."""
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4
    for switch, asked in ((True, False), (False, True)):
        engine = engine_with(tiny_model_dir, switch)
        force_drafts(engine)
        collect = Collector()
        params = [SamplingParams(max_tokens=32, drafts=asked), SamplingParams(max_tokens=32)]
        ids = [engine.submit(prompt, p, f"tenant{i}", collect) for i, p in enumerate(params)]
        engine.run_until_idle()
        own, default = (r.stats for r in collect.results(ids))
        drafting, quiet = (own, default) if asked else (default, own)
        assert (quiet.drafted_tokens, quiet.accepted_tokens) == (0, 0)
        assert drafting.drafted_tokens >= drafting.accepted_tokens > 0
        assert engine.stats().drafted_tokens == drafting.drafted_tokens


def test_erasing_a_session_removes_its_replies_from_the_drafts(tiny_model_dir: Path) -> None:
    engine = engine_with(tiny_model_dir, True)
    collect = Collector()
    engine.submit([7, 200, 201, 202, 203, 204], SamplingParams(max_tokens=16), "a", collect, session="s1")
    engine.run_until_idle()
    assert engine.core.erase_drafts("s1", "a") == 1
    assert engine.core.erase_drafts("s1", "a") == 0
