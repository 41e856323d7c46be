"""One choice of a ``/v1`` reply as its tokens arrive: the text so far, how much of it may be streamed yet, its
logprobs; and at its end, the message (content and tool calls) and the finish reason.

With tools the model may call, text that may still turn into a call is held back (``backend/tools/parsers.py``'s
``shown_length``) and so is trailing whitespace (a call's content is stripped); a forced call shows nothing until
the end. A call is streamed once the reply is complete, in OpenAI's delta shape: a first delta with the call's
index, id, type and name, then one with its arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.engine_client.values import FinishReason, RequestFinished, TokenDelta
from backend.openai import schemas as s
from backend.openai.logprobs import TokenTexts
from backend.openai.request_plan import ToolUse
from backend.tools.parsers import parse, shown_length
from backend.tools.types import ToolCall

FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORTED: "abort"}


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a choice ended: its whole content, its calls, its finish reason, and the content not streamed yet."""

    content: str | None
    tool_calls: tuple[ToolCall, ...]
    finish_reason: str
    unshown: str


class ChoiceState:
    """Choice ``index``: fed its engine request's events in order."""

    def __init__(self, index: int, tools: ToolUse | None, texts: TokenTexts | None) -> None:
        self.index = index
        self._tools = tools
        self._texts = texts  # None: no logprobs asked for
        self.text = ""
        self.shown = 0  # characters of ``text`` streamed as content
        self.logprobs: list[s.TokenLogprobOut] = []
        self.finished: RequestFinished | None = None

    def add(self, delta: TokenDelta) -> tuple[str, list[s.TokenLogprobOut]]:
        """Take a delta; returns the content that may be streamed now, and the delta's tokens' logprobs."""
        self.text += delta.text
        entries = [self._texts.entry(lp) for lp in delta.logprobs] if self._texts is not None else []
        self.logprobs += entries
        visible = max(self.shown, self._visible())
        content, self.shown = self.text[self.shown : visible], visible
        return content, entries

    def _visible(self) -> int:
        if self._tools is None:
            return len(self.text)
        if self._tools.choice.forces_call:
            return 0
        return len(self.text[: shown_length(self.text, self._tools.family)].rstrip())

    def finish(self, done: RequestFinished) -> Outcome:
        """The choice's end (``done`` is its engine request's last event)."""
        self.finished = done
        reason = FINISH_REASONS[done.finish_reason]
        if self._tools is None:
            return Outcome(done.text, (), reason, done.text[self.shown :])
        parsed = parse(done.text, self._tools.family)
        calls = parsed.tool_calls if self._tools.parallel else parsed.tool_calls[:1]
        if not calls:
            return Outcome(done.text, (), reason, done.text[self.shown :])
        content, shown = parsed.content, self.text[: self.shown]
        unshown = content[len(shown) :] if content is not None and content.startswith(shown) else ""
        return Outcome(content, calls, "tool_calls" if done.finish_reason is FinishReason.STOP else reason, unshown)

    def choice(self, outcome: Outcome) -> s.Choice:
        """The choice of a whole (non-streamed) completion."""
        calls = [_call_out(c) for c in outcome.tool_calls] or None
        return s.Choice(
            index=self.index,
            message=s.AssistantMessage(content=outcome.content, tool_calls=calls),
            logprobs=s.ChoiceLogprobs(content=self.logprobs) if self._texts is not None else None,
            finish_reason=outcome.finish_reason,
        )

    def last_chunks(self, outcome: Outcome) -> list[s.ChunkChoice]:
        """What a stream sends at the choice's end: held-back content, its calls, then the finish reason."""
        out = [s.ChunkChoice(index=self.index, delta=s.Delta(content=outcome.unshown))] if outcome.unshown else []
        for i, call in enumerate(outcome.tool_calls):
            name = s.FunctionDelta(name=call.name, arguments="")
            head = s.ToolCallDelta(index=i, id=call.id, type="function", function=name)
            args = s.ToolCallDelta(index=i, function=s.FunctionDelta(arguments=call.arguments))
            out += [s.ChunkChoice(index=self.index, delta=s.Delta(tool_calls=[d])) for d in (head, args)]
        out.append(s.ChunkChoice(index=self.index, delta=s.Delta(), finish_reason=outcome.finish_reason))
        return out


def _call_out(call: ToolCall) -> s.ToolCallOut:
    return s.ToolCallOut(id=call.id, function=s.FunctionCallOut(name=call.name, arguments=call.arguments))
