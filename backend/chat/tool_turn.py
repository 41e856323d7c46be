"""A turn that offers the tenant's tools (``backend/chat/reply_setup.py``): the model may call them (or must, with
the tenant's ``tool_use`` ``required``), the bot makes the calls, the model reads the results and answers.

Each step, at most ``MAX_STEPS`` of calls:

1. the model replies to the prompt with the tools offered (``backend/tools/prompt.offer``, in its family's format).
   With ``required``, the first reply is held by a grammar to one call of one of the tools
   (``backend/tools/grammar.py``), with the penalties off: a call copies names and numbers from the conversation,
   which a repetition penalty would bend;
2. the reply is parsed in the family's format (``backend/tools/parsers.py``); without a call it is the answer;
3. each call is one HTTP request, bounded by the tool's timeout and audited (``backend/services/tool_calls.py``);
4. the calls and results are appended to the prompt as the family's template writes them (``prompt.answered``) and
   the model goes on: the prefix cache serves everything before them.

The customer sees the text as it streams, except what is, or may still become, a call (``reply_stream.py``): a
call's text is never shown. After an answer that read results, the results' values are added as one line
(``tool_facts.py``): a small model's answer cannot be relied on to carry them. A fixed, graceful reply
(``GRACEFUL_REPLY``) replaces the answer when a call fails (a timeout, an HTTP error, a body that is not JSON, an
unknown tool, bad arguments: each audited), when the model's call does not parse (no call is made; logged), when it
still calls after ``MAX_STEPS``, or when the results would not fit the model's context. The model is not asked to
answer after a failure: a small model then makes the data up.

The steps are stored with the reply (``backend/services/tool_exchange.py``): the next turn's prompt writes them
before the answer, so it extends this turn's last prompt and reuses its cached blocks.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from dataclasses import dataclass

from backend.chat.reply_setup import ReplySetup
from backend.chat.reply_stream import ReplyStreamer, Streamed
from backend.chat.tool_facts import details_line
from backend.chat.turn_state import Turn, new_request_id
from backend.core.offload import run_cpu
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import (
    FinishReason,
    GrammarKind,
    RequestFinished,
    SamplingParams,
    SegmentedPrompt,
    StructuredOutput,
    TokenizedPrompt,
)
from backend.services.reply_settings import ToolUse
from backend.services.tool_calls import UNPARSED_TARGET, CallOutcome, ToolCaller, ToolResult
from backend.services.tool_exchange import ToolExchange, ToolStep
from backend.tools.grammar import call_grammar
from backend.tools.parsers import HERMES_OPEN, parse, shown_length
from backend.tools.prompt import answered
from backend.tools.types import ParsedReply, ToolFamily

log = logging.getLogger("kvchat.chat.tools")

MAX_STEPS = 2  # steps of calls in one turn
MAX_CALLS_PER_STEP = 4
GRACEFUL_REPLY = "I'm sorry, I couldn't look that up just now. Please try again in a moment, or ask for a human agent."


@dataclass(frozen=True, slots=True)
class ToolTurnResult:
    finished: RequestFinished | None  # the last engine request's (None: cancelled between steps)
    exchange: ToolExchange | None  # the steps of calls, to store with the reply (None: no call was made)


@dataclass(slots=True)
class _Progress:
    prompt: SegmentedPrompt
    tokenized: TokenizedPrompt
    steps: list[ToolStep] = dataclasses.field(default_factory=list)
    answer_from: int = 0

    def exchange(self) -> ToolExchange | None:
        return ToolExchange(tuple(self.steps), self.answer_from) if self.steps else None


class ToolTurn:
    def __init__(self, engine: EngineClient, streamer: ReplyStreamer, caller: ToolCaller) -> None:
        self._engine = engine
        self._streamer = streamer
        self._caller = caller

    async def run(
        self,
        turn: Turn,
        prompt: SegmentedPrompt,
        tokenized: TokenizedPrompt,
        setup: ReplySetup,
        family: ToolFamily,
        max_tokens: int,
        limit: int,
    ) -> ToolTurnResult:
        """Reply to ``prompt`` (the tools offered; ``tokenized`` its ids); ``limit``: the prompt tokens allowed."""
        progress = _Progress(prompt, tokenized)
        hold = functools.partial(shown_length, family=family)
        for step in range(MAX_STEPS + 1):
            forced = step == 0 and setup.settings.tool_use is ToolUse.REQUIRED
            params = _params(setup, family, max_tokens, forced)
            streamed = await self._streamer.stream(turn, progress.tokenized, params, hold)
            finished = streamed.finished
            if finished is None or finished.finish_reason is FinishReason.ABORTED or turn.interrupted:
                return ToolTurnResult(finished, progress.exchange())
            parsed = parse(streamed.text, family)
            if not parsed.tool_calls:
                await self._answered(turn, streamed, family, progress)
                return ToolTurnResult(finished, progress.exchange())
            if step == MAX_STEPS:
                log.warning("turn %s/%s: still calling tools after %d steps", turn.session_id, turn.client_msg_id, step)
                for call in parsed.tool_calls:
                    await self._over_limit(turn, call.name, f"still calling tools after {step} steps")
                self._graceful(turn, progress)
                return ToolTurnResult(finished, progress.exchange())
            if not await self._call(turn, parsed, setup, family, progress, limit):
                return ToolTurnResult(finished, progress.exchange())
            # NOTE: the calls took time: a cancel or a drain may have come; else the next request gets a new id
            # (the one a cancel aborts from now on), set before the stream starts, with no await in between.
            if turn.cancelled or turn.interrupted:
                return ToolTurnResult(None, progress.exchange())
            turn.request_id = new_request_id()
        raise AssertionError("unreachable: the last step answers or gives up")

    async def _call(
        self, turn: Turn, parsed: ParsedReply, setup: ReplySetup, family: ToolFamily, progress: _Progress, limit: int
    ) -> bool:
        """Make the step's calls (one after another) and append them and their results to the prompt; False when the
        turn ended with the graceful reply instead."""
        endpoints = {t.name: t for t in setup.tools}
        done: list[ToolResult] = []
        for call in parsed.tool_calls[:MAX_CALLS_PER_STEP]:
            done.append(await self._caller.call(turn.tenant_id, turn.session_id, endpoints, call))
        for call in parsed.tool_calls[MAX_CALLS_PER_STEP:]:
            await self._over_limit(turn, call.name, f"more than {MAX_CALLS_PER_STEP} calls in one step")
        step = ToolStep(parsed.content or "", tuple(r.call for r in done), tuple(_read_back(r) for r in done))
        progress.steps.append(step)
        if turn.guard is not None:
            turn.guard.add_sources(step.results)
        if not all(r.ok for r in done):
            self._graceful(turn, progress)
            return False
        progress.prompt = answered(progress.prompt, step.content, step.calls, step.results, family)
        progress.tokenized = await run_cpu(turn.tenant_id, self._engine.tokenize_prompt, progress.prompt)
        if len(progress.tokenized.token_ids) > limit:
            log.warning("turn %s/%s: the tool results do not fit the context", turn.session_id, turn.client_msg_id)
            self._graceful(turn, progress)
            return False
        progress.answer_from = self._begin_answer(turn)
        return True

    async def _over_limit(self, turn: Turn, name: str, why: str) -> None:
        await self._caller.not_made(turn.tenant_id, turn.session_id, name, CallOutcome.OVER_LIMIT, f"not made: {why}")

    async def _answered(self, turn: Turn, streamed: Streamed, family: ToolFamily, progress: _Progress) -> None:
        """A reply without a call: show what was held back, unless it was a call that does not parse (audited, as
        every call the model attempts is)."""
        held = streamed.text[streamed.shown :]
        if _opens_call(held, family):
            log.info("turn %s/%s: a tool call that does not parse: %.200r", turn.session_id, turn.client_msg_id, held)
            detail = f"a call that does not parse: {held[:300]!r}"
            await self._caller.not_made(turn.tenant_id, turn.session_id, UNPARSED_TARGET, CallOutcome.UNPARSED, detail)
            self._graceful(turn, progress)
            return
        self._streamer.publish(turn, held)
        if not progress.steps:
            return
        line = details_line([r for s in progress.steps for r in s.results])
        if line:
            self._streamer.publish(turn, "\n\n" + line)

    def _graceful(self, turn: Turn, progress: _Progress) -> None:
        progress.answer_from = self._begin_answer(turn)
        self._streamer.publish(turn, GRACEFUL_REPLY)

    def _begin_answer(self, turn: Turn) -> int:
        """Where the answer starts in the stored reply (after the text shown before a call, and a line break)."""
        self._streamer.settle(turn)
        if turn.text and not turn.text[-1].isspace():
            self._streamer.publish(turn, "\n\n")
        return len(turn.text)


def _params(setup: ReplySetup, family: ToolFamily, max_tokens: int, forced: bool) -> SamplingParams:
    settings = setup.settings
    if not forced:
        return settings.params(max_tokens)
    calm = dataclasses.replace(settings, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0)
    grammar = call_grammar([t.spec() for t in setup.tools], family, parallel=False)
    return calm.params(max_tokens, StructuredOutput(GrammarKind.LARK, grammar))


def _read_back(result: ToolResult) -> str:
    """What the model reads for a call: the endpoint's JSON, or what went wrong."""
    return result.content if result.ok else json.dumps({"error": result.outcome.value})


def _opens_call(text: str, family: ToolFamily) -> bool:
    if family is ToolFamily.LLAMA3_JSON:
        return text.lstrip().startswith("{")
    return HERMES_OPEN in text
