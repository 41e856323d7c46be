"""The service behind ``/v1``: request → engine prompt and ``SamplingParams``, then a completion or an SSE stream.

Requests are stateless (no chat-session rows) but run in the tenant's cache namespace — the one the websocket chat
uses — so a client that re-sends a growing conversation gets prefix hits, and two tenants never share cached tokens
(unless both opted into the public namespace).

The served model id is ``"kvchat/" + <the engine's model name>``: the name the engine was configured with
(``smollm2`` for the default model) or, for a path, its last component without ``.gguf``. Requests may name it, or
the alias ``default``; any other model is a 404 ``model_not_found``.
"""

from __future__ import annotations

import asyncio
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
from backend.core.metrics import Metrics, ReplyTimer
from backend.core.offload import run_cpu
from backend.openai import schemas as s
from backend.openai.errors import OpenAIError, from_engine_error, too_long_before_tokenizing, unsupported
from backend.openai.prompt_guard import counted_floor
from engine.errors import EngineError, PromptTooLongError
from engine.llm_engine import EngineInfo, LLMEngine
from engine.outputs import FinishReason, GenerationEvent, RequestFinished, TokenDelta
from engine.prompt import TokenizedPrompt
from engine.sampling_params import SamplingParams

MODEL_ALIAS = "default"
KEEPALIVE_S = 15.0  # an SSE comment after this much silence keeps proxies and clients from timing out
DISCONNECT_POLL_S = 1.0  # how often a non-streaming request checks that its client is still there
_STARTED = int(time.time())
_FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORTED: "abort"}


def served_model_id(engine: LLMEngine) -> str:
    return "kvchat/" + Path(engine.config.model).name.removesuffix(".gguf")


def model_card(engine: LLMEngine) -> s.ModelCard:
    n = engine.info.max_model_len
    return s.ModelCard(id=served_model_id(engine), created=_STARTED, max_model_len=n, context_length=n)


def check_model(engine: LLMEngine, model: str) -> None:
    if model not in (served_model_id(engine), MODEL_ALIAS):
        served = served_model_id(engine)
        raise OpenAIError(
            404,
            f"The model {model!r} does not exist; this server serves {served!r} (alias {MODEL_ALIAS!r}).",
            "model_not_found",
            param="model",
        )


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


def sampling_params(req: s.ChatCompletionRequest, prompt_tokens: int, info: EngineInfo) -> SamplingParams:
    """Raises ``PromptTooLongError`` / ``InvalidSamplingParamsError`` (mapped to 400 by the caller)."""
    # NOTE: without max_tokens a reply may fill the rest of the context (OpenAI's and vLLM's default); the KV pool
    # bounds it too, since the engine refuses a request that could never fit in it.
    limit = min(info.max_model_len, info.num_blocks * info.block_size)
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


class _Pending:
    """One submitted request; the engine's step thread feeds its events into an asyncio queue."""

    def __init__(self, engine: LLMEngine, request_id: str, timer: ReplyTimer | None = None) -> None:
        self._engine = engine
        self.request_id = request_id
        self._timer = timer
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[GenerationEvent | EngineError] = asyncio.Queue()
        self.finished: RequestFinished | None = None

    def sink(self, event: GenerationEvent | EngineError) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def next(self, timeout_s: float) -> GenerationEvent | None:
        """The next event, or None after ``timeout_s`` of silence. Raises the request's ``EngineError``."""
        try:
            event = await asyncio.wait_for(self._queue.get(), timeout_s)
        except TimeoutError:
            return None
        if isinstance(event, EngineError):
            raise event
        if isinstance(event, RequestFinished):
            self.finished = event
        if self._timer is not None and isinstance(event, TokenDelta):
            self._timer.delta()
        elif self._timer is not None and isinstance(event, RequestFinished):
            self._timer.finished(event.stats)
        return event

    def abort(self) -> None:
        """Free the request's blocks unless it already finished (idempotent, safe from any ``finally``)."""
        if self.finished is None:
            self._engine.abort(self.request_id)


@dataclass(frozen=True, slots=True)
class _Meta:
    id: str
    created: int
    model: str
    fingerprint: str
    include_usage: bool


class ChatCompletions:
    """Runs one chat completion for a tenant; built per request around the app's engine."""

    def __init__(
        self,
        engine: LLMEngine,
        metrics: Metrics | None = None,
        keepalive_s: float = KEEPALIVE_S,
        disconnect_poll_s: float = DISCONNECT_POLL_S,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.keepalive_s = keepalive_s
        self.disconnect_poll_s = disconnect_poll_s

    async def start(self, req: s.ChatCompletionRequest, tenant_id: str, namespace: str) -> tuple[_Pending, _Meta]:
        """Validate, tokenize and submit. Raises ``OpenAIError`` / ``EngineError`` before any byte is sent."""
        check_model(self.engine, req.model)
        check_supported(req)
        messages = chat_messages(req.messages)
        floor, limit = self.engine.prompt_token_floor(m["content"] for m in messages), self.engine.prompt_limit
        if floor >= limit:
            raise too_long_before_tokenizing(floor, limit)
        # NOTE: off the event loop, in the tenant's turn on the backend's CPU workers: a long prompt takes
        # milliseconds to render and encode, and the loop serves every socket and probe of the process meanwhile.
        prompt = await run_cpu(tenant_id, self._tokenize, messages)
        params = sampling_params(req, len(prompt.token_ids), self.engine.info)
        meta = _Meta(
            id=f"chatcmpl-{uuid.uuid4().hex}",
            created=int(time.time()),
            model=served_model_id(self.engine),
            fingerprint="fp_" + self.engine.info.fingerprint[:16],
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
        )
        timer = self.metrics.reply_timer(tenant_id) if self.metrics else None
        pending = _Pending(self.engine, meta.id, timer)
        self.engine.submit(prompt, params, namespace, pending.sink, request_id=meta.id)
        return pending, meta

    def _tokenize(self, messages: list[dict[str, str]]) -> TokenizedPrompt:
        """The messages, split into semantic blocks (so cache stats count them by type) and tokenized; a prompt far
        over the context is refused after a count that leaves the GIL free (``prompt_guard``)."""
        floor, limit = counted_floor(self.engine, [m["content"] for m in messages]), self.engine.prompt_limit
        if floor is not None and floor >= limit:
            raise too_long_before_tokenizing(floor, limit)
        return self.engine.tokenize_prompt(segment_messages(messages))

    async def complete(
        self, pending: _Pending, meta: _Meta, is_disconnected: Callable[[], Awaitable[bool]]
    ) -> s.ChatCompletion:
        parts: list[str] = []
        checked = time.monotonic()
        try:
            while pending.finished is None:
                event = await self._next(pending)
                if isinstance(event, TokenDelta):
                    parts.append(event.text)
                if time.monotonic() - checked >= self.disconnect_poll_s:
                    checked = time.monotonic()
                    if await is_disconnected():
                        raise OpenAIError(499, "the client closed the request", "client_closed_request")
        finally:
            pending.abort()
        done = pending.finished
        return s.ChatCompletion(
            id=meta.id,
            created=meta.created,
            model=meta.model,
            system_fingerprint=meta.fingerprint,
            choices=[s.Choice(message=s.AssistantMessage(content="".join(parts)), finish_reason=_finish_reason(done))],
            usage=usage(done),
        )

    def stream(self, pending: _Pending, meta: _Meta) -> StreamingResponse:
        return EventStreamResponse(self._events(pending, meta), on_close=pending.abort)

    async def _events(self, pending: _Pending, meta: _Meta) -> AsyncIterator[str]:
        """SSE: a role chunk, content chunks, a finish chunk, [a usage chunk], ``[DONE]``; comments while silent."""
        try:
            yield _sse(_chunk(meta, s.Delta(role="assistant", content="")))
            while pending.finished is None:
                try:
                    event = await pending.next(self.keepalive_s)
                except EngineError as exc:
                    yield _sse(from_engine_error(exc).body)
                    break
                if event is None:
                    yield ": keep-alive\n\n"
                elif isinstance(event, TokenDelta):
                    if event.text:
                        yield _sse(_chunk(meta, s.Delta(content=event.text)))
                else:
                    yield _sse(_chunk(meta, s.Delta(), _finish_reason(event)))
                    if meta.include_usage:
                        yield _sse(_usage_chunk(meta, event))
            yield "data: [DONE]\n\n"
        finally:
            pending.abort()

    async def _next(self, pending: _Pending) -> GenerationEvent | None:
        try:
            return await pending.next(self.disconnect_poll_s)
        except EngineError as exc:
            raise from_engine_error(exc) from exc


class EventStreamResponse(StreamingResponse):
    """``text/event-stream`` that calls ``on_close`` however the response ends (done, error, client gone).

    NOTE: an ASGI 2.4 server reports a disconnect as an ``OSError`` from ``send``, after which Starlette leaves the body
    iterator unclosed until garbage collection; ``on_close`` frees the engine request at once either way.
    """

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


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
