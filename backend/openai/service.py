"""The service behind ``/v1``: request → engine prompt and ``SamplingParams``, then a completion or an SSE stream.

Requests are stateless (no chat-session rows) but run in the tenant's cache namespace — the one the websocket chat
uses — so a client that re-sends a growing conversation gets prefix hits, and two tenants never share cached tokens
(unless both opted into the public namespace).

The served model id is ``"kvchat/" + <the engine's model name>``: the name the engine was configured with
(``smollm2`` for the default model) or, for a path, its last component without ``.gguf``. Requests may name it, or
the alias ``default``; any other model is a 404 ``model_not_found``.

A request is checked and planned by ``request_plan.py``; its conversation is written in the model family's tool
format (``backend/tools``: tool calls and results of the history, and the tools offered); each of its ``n`` choices
is an engine request (``choice.py`` follows one, ``stream.py`` reads them together).

With the tenant's ``v1_contact_guard`` on, each choice's content passes a contact guard grounded in the tenant's
system prompt and policy text and the request's messages (``backend/context/contact_guard.py``).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from functools import cached_property

from backend.context.contact_guard import ContactGuard
from backend.context.contacts import ContactKind
from backend.context.grounding import Grounding
from backend.context.stateless import segment_messages
from backend.core import admission
from backend.core.metrics import Metrics
from backend.core.offload import run_cpu
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import (
    EngineError,
    FairShare,
    GenerationEvent,
    InvalidSamplingParamsError,
    RequestFinished,
    RequestStats,
    TokenDelta,
    TokenizedPrompt,
)
from backend.openai import schemas as s
from backend.openai.choice import ChoiceState
from backend.openai.errors import OpenAIError, from_engine_error, too_long_before_tokenizing
from backend.openai.logprobs import TokenTexts
from backend.openai.prompt_guard import counted_floor
from backend.openai.reply import Reply
from backend.openai.request_plan import DEFAULT_MAX_N, RequestPlan, plan, sampling_params
from backend.openai.stream import DONE, KEEPALIVE, EventStreamResponse, merged, sse
from backend.tools.family import detect_family
from backend.tools.prompt import offer, render
from backend.tools.types import ToolError, ToolFamily, ToolSpec

MODEL_ALIAS = "default"
KEEPALIVE_S = 15.0  # an SSE comment after this much silence keeps proxies and clients from timing out
DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there
_STARTED = int(time.time())


@dataclass(frozen=True, slots=True)
class _Meta:
    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool


@dataclass(slots=True)
class _Run:
    """One request's choices: an engine request each, their first events (already read), their states."""

    meta: _Meta
    replies: list[Reply]
    firsts: list[GenerationEvent]
    states: list[ChoiceState]

    async def close(self) -> None:
        for reply in self.replies:
            await reply.close()


class ChatCompletions:
    """The ``/v1`` service of one app: the served model, and chat completions run on its engine."""

    def __init__(
        self,
        engine: EngineClient,
        model_id: str,
        metrics: Metrics | None = None,
        keepalive_s: float = KEEPALIVE_S,
        disconnect_poll_s: float = DISCONNECT_POLL_S,
        max_n: int = DEFAULT_MAX_N,
    ) -> None:
        self.engine = engine
        self.model_id = model_id  # served_model_id(the configured model)
        self.metrics = metrics
        self.keepalive_s = keepalive_s
        self.disconnect_poll_s = disconnect_poll_s
        self.max_n = max_n

    @cached_property
    def tool_family(self) -> ToolFamily:
        """The format the served model writes tool calls in (read from its chat template, once)."""
        return detect_family(getattr(self.engine.tokenizer.hf, "chat_template", None))

    @cached_property
    def _token_texts(self) -> TokenTexts:
        return TokenTexts(self.engine.tokenizer)

    def model_card(self, model: str | None = None) -> s.ModelCard:
        """The served model's card; ``model`` (when given) must name it or the alias (a 404 ``model_not_found``)."""
        if model is not None:
            self._check_model(model)
        n = self.engine.info.max_model_len
        return s.ModelCard(id=self.model_id, created=_STARTED, max_model_len=n, context_length=n)

    def _check_model(self, model: str) -> None:
        if model not in (self.model_id, MODEL_ALIAS):
            raise OpenAIError(
                404,
                f"The model {model!r} does not exist; this server serves {self.model_id!r} (alias {MODEL_ALIAS!r}).",
                "model_not_found",
                param="model",
            )

    async def create(
        self,
        req: s.ChatCompletionRequest,
        tenant_id: str,
        namespace: str,
        is_disconnected: Callable[[], Awaitable[bool]],
        grounding: Grounding | None = None,
        drafts: bool | None = None,
    ) -> s.ChatCompletion | EventStreamResponse:
        """Run one chat completion in the tenant's cache namespace: the whole reply, or an SSE stream of it.

        Raises ``OpenAIError`` / ``EngineError`` before any byte is sent: a stream starts once the engine gave the
        first event of every choice, so a request the engine refuses (busy, too long) is an HTTP error, not an SSE
        one. With ``grounding`` (the tenant's texts), the content passes the contact guard. ``drafts``: the tenant's
        suffix-drafts choice (None: the engine's switch); the request's own ``drafts`` field wins.
        """
        run = await self._start(req, tenant_id, namespace, grounding, drafts)
        if not req.stream:
            return await self._complete(run, is_disconnected)
        return EventStreamResponse(self._events(run), on_close=run.close)

    async def _start(
        self,
        req: s.ChatCompletionRequest,
        tenant_id: str,
        namespace: str,
        grounding: Grounding | None,
        drafts: bool | None = None,
    ) -> _Run:
        """Check, render and tokenize, then open the choices' engine requests and read their first events."""
        self._check_model(req.model)
        planned = plan(req, self.tool_family, self.engine.info.vocab_size, self.max_n)
        if grounding is not None and planned.top_logprobs is not None:
            # NOTE: the logprobs carry each sampled token's text: they would show what the guard leaves out.
            raise OpenAIError(
                400,
                "logprobs are not available while the tenant's contact guard is on",
                "invalid_request",
                param="logprobs",
            )
        try:
            messages = render(planned.turns, (), self.tool_family)
        except ToolError as exc:
            raise OpenAIError(400, str(exc), "invalid_request", param=exc.param) from None
        floor, limit = self.engine.prompt_token_floor(m["content"] for m in messages), self.engine.prompt_limit
        if floor >= limit:
            raise too_long_before_tokenizing(floor, limit)
        # NOTE: off the event loop, in the tenant's turn on the backend's CPU workers: a long prompt takes
        # milliseconds to render and encode, and the loop serves every socket and probe of the process meanwhile.
        offered = planned.tools.offered if planned.tools is not None else ()
        admission.started()  # (this request's part on the loop is done: the next admitted one may start)
        prompt = await run_cpu(tenant_id, self._tokenize, messages, offered)
        params = sampling_params(req, planned, len(prompt.token_ids), limit, drafts)
        meta = _Meta(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_id,
            fingerprint="fp_" + self.engine.info.fingerprint[:16],
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )
        texts = self._token_texts if planned.top_logprobs is not None else None
        if grounding is not None:
            grounding = grounding.with_texts(*(m["content"] for m in messages))
        states = [ChoiceState(i, planned.tools, texts, self._guard(grounding)) for i in range(planned.n)]
        run = _Run(meta, [], [], states)
        try:
            # NOTE: choice 0 first: once its first token is out, its prompt's full blocks are in the prefix cache,
            # and the other choices prefill only the rest.
            for i, choice_params in enumerate(params.choices(planned.n)):
                request_id = meta.id if i == 0 else f"{meta.id}-{i}"
                timer = self.metrics.reply_timer(tenant_id) if self.metrics else None
                share = FairShare(tenant_id)  # (weighted, or refused, by the tenants' quotas: core/tenant_quota.py)
                events = self.engine.generate(prompt, choice_params, namespace, request_id=request_id, share=share)
                run.replies.append(Reply(self.engine, request_id, events, timer))
                if i == 0:
                    run.firsts.append(await self._first(run.replies[0], planned))
            run.firsts += [await self._first(reply, planned) for reply in run.replies[1:]]
        except BaseException:
            await run.close()
            raise
        return run

    def _guard(self, grounding: Grounding | None) -> ContactGuard | None:
        return ContactGuard(grounding, self._blocked) if grounding is not None else None

    def _blocked(self, kind: ContactKind) -> None:
        if self.metrics is not None:
            self.metrics.contacts_blocked.labels(kind.value).inc()

    def _tokenize(self, messages: list[dict[str, str]], offered: Sequence[ToolSpec]) -> TokenizedPrompt:
        """The messages, split into semantic blocks (so cache stats count them by type), with the tools offered
        where the model's family lists them, and tokenized; a prompt far over the context is refused after a count
        that leaves the GIL free (``prompt_guard``)."""
        floor, limit = counted_floor(self.engine, [m["content"] for m in messages]), self.engine.prompt_limit
        if floor is not None and floor >= limit:
            raise too_long_before_tokenizing(floor, limit)
        try:
            prompt = offer(segment_messages(messages), offered, self.tool_family)
        except ToolError as exc:
            raise OpenAIError(400, str(exc), "invalid_request", param=exc.param) from None
        return self.engine.tokenize_prompt(prompt)

    @staticmethod
    async def _first(reply: Reply, planned: RequestPlan) -> GenerationEvent:
        """A choice's first event; a grammar the engine refuses is a 400 naming where it came from."""
        try:
            event = await reply.next()
        except InvalidSamplingParamsError as exc:
            raise OpenAIError(400, str(exc), "invalid_request", param=planned.grammar_param) from None
        assert event is not None  # NOTE: a read without a timeout always returns an event
        return event

    async def _complete(self, run: _Run, is_disconnected: Callable[[], Awaitable[bool]]) -> s.ChatCompletion:
        outcomes: dict[int, s.Choice] = {}
        checked = time.monotonic()
        try:
            async with aclosing(merged(run.replies, run.firsts, self.disconnect_poll_s)) as items:
                async for item in items:
                    if item is not None:
                        i, event = item
                        state = run.states[i]
                        if isinstance(event, TokenDelta):
                            state.add(event)
                        else:
                            outcomes[i] = state.choice(state.finish(event))
                    if item is None or time.monotonic() - checked >= self.disconnect_poll_s:
                        checked = time.monotonic()
                        if await is_disconnected():
                            raise OpenAIError(499, "the client closed the request", "client_closed_request")
        except EngineError as exc:
            raise from_engine_error(exc) from exc
        finally:
            await run.close()
        return s.ChatCompletion(
            id=run.meta.id,
            created=run.meta.created,
            model=run.meta.model,
            system_fingerprint=run.meta.fingerprint,
            choices=[outcomes[i] for i in range(len(run.states))],
            usage=usage(run.states),
        )

    async def _events(self, run: _Run) -> AsyncIterator[str]:
        """SSE: a role chunk per choice, content chunks (with logprobs), each choice's last chunks (held-back text,
        tool calls, finish reason), [a usage chunk], ``[DONE]``; comments while silent."""
        meta = run.meta
        try:
            for state in run.states:
                yield sse(_chunk(meta, [s.ChunkChoice(index=state.index, delta=s.Delta(role="assistant", content=""))]))
            try:
                async with aclosing(merged(run.replies, run.firsts, self.keepalive_s)) as items:
                    async for item in items:
                        for frame in self._frames(run, item):
                            yield frame
            except EngineError as exc:
                yield sse(from_engine_error(exc).body)
            else:
                if meta.include_usage:
                    yield sse(_chunk(meta, []).model_copy(update={"usage": usage(run.states)}))
            yield DONE
        finally:
            await run.close()

    @staticmethod
    def _frames(run: _Run, item: tuple[int, GenerationEvent] | None) -> list[str]:
        """The SSE frames one event of choice ``i`` (or a silence) makes."""
        if item is None:
            return [KEEPALIVE]
        i, event = item
        state = run.states[i]
        if not isinstance(event, TokenDelta):
            return [sse(_chunk(run.meta, [last])) for last in state.last_chunks(state.finish(event))]
        content, entries = state.add(event)
        if not content and not entries:
            return []
        logprobs = s.ChoiceLogprobs(content=entries) if entries else None
        return [
            sse(_chunk(run.meta, [s.ChunkChoice(index=i, delta=s.Delta(content=content or None), logprobs=logprobs)]))
        ]


def usage(states: Sequence[ChoiceState]) -> s.Usage:
    """The prompt once (choice 0's: the other choices reuse its cached blocks), the completions of every choice."""
    stats = [_stats(st.finished) for st in states]
    prompt, completion = stats[0].prompt_tokens, sum(st.completion_tokens for st in stats)
    return s.Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=s.PromptTokensDetails(cached_tokens=stats[0].cached_tokens),
    )


def _stats(done: RequestFinished | None) -> RequestStats:
    assert done is not None  # NOTE: usage is only asked for once every choice has finished
    return done.stats


def _chunk(meta: _Meta, choices: list[s.ChunkChoice]) -> s.ChatCompletionChunk:
    return s.ChatCompletionChunk(
        id=meta.id, created=meta.created, model=meta.model, system_fingerprint=meta.fingerprint, choices=choices
    )
