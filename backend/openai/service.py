"""The service behind ``/v1``: request → engine prompt and ``SamplingParams``, then a completion or an SSE stream.

Requests are stateless (no chat-session rows) but run in the tenant's cache namespace — the one the websocket chat
uses — so a client that re-sends a growing conversation gets prefix hits, and two tenants never share cached tokens
(unless both opted into the public namespace).

The served model id is ``"kvchat/" + <the engine's model name>``: the name the engine was configured with
(``smollm2`` for the default model) or, for a path, its last component without ``.gguf``. Requests may name it, or
the alias ``default``; any other model is a 404 ``model_not_found``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from backend.context.stateless import segment_messages
from backend.core.metrics import Metrics
from backend.core.offload import run_cpu
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import (
    EngineError,
    FinishReason,
    GenerationEvent,
    PromptTooLongError,
    RequestFinished,
    SamplingParams,
    TokenDelta,
    TokenizedPrompt,
)
from backend.openai import schemas as s
from backend.openai.errors import OpenAIError, from_engine_error, too_long_before_tokenizing, unsupported
from backend.openai.prompt_guard import counted_floor
from backend.openai.reply import Reply

MODEL_ALIAS = "default"
KEEPALIVE_S = 15.0  # an SSE comment after this much silence keeps proxies and clients from timing out
DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there
_STARTED = int(time.time())
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORTED: "abort"}


def served_model_id(model: str) -> str:
    """The id ``/v1`` serves the configured ``model`` under (``KVCHAT_MODEL``: a name or a path)."""
    return "kvchat/" + Path(model).name.removesuffix(".gguf")


def chat_messages(messages: list[s.ChatMessageIn]) -> list[dict[str, str]]:
    """OpenAI messages → the engine's ``{"role", "content"}`` dicts (text only; ``developer`` is a system message)."""
    out = []
    for i, m in enumerate(messages):
        if m.role in ("tool", "function") or m.tool_calls:
            raise unsupported(f"messages[{i}]", "tool and function calling are not supported by kvchat")
        role = "system" if m.role == "developer" else m.role
        out.append({"role": role, "content": _text(m, i)})
    return out


def _text(m: s.ChatMessageIn, i: int) -> str:
    if m.content is None:
        if m.role == "assistant":
            return ""
        raise OpenAIError(400, f"messages[{i}].content is required for a {m.role} message", "invalid_request")
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise unsupported(f"messages[{i}].content", f"content parts of type {part.type!r} are not supported")
        texts.append(part.text)
    return "\n".join(texts)


def check_supported(req: s.ChatCompletionRequest) -> None:
    if req.n not in (None, 1):
        raise unsupported("n", "only n=1 is supported")
    if req.logprobs or req.top_logprobs:
        raise unsupported("logprobs", "logprobs are not supported by kvchat")
    if req.tools or req.functions:
        raise unsupported("tools", "tool and function calling are not supported by kvchat")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise unsupported("response_format", "only response_format {'type': 'text'} is supported")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name):
            raise unsupported(name, f"{name} is not supported by kvchat (send 0 or leave it out)")
    if req.logit_bias:
        raise unsupported("logit_bias", "logit_bias is not supported by kvchat")


def sampling_params(req: s.ChatCompletionRequest, prompt_tokens: int, limit: int) -> SamplingParams:
    """Raises ``PromptTooLongError`` / ``InvalidSamplingParamsError`` (mapped to 400 by the caller). ``limit``: the
    engine's ``prompt_limit``, the most tokens a request may hold."""
    # NOTE: without max_tokens a reply may fill the rest of the limit (OpenAI's and vLLM's default): the model's
    # context or the KV pool, whichever is smaller.
    max_tokens = req.max_completion_tokens or req.max_tokens or limit - prompt_tokens
    if max_tokens < 1:
        raise PromptTooLongError(prompt_tokens, 1, limit)
    stop = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop or ())
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,  # OpenAI's default
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=max(0, req.top_k or 0),  # vLLM's -1 and our 0 both mean "off"
        seed=req.seed,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop=stop,
    )


@dataclass(frozen=True, slots=True)
class _Meta:
    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool


class ChatCompletions:
    """The ``/v1`` service of one app: the served model, and chat completions run on its engine."""

    def __init__(
        self,
        engine: EngineClient,
        model_id: str,
        metrics: Metrics | None = None,
        keepalive_s: float = KEEPALIVE_S,
        disconnect_poll_s: float = DISCONNECT_POLL_S,
    ) -> None:
        self.engine = engine
        self.model_id = model_id  # served_model_id(the configured model)
        self.metrics = metrics
        self.keepalive_s = keepalive_s
        self.disconnect_poll_s = disconnect_poll_s

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
    ) -> s.ChatCompletion | StreamingResponse:
        """Run one chat completion in the tenant's cache namespace: the whole reply, or an SSE stream of it.

        Raises ``OpenAIError`` / ``EngineError`` before any byte is sent: a stream starts once the engine gave its
        first event, so a request the engine refuses (busy, too long) is an HTTP error, not an SSE one.
        """
        reply, meta = await self._start(req, tenant_id, namespace)
        if not req.stream:
            return await self._complete(reply, meta, is_disconnected)
        try:
            first = await reply.next()
        except EngineError:
            await reply.close()
            raise
        return EventStreamResponse(self._events(reply, meta, first), on_close=reply.close)

    async def _start(self, req: s.ChatCompletionRequest, tenant_id: str, namespace: str) -> tuple[Reply, _Meta]:
        """Validate, tokenize, open the engine's stream (the request registers on its first read)."""
        self._check_model(req.model)
        check_supported(req)
        messages = chat_messages(req.messages)
        floor, limit = self.engine.prompt_token_floor(m["content"] for m in messages), self.engine.prompt_limit
        if floor >= limit:
            raise too_long_before_tokenizing(floor, limit)
        # NOTE: off the event loop, in the tenant's turn on the backend's CPU workers: a long prompt takes
        # milliseconds to render and encode, and the loop serves every socket and probe of the process meanwhile.
        prompt = await run_cpu(tenant_id, self._tokenize, messages)
        params = sampling_params(req, len(prompt.token_ids), limit)
        meta = _Meta(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=self.model_id,
            fingerprint="fp_" + self.engine.info.fingerprint[:16],
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )
        timer = self.metrics.reply_timer(tenant_id) if self.metrics else None
        events = self.engine.generate(prompt, params, namespace, request_id=meta.id)
        return Reply(self.engine, meta.id, events, timer), meta

    def _tokenize(self, messages: list[dict[str, str]]) -> TokenizedPrompt:
        """The messages, split into semantic blocks (so cache stats count them by type) and tokenized; a prompt far
        over the context is refused after a count that leaves the GIL free (``prompt_guard``)."""
        floor, limit = counted_floor(self.engine, [m["content"] for m in messages]), self.engine.prompt_limit
        if floor is not None and floor >= limit:
            raise too_long_before_tokenizing(floor, limit)
        return self.engine.tokenize_prompt(segment_messages(messages))

    async def _complete(
        self, reply: Reply, meta: _Meta, is_disconnected: Callable[[], Awaitable[bool]]
    ) -> s.ChatCompletion:
        parts: list[str] = []
        checked = time.monotonic()
        try:
            while reply.finished is None:
                event = await self._next(reply)
                if isinstance(event, TokenDelta):
                    parts.append(event.text)
                if time.monotonic() - checked >= self.disconnect_poll_s:
                    checked = time.monotonic()
                    if await is_disconnected():
                        raise OpenAIError(499, "the client closed the request", "client_closed_request")
        finally:
            await reply.close()
        done = reply.finished
        return s.ChatCompletion(
            id=meta.id,
            created=meta.created,
            model=meta.model,
            system_fingerprint=meta.fingerprint,
            choices=[s.Choice(message=s.AssistantMessage(content="".join(parts)), finish_reason=_finish_reason(done))],
            usage=usage(done),
        )

    async def _events(self, reply: Reply, meta: _Meta, first: GenerationEvent | None) -> AsyncIterator[str]:
        """SSE: a role chunk, content chunks, a finish chunk, [a usage chunk], ``[DONE]``; comments while silent."""
        try:
            yield _sse(_chunk(meta, s.Delta(role="assistant", content="")))
            event = first
            while True:
                if event is None:
                    yield ": keep-alive\n\n"
                elif isinstance(event, TokenDelta):
                    if event.text:
                        yield _sse(_chunk(meta, s.Delta(content=event.text)))
                else:
                    yield _sse(_chunk(meta, s.Delta(), _finish_reason(event)))
                    if meta.include_usage:
                        yield _sse(_usage_chunk(meta, event))
                    break
                try:
                    event = await reply.next(self.keepalive_s)
                except EngineError as exc:
                    yield _sse(from_engine_error(exc).body)
                    break
            yield "data: [DONE]\n\n"
        finally:
            await reply.close()

    async def _next(self, reply: Reply) -> GenerationEvent | None:
        try:
            return await reply.next(self.disconnect_poll_s)
        except EngineError as exc:
            raise from_engine_error(exc) from exc


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that calls ``on_close`` however the response ends (done, error, client gone).

    NOTE: an ASGI 2.4 server reports a disconnect as an ``OSError`` from ``send``, after which Starlette leaves the body
    iterator unclosed until garbage collection; ``on_close`` frees the engine request at once either way.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], Awaitable[None]]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._on_close()


def usage(done: RequestFinished) -> s.Usage:
    st = done.stats
    return s.Usage(
        prompt_tokens=st.prompt_tokens,
        completion_tokens=st.completion_tokens,
        total_tokens=st.prompt_tokens + st.completion_tokens,
        prompt_tokens_details=s.PromptTokensDetails(cached_tokens=st.cached_tokens),
    )


def _finish_reason(done: RequestFinished | None) -> str:
    return _FINISH_REASONS[done.finish_reason] if done is not None else "abort"


def _chunk(meta: _Meta, delta: s.Delta, finish_reason: str | None = None) -> s.ChatCompletionChunk:
    return s.ChatCompletionChunk(
        id=meta.id,
        created=meta.created,
        model=meta.model,
        system_fingerprint=meta.fingerprint,
        choices=[s.ChunkChoice(delta=delta, finish_reason=finish_reason)],
    )


def _usage_chunk(meta: _Meta, done: RequestFinished) -> s.ChatCompletionChunk:
    chunk = _chunk(meta, s.Delta())
    return chunk.model_copy(update={"choices": [], "usage": usage(done)})


def _sse(payload: s.ChatCompletionChunk | s.ErrorResponse) -> str:
    data: dict[str, Any] = payload.model_dump(exclude_none=isinstance(payload, s.ChatCompletionChunk))
    if isinstance(payload, s.ChatCompletionChunk):
        # NOTE: OpenAI sends ``"finish_reason": null`` and ``"logprobs": null`` on every chunk; keep those keys.
        for choice in data["choices"]:
            choice.setdefault("finish_reason", None)
            choice.setdefault("logprobs", None)
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
