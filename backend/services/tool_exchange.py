"""A reply's tool calls and their results, as stored with the reply (``messages.tool_exchange``, JSON) and written
back into the prompts of the turns after it.

A tool turn runs in steps: the model writes calls (after some text, or none), the bot makes them, the model reads
the results; then it writes the answer. ``answer_from`` is where the answer starts in the stored reply: any text the
model wrote before its first call was already shown to the customer, so the stored reply is that text, then the
answer.

``messages`` writes the steps as ``backend/tools/prompt.answered`` appended them during the turn (the model family's
own format), so a later prompt holds, token for token, the prompt the answer was generated from, and the prefix
cache serves it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from backend.engine_client.values import SegmentedMessage, SegmentedPrompt
from backend.tools.prompt import answered
from backend.tools.types import ToolCall, ToolFamily


@dataclass(frozen=True, slots=True)
class ToolStep:
    content: str  # the model's text before its calls ("" when the reply began with a call)
    calls: tuple[ToolCall, ...]
    results: tuple[str, ...]  # what the model read back, one per call


@dataclass(frozen=True, slots=True)
class ToolExchange:
    steps: tuple[ToolStep, ...]
    answer_from: int = 0  # the answer's first character in the stored reply

    def messages(self, family: ToolFamily) -> tuple[SegmentedMessage, ...]:
        """The steps as the messages the answer was generated after."""
        prompt = SegmentedPrompt(())
        for step in self.steps:
            prompt = answered(prompt, step.content, step.calls, step.results, family)
        return prompt.messages

    def answer(self, reply: str) -> str:
        """The answer part of a stored ``reply``."""
        return reply[self.answer_from :]

    def to_json(self) -> str:
        steps = [
            {
                "content": s.content,
                "calls": [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in s.calls],
                "results": list(s.results),
            }
            for s in self.steps
        ]
        return json.dumps({"steps": steps, "answer_from": self.answer_from}, ensure_ascii=False)

    @classmethod
    def from_json(cls, raw: str) -> ToolExchange:
        """The stored value (``ValueError`` when it is not one)."""
        try:
            value = json.loads(raw)
            steps = tuple(
                ToolStep(
                    str(s["content"]),
                    tuple(ToolCall(str(c["name"]), str(c["arguments"]), str(c["id"])) for c in s["calls"]),
                    tuple(str(r) for r in s["results"]),
                )
                for s in value["steps"]
            )
            return cls(steps, int(value["answer_from"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a stored tool exchange: {exc!r}") from None
