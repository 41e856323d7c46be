"""One choice of a ``/v1`` reply as its tokens arrive: the text so far, how much of it may be streamed yet, its
logprobs; and at its end, the message (content and tool calls) and the finish reason.

With tools the model may call, text that may still turn into a call is held back (``backend/tools/parsers.py``'s
``shown_length``) and so is trailing whitespace (a call's content is stripped); a forced call shows nothing until
the end. A call is streamed once the reply is complete, in OpenAI's delta shape: a first delta with the call's
index, id, type and name, then one with its arguments.

With the tenant's ``v1_contact_guard`` on, the content passes a contact guard (``backend/context/contact_guard.py``)
as it streams: what it holds back comes with the choice's last chunks, and a whole completion's content is what a
stream would have sent. A call's arguments are not guarded: they are the client's to check.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend.context.contact_guard import ContactGuard, guarded
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

    def __init__(
        self, index: int, tools: ToolUse | None, texts: TokenTexts | None, guard: ContactGuard | None = None
    ) -> None:
        self.index = index
        self._tools = tools
        self._texts = texts  # None: no logprobs asked for
        self._guard = guard
        self._sent = ""  # the content streamed (``text[:shown]`` through the guard)
        self.text = ""
        self.shown = 0  # characters of ``text`` streamed as content (through the guard, when there is one)
        self.logprobs: list[s.TokenLogprobOut] = []
        self.finished: RequestFinished | None = None

    def add(self, delta: TokenDelta) -> tuple[str, list[s.TokenLogprobOut]]:
        """Take a delta; returns the content that may be streamed now, and the delta's tokens' logprobs."""
        self.text += delta.text
        entries = [self._texts.entry(lp) for lp in delta.logprobs] if self._texts is not None else []
        self.logprobs += entries
        visible = max(self.shown, self._visible())
        content, self.shown = self.text[self.shown : visible], visible
        if self._guard is not None:
            content = self._guard.feed(content)
            self._sent += content
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
        outcome = self._outcome(done)
        if self._guard is None or outcome.content is None:
            return outcome
        whole = self.text[: self.shown] + outcome.unshown
        unshown = self._guard.feed(outcome.unshown) + self._guard.flush()
        # NOTE: the content is what the stream sent; a call's content that is not the streamed text plus the rest
        # (a parser that trimmed it) is checked whole.
        content = self._sent + unshown if whole == outcome.content else guarded(outcome.content, self._guard.grounding)
        return Outcome(content, outcome.tool_calls, outcome.finish_reason, unshown)

    def _outcome(self, done: RequestFinished) -> Outcome:
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
