"""Suffix drafts on structured output (issue 44): decode tokens/s with drafts off and on, in the same sitting.

    flock /tmp/kvchat-bench.lock .venv/bin/python -m bench.structured_output --drafts

Two workloads, each one request at a time (1 session), greedy, with the grammar ``/v1`` sends:

* **json_schema**: a support ticket under ``TICKET`` (``response_format`` ``json_schema``), as the validity part of
  ``bench.structured_output`` asks it;
* **tool_call**: a reply held to one call of a store's tools (``tool_choice`` ``required``: the grammar of
  ``backend/tools/grammar.py``, the tools offered in the Hermes prompt of ``backend/tools/prompt.py``).

Each held-out customer message is asked twice, drafts off and on, in alternation (off first for even messages, on
first for odd ones, so neither always runs on a warmer machine), each in its own namespace so both prefill alike and
the on requests alone feed their tenant's draft tree (as a tenant's earlier replies would). The figure is the
decode tokens/s of all replies (their tokens after the first over their time after the first) and the median over
the messages of the on / off ratio of their own rates (the steadier figure on shared cores), the acceptance
(accepted / drafted) and the tokens per verify step, from the requests' own stats; the replies off and on must be
token for token identical (greedy; counted as mismatches).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from backend.tools.grammar import call_grammar
from backend.tools.prompt import render
from backend.tools.types import ChatTurn, ToolFamily, ToolSpec
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished
from engine.request_table import Collector
from engine.sampling_params import GrammarKind, SamplingParams, StructuredOutput

Messages = list[dict[str, str]]
TOOLS = (
    ToolSpec(
        "lookup_order",
        "Look up an order's status, items and delivery date.",
        {"type": "object", "properties": {"order_id": {"type": "string", "maxLength": 40}}, "required": ["order_id"]},
    ),
    ToolSpec(
        "start_return",
        "Start a return or refund for an order.",
        {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "maxLength": 40},
                "reason": {"enum": ["damaged", "wrong_item", "late", "not_needed", "other"]},
            },
            "required": ["order_id", "reason"],
        },
    ),
    ToolSpec(
        "escalate",
        "Hand the conversation to a person, with a one-sentence summary.",
        {"type": "object", "properties": {"summary": {"type": "string", "maxLength": 160}}, "required": ["summary"]},
    ),
)
TOOL_SYSTEM = "You are a store's customer-service assistant. Answer every message with a call of one of the tools."


@dataclass(slots=True)
class Side:
    """One side's replies (drafts off or on)."""

    replies: list[RequestFinished] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        stats = [r.stats for r in self.replies]
        tokens = sum(max(s.completion_tokens - 1, 0) for s in stats)
        seconds = sum((s.completion_tokens - 1) / s.decode_tokens_per_s for s in stats if s.decode_tokens_per_s > 0)
        drafted, accepted = sum(s.drafted_tokens for s in stats), sum(s.accepted_tokens for s in stats)
        steps = sum(s.completion_tokens for s in stats) - accepted  # each step gives one token plus its accepted drafts
        return {
            "replies": len(stats),
            "completion_tokens": sum(s.completion_tokens for s in stats),
            "decode_tokens_per_s": tokens / seconds if seconds else 0.0,
            "median_reply_decode_tokens_per_s": statistics.median(s.decode_tokens_per_s for s in stats),
            "drafted_tokens": drafted,
            "accepted_tokens": accepted,
            "acceptance": accepted / drafted if drafted else None,
            "tokens_per_step": sum(s.completion_tokens for s in stats) / steps if steps else None,
            # the steps after each reply's first token (the decode rate's own steps)
            "decode_tokens_per_step": tokens / (steps - len(stats)) if steps > len(stats) else None,
        }


def ticket_request(
    system: str, message: str, schema: dict[str, Any], max_tokens: int
) -> tuple[Messages, SamplingParams]:
    grammar = StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(schema))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": message}]
    return messages, SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=grammar)


def tool_request(message: str, max_tokens: int) -> tuple[Messages, SamplingParams]:
    turns = [ChatTurn("system", TOOL_SYSTEM), ChatTurn("user", message)]
    messages = [dict(m) for m in render(turns, TOOLS, ToolFamily.HERMES)]
    grammar = StructuredOutput(GrammarKind.LARK, call_grammar(TOOLS, ToolFamily.HERMES, parallel=False))
    return messages, SamplingParams(max_tokens=max_tokens, temperature=0.0, structured=grammar)


def _one(engine: LLMEngine, messages: Messages, params: SamplingParams, namespace: str) -> RequestFinished:
    collect = Collector()
    rid = engine.submit(messages, params, namespace, collect)
    engine.run_until_idle()
    return collect.results([rid])[0]


def compare(engine: LLMEngine, requests: Sequence[tuple[Messages, SamplingParams]], name: str) -> dict[str, Any]:
    """Each request with drafts off and on, alternating which goes first; the two sides' figures."""
    sides = {False: Side(), True: Side()}
    mismatches = 0
    started = time.perf_counter()
    for i, (messages, params) in enumerate(requests):
        order = (False, True) if i % 2 == 0 else (True, False)
        for drafts in order:
            asked = dataclasses.replace(params, drafts=drafts)
            sides[drafts].replies.append(_one(engine, messages, asked, f"{name}-{'on' if drafts else 'off'}"))
        mismatches += sides[False].replies[-1].token_ids != sides[True].replies[-1].token_ids
    off, on = sides[False].summary(), sides[True].summary()
    # NOTE: the cores are shared, and a reply that stalls behind another process weighs on the summed rate: the
    # median over the messages of each one's on / off rate (run back to back) is the steadier figure.
    pairs = zip(sides[False].replies, sides[True].replies, strict=True)
    ratios = [
        b.stats.decode_tokens_per_s / a.stats.decode_tokens_per_s for a, b in pairs if a.stats.decode_tokens_per_s
    ]
    return {
        "workload": name,
        "off": off,
        "on": on,
        "speedup": on["decode_tokens_per_s"] / off["decode_tokens_per_s"] if off["decode_tokens_per_s"] else None,
        "paired_median_speedup": statistics.median(ratios) if ratios else None,
        "mismatches": mismatches,
        "seconds": time.perf_counter() - started,
        "examples": [r.text for r in sides[True].replies[:2]],
    }
