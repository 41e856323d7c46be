"""Grammar matchers (llguidance) on the tiny model's tokenizer: masks follow the grammar, bad grammars are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine.errors import InvalidSamplingParamsError
from engine.grammar import GrammarCompiler
from engine.sampling_params import GrammarKind, StructuredOutput
from engine.tokenizer import Tokenizer

SCHEMA = {
    "type": "object",
    "properties": {"status": {"enum": ["pending", "shipped"]}, "n": {"type": "integer"}},
    "required": ["status", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


@pytest.fixture(scope="module")
def compiler(tokenizer: Tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, tokenizer.eos_token_ids)


def test_a_valid_document_walks_through_the_mask_then_only_eos_is_allowed(
    compiler: GrammarCompiler, tokenizer: Tokenizer
) -> None:
    matcher = compiler.compile(StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(SCHEMA)))
    for token in tokenizer.encode(json.dumps({"status": "shipped", "n": 12}), add_special_tokens=False):
        assert bool(matcher.allowed()[token])
        matcher.accept(token)
    assert matcher.allowed().nonzero().flatten().tolist() == list(tokenizer.eos_token_ids)
    assert not matcher.is_error


def test_the_mask_sets_disallowed_tokens_to_minus_inf_in_place(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.compile(StructuredOutput(GrammarKind.JSON_OBJECT))
    row = torch.zeros(tokenizer.vocab_size)
    assert matcher.apply(row)
    allowed = torch.isfinite(row).nonzero().flatten().tolist()
    assert allowed  # a JSON object opens with "{" (alone or merged with what follows)
    assert all(tokenizer.decode([t]).startswith("{") for t in allowed)


def test_a_lark_grammar_allows_exactly_its_strings(compiler: GrammarCompiler, tokenizer: Tokenizer) -> None:
    matcher = compiler.compile(StructuredOutput(GrammarKind.LARK, 'start: "yes" | "no"'))
    first = {tokenizer.decode([t]) for t in matcher.allowed().nonzero().flatten().tolist()}
    assert first and all("yes".startswith(s) or "no".startswith(s) for s in first)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (StructuredOutput(GrammarKind.LARK, "start: nowhere"), r"^the lark grammar cannot be used: .*nowhere"),
        (StructuredOutput(GrammarKind.JSON_SCHEMA, '{"type": "nonsense"}'), r"^the json_schema grammar cannot be used"),
    ],
)
def test_a_grammar_that_cannot_compile_is_refused_with_the_reason(
    compiler: GrammarCompiler, spec: StructuredOutput, message: str
) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message):
        compiler.compile(spec)


@pytest.mark.parametrize(
    ("kind", "spec", "message"),
    [
        (GrammarKind.JSON_SCHEMA, "{not json", r"^the JSON schema is not valid JSON: "),
        (GrammarKind.JSON_SCHEMA, "[1, 2]", r"^a JSON schema must be an object \(or a boolean\)$"),
        (GrammarKind.LARK, "  ", r"^a Lark grammar must not be empty$"),
    ],
)
def test_a_malformed_spec_is_refused_when_made(kind: GrammarKind, spec: str, message: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message):
        StructuredOutput(kind, spec)
