"""The forced-call grammar: with it, the engine's matcher accepts exactly calls of the offered tools."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.tools.grammar import call_grammar
from backend.tools.prompt import hermes_call, llama3_call
from backend.tools.types import ToolCall, ToolFamily, ToolSpec
from engine.grammar import GrammarCompiler
from engine.sampling_params import GrammarKind, StructuredOutput
from engine.tokenizer import Tokenizer

LOOKUP = ToolSpec(
    "lookup",
    "",
    {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"], "additionalProperties": False},
)
PING = ToolSpec("ping")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer(tiny_model_dir)


def accepts(tokenizer: Tokenizer, grammar: str, text: str) -> bool:
    compiler = GrammarCompiler(tokenizer.hf, tokenizer.vocab_size, tokenizer.eos_token_ids)
    matcher = compiler.compile(StructuredOutput(GrammarKind.LARK, grammar))
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not bool(matcher.allowed()[token]):
            return False
        matcher.accept(token)
    return bool(matcher.allowed()[tokenizer.eos_token_ids[0]])


@pytest.mark.parametrize("family", [ToolFamily.HERMES, ToolFamily.LLAMA3_JSON])
def test_a_call_of_an_offered_tool_with_valid_arguments_is_accepted(tokenizer: Tokenizer, family: ToolFamily) -> None:
    write = hermes_call if family is ToolFamily.HERMES else llama3_call
    grammar = call_grammar([LOOKUP, PING], family)
    assert accepts(tokenizer, grammar, write(ToolCall("lookup", '{"id": "A1"}')))
    assert accepts(tokenizer, grammar, write(ToolCall("ping", "{}")))
    assert not accepts(tokenizer, grammar, write(ToolCall("lookup", '{"order": "A1"}')))
    assert not accepts(tokenizer, grammar, write(ToolCall("other", "{}")))
    assert not accepts(tokenizer, grammar, "Sure, here you go.")


def test_parallel_hermes_calls_need_parallel_on(tokenizer: Tokenizer) -> None:
    two = hermes_call(ToolCall("ping", "{}")) + "\n" + hermes_call(ToolCall("lookup", '{"id": "B"}'))
    assert accepts(tokenizer, call_grammar([LOOKUP, PING], ToolFamily.HERMES), two)
    assert not accepts(tokenizer, call_grammar([LOOKUP, PING], ToolFamily.HERMES, parallel=False), two)
