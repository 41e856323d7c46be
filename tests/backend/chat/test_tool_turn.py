"""The tool turn on scripted model replies (the engine is the one stand-in: each request answers a given text), with
a real tool endpoint on loopback and a real database for the audit: what streams, what is held back, what the model
reads next, and what is stored for the next turn's prompt. The real model runs in ``test_ws_tools*.py``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import pytest
from sqlalchemy import select

from backend.chat.hub import SessionHub
from backend.chat.reply_setup import ReplySetup
from backend.chat.reply_stream import ReplyStreamer
from backend.chat.tool_turn import GRACEFUL_REPLY, MAX_CALLS_PER_STEP, MAX_STEPS, ToolTurn, ToolTurnResult
from backend.chat.turn_state import Turn
from backend.context.contact_guard import ContactGuard
from backend.context.contacts import ContactKind
from backend.context.grounding import Grounding
from backend.db.engine import create_db_engine, create_sessionmaker
from backend.db.models import AdminAudit
from backend.engine_client.values import (
    FairShare,
    FinishReason,
    GrammarKind,
    RequestFinished,
    RequestStats,
    SamplingParams,
    Segment,
    SegmentedPrompt,
    TokenDelta,
    TokenizedPrompt,
)
from backend.services.reply_settings import ReplySettings, ToolUse
from backend.services.tenant_tools import ToolEndpoint
from backend.services.tenants import create_tenant
from backend.services.tool_calls import ToolCaller
from backend.tools.prompt import answered
from backend.tools.types import ToolFamily
from support.tool_endpoint import ORDER, ToolServer, tool_server

pytestmark = pytest.mark.anyio
ARGS = {"type": "object", "properties": {"order_id": {"type": "string"}}}
HERMES_CALL = '<tool_call>\n{"name": "lookup_order", "arguments": {"order_id": "A1234"}}\n</tool_call>'
LLAMA3_CALL = '{"name": "lookup_order", "parameters": {"order_id": "A1234"}}'
DETAILS = "\n\nDetails: order id: A1234; status: shipped; carrier: DHL; eta: 2026-05-03."
PROMPT = SegmentedPrompt.of(("system", [Segment("Be kind.", "system_prompt")]), ("user", [Segment("Where?", "q")]))


class ScriptedEngine:
    """Answers request i with ``replies[i]``, in the given chunks; records what it was asked."""

    def __init__(self, replies: Sequence[Sequence[str]]) -> None:
        self.replies = list(replies)
        self.requests: list[tuple[str, SamplingParams]] = []
        self.tokenized: list[SegmentedPrompt] = []

    def tokenize_prompt(self, prompt: SegmentedPrompt) -> TokenizedPrompt:
        self.tokenized.append(prompt)
        return TokenizedPrompt(list(range(len(prompt.messages))))

    async def generate(
        self,
        prompt: TokenizedPrompt,
        params: SamplingParams,
        namespace: str,
        request_id: str,
        session: str,
        share: FairShare | None = None,
    ) -> AsyncIterator[TokenDelta | RequestFinished]:
        chunks = self.replies[len(self.requests)]
        self.requests.append((request_id, params))
        for chunk in chunks:
            yield TokenDelta(request_id, (0,), chunk)
        stats = RequestStats(len(prompt.token_ids), 0, len(prompt.token_ids), len(chunks), 0.0, 0.0, 0.0, 0)
        yield RequestFinished(request_id, FinishReason.STOP, "".join(chunks), (), stats)


@pytest.fixture
def endpoint() -> Iterator[ToolServer]:
    with tool_server(slow_s=1.0) as server:
        yield server


async def run(
    sqlite_url: str,
    endpoint: ToolServer,
    replies: Sequence[Sequence[str]],
    family: ToolFamily = ToolFamily.HERMES,
    settings: ReplySettings | None = None,
    grounding: Grounding | None = None,
    path: str = "/order",
) -> tuple[ToolTurnResult, Turn, list[str], ScriptedEngine]:
    db_engine = create_db_engine(sqlite_url)
    try:
        sessionmaker = create_sessionmaker(db_engine)
        async with sessionmaker() as db:
            tenant = await create_tenant(db, "shop")
            await db.commit()
        engine = ScriptedEngine(replies)
        hub = SessionHub()
        frames: list[Any] = []
        hub.subscribe("s1", frames.append)
        caller = ToolCaller(sessionmaker, allow_private_networks=True)
        streamer = ReplyStreamer(engine, hub)  # type: ignore[arg-type]
        tool_turn = ToolTurn(engine, streamer, caller)  # type: ignore[arg-type]
        tool = ToolEndpoint("lookup_order", "Find an order.", ARGS, endpoint.url(path), None, None, 2.0)
        setup = ReplySetup(settings or ReplySettings(), (tool,))
        turn = Turn("s1", tenant.id, "m1", 1)
        turn.guard = ContactGuard(grounding) if grounding is not None else None
        result = await tool_turn.run(turn, PROMPT, engine.tokenize_prompt(PROMPT), setup, family, 64, 1000)
        streamer.settle(turn)  # (the turn's end: TurnPath._store)
    finally:
        await db_engine.dispose()
    return result, turn, [f.text for f in frames], engine


async def test_text_before_a_call_streams_the_call_never_does(sqlite_url: str, endpoint: ToolServer) -> None:
    call_chunks = ["Let me check.", " <tool", HERMES_CALL.removeprefix("<tool")]
    result, turn, deltas, engine = await run(sqlite_url, endpoint, [call_chunks, ["It has ", "shipped."]])
    # " <tool" may begin a call: its space shows, the rest is held back, and so is the whole call
    assert deltas == ["Let me check.", " ", "It has ", "shipped.", DETAILS]
    assert turn.text == "Let me check. It has shipped." + DETAILS
    assert [r.body for r in endpoint.received] == [{"order_id": "A1234"}]
    # the model goes on from the prompt with its call and the result appended, as a new request
    call = result.exchange.steps[0].calls[0] if result.exchange else None
    assert call is not None and (call.name, json.loads(call.arguments)) == ("lookup_order", {"order_id": "A1234"})
    expected = answered(PROMPT, "Let me check.", [call], [json.dumps(ORDER)], ToolFamily.HERMES)
    assert engine.tokenized[-1] == expected
    assert len({request_id for request_id, _ in engine.requests}) == 2 and turn.request_id == engine.requests[1][0]
    # stored: the step, and where the answer starts; written back, the step is what the model read
    assert result.exchange is not None and result.exchange.answer_from == len("Let me check. ")
    assert result.exchange.messages(ToolFamily.HERMES) == expected.messages[len(PROMPT.messages) :]
    assert result.exchange.answer(turn.text) == "It has shipped." + DETAILS


async def test_the_guard_settles_before_a_call_and_reads_the_results(sqlite_url: str, endpoint: ToolServer) -> None:
    """The number the text before a call ends in is shown when the call comes (before the line break); the answer
    may repeat the result's order id, not an invented URL or number."""
    sources = Grounding(("Call 555-123-4567.",))
    call_chunks = ["Let me check, call 555-123-4567", HERMES_CALL]
    answer = ["Order A1234: see www.fake.com", " or 1-800-999-0000."]
    _, turn, deltas, _ = await run(sqlite_url, endpoint, [call_chunks, answer], grounding=sources)
    assert deltas == [
        "Let me check, call ",
        "555-123-4567",
        "\n\n",
        "Order A1234: see ",
        "[link removed] or ",
        # the details line joins the held tail; its date's tail is held to the end (it could still be a number)
        "[number removed]." + DETAILS.removesuffix("2026-05-03."),
        "2026-05-03.",
    ]
    assert turn.text == "".join(deltas)
    assert turn.guard is not None and turn.guard.blocked == {ContactKind.URL: 1, ContactKind.PHONE: 1}


async def test_a_url_from_this_turns_tool_result_passes(sqlite_url: str, endpoint: ToolServer) -> None:
    answer = ["Track it at https://track.example.net/A1234", " (not https://track.example.net/B9)."]
    _, turn, _, _ = await run(sqlite_url, endpoint, [[HERMES_CALL], answer], grounding=Grounding(), path="/tracking")
    assert turn.text.startswith("Track it at https://track.example.net/A1234 (not [link removed]).\n\nDetails: ")


async def test_a_llama3_call_is_held_back_whole(sqlite_url: str, endpoint: ToolServer) -> None:
    result, _turn, deltas, _ = await run(
        sqlite_url, endpoint, [["{", LLAMA3_CALL[1:]], ["Shipped."]], ToolFamily.LLAMA3_JSON
    )
    assert deltas == ["Shipped.", DETAILS]
    assert result.exchange is not None and result.exchange.answer_from == 0


async def test_a_reply_without_a_call_shows_what_was_held_back(sqlite_url: str, endpoint: ToolServer) -> None:
    result, turn, deltas, _ = await run(sqlite_url, endpoint, [["Use the form ", "<", "a> link."]])
    assert deltas == ["Use the form ", "<a> link."]
    assert (turn.text, result.exchange, endpoint.received) == ("Use the form <a> link.", None, [])


async def tool_audit(sqlite_url: str) -> list[tuple[str, str, str | None, str, str | None]]:
    db_engine = create_db_engine(sqlite_url)
    try:
        async with create_sessionmaker(db_engine)() as db:
            rows = (await db.execute(select(AdminAudit).order_by(AdminAudit.id))).scalars().all()
    finally:
        await db_engine.dispose()
    return [(r.actor, r.action, r.target, r.result, r.detail) for r in rows]


async def test_a_call_that_does_not_parse_gets_the_graceful_reply(sqlite_url: str, endpoint: ToolServer) -> None:
    result, _turn, deltas, _ = await run(sqlite_url, endpoint, [["<tool_call>\n{not json}\n</tool_call>"]])
    assert deltas == [GRACEFUL_REPLY]
    assert (result.exchange, endpoint.received) == (None, [])
    # attempted, though not made: audited like every call
    detail = "session s1: a call that does not parse: '<tool_call>\\n{not json}\\n</tool_call>'"
    assert await tool_audit(sqlite_url) == [("bot", "tool.call", "(unparsed)", "unparsed", detail)]


async def test_a_model_that_keeps_calling_gets_the_graceful_reply(sqlite_url: str, endpoint: ToolServer) -> None:
    result, _turn, deltas, engine = await run(sqlite_url, endpoint, [[HERMES_CALL]] * (MAX_STEPS + 1))
    assert deltas == [GRACEFUL_REPLY]
    assert len(endpoint.received) == MAX_STEPS == len(result.exchange.steps if result.exchange else ())
    assert len(engine.requests) == MAX_STEPS + 1
    audited = [(target, outcome, detail) for _, _, target, outcome, detail in await tool_audit(sqlite_url)]
    assert [(target, outcome) for target, outcome, _ in audited] == [("lookup_order", "ok")] * MAX_STEPS + [
        ("lookup_order", "over_limit")
    ]
    assert audited[-1][2] == f"session s1: not made: still calling tools after {MAX_STEPS} steps"


async def test_calls_past_the_step_limit_are_audited_not_made(sqlite_url: str, endpoint: ToolServer) -> None:
    many = [HERMES_CALL] * (MAX_CALLS_PER_STEP + 1)
    await run(sqlite_url, endpoint, [["\n".join(many)], ["Shipped."]])
    assert len(endpoint.received) == MAX_CALLS_PER_STEP
    outcomes = [(target, outcome, detail) for _, _, target, outcome, detail in await tool_audit(sqlite_url)]
    assert [o[:2] for o in outcomes] == [("lookup_order", "ok")] * MAX_CALLS_PER_STEP + [("lookup_order", "over_limit")]
    assert outcomes[-1][2] == f"session s1: not made: more than {MAX_CALLS_PER_STEP} calls in one step"


async def test_a_required_call_is_held_to_the_grammar_without_penalties(sqlite_url: str, endpoint: ToolServer) -> None:
    settings = ReplySettings(repetition_penalty=1.2, tool_use=ToolUse.REQUIRED)
    _, turn, _, engine = await run(sqlite_url, endpoint, [[HERMES_CALL], ["Shipped."]], settings=settings)
    (_, call), (_, answer) = engine.requests
    assert call.structured is not None and call.structured.kind is GrammarKind.LARK
    assert '"const": "lookup_order"' in call.structured.spec
    assert call.repetition_penalty == 1.0
    assert (answer.structured, answer.repetition_penalty) == (None, 1.2)
    assert turn.text == "Shipped." + DETAILS
