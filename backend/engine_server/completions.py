"""``/v1/completions`` and ``/v1/chat/completions``: OpenAI's shape, streamed as SSE or answered whole.

A completion's prompt is token ids (the backend tokenized it, with ``kvchat.spans`` labelling the segments) or a
string; a chat completion's is messages, rendered here with the model's chat template. The namespace (the tenant's
cache salt) comes from the trusted ``X-Kvchat-Namespace`` header, else vLLM's ``cache_salt`` field, else ``default``.

Each chunk carries its ``token_ids`` (as vLLM's ``return_token_ids`` does); the last one carries ``usage`` with
``prompt_tokens_details.cached_tokens`` (and ``cached_tokens_by_tier``) and, under ``kvchat``, the request's full
``RequestStats``. The first event is awaited before the response starts, so a refusal (busy, too long) is an HTTP
error with its status, never a stream that fails at once. A client that disconnects aborts its request.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Request
from fastapi.responses import JSONResponse, StreamingResponse

from backend.engine_client.messages import ChatCompletionRequest, CompletionRequest, _Sampling
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import (
    DEFAULT_SHARE,
    EngineError,
    FinishReason,
    GenerationEvent,
    Prompt,
    RequestFinished,
    RequestStats,
    SamplingParams,
    TokenDelta,
    TokenizedPrompt,
    TokenLogprob,
)
from backend.engine_client.wire import encode, error_body, usage_of
from backend.engine_server.auth import require_secret

router = APIRouter(dependencies=[Depends(require_secret)])
NAMESPACE_HEADER = "X-Kvchat-Namespace"
_OPENAI_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORTED: "abort"}

Chunk = Callable[[str, tuple[int, ...], str | None], dict[str, Any]]


def _engine(request: Request) -> EngineClient:
    engine: EngineClient = request.app.state.engine
    return engine


EngineDep = Annotated[EngineClient, Depends(_engine)]
NamespaceHeader = Annotated[str | None, Header(alias=NAMESPACE_HEADER)]


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    model_id: str = request.app.state.model_id
    info = _engine(request).info
    card = {"id": model_id, "object": "model", "owned_by": "kvchat", "max_model_len": info.max_model_len}
    return {"object": "list", "data": [card]}


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, engine: EngineDep, request: Request, namespace: NamespaceHeader = None
) -> JSONResponse | StreamingResponse:
    prompt: Prompt = body.prompt
    if isinstance(body.prompt, list) and body.kvchat and (body.kvchat.spans or body.kvchat.system_tokens):
        extra = body.kvchat
        prompt = TokenizedPrompt(list(body.prompt), extra.spans, extra.system_tokens)
    return await _answer(engine, request, body, prompt, namespace, chat=False)


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest, engine: EngineDep, request: Request, namespace: NamespaceHeader = None
) -> JSONResponse | StreamingResponse:
    messages = [{"role": m.role, "content": m.content} for m in body.messages]
    return await _answer(engine, request, body, messages, namespace, chat=True)


async def _answer(
    engine: EngineClient, request: Request, body: _Sampling, prompt: Prompt, header: str | None, *, chat: bool
) -> JSONResponse | StreamingResponse:
    namespace = header or body.cache_salt or "default"
    session = body.kvchat.session if body.kvchat else None
    share = body.kvchat.share if body.kvchat and body.kvchat.share else DEFAULT_SHARE
    events = engine.generate(prompt, sampling_of(body), namespace, uuid.uuid4().hex, session, share)
    try:
        first = await anext(events)  # NOTE: a refusal raises here, before a byte is sent: an HTTP error
    except BaseException:
        await events.aclose()
        raise
    chunk = _chunker(request.app.state.model_id, chat)
    if body.stream:
        return StreamingResponse(_sse(first, events, chunk), media_type="text/event-stream")
    return JSONResponse(await _whole(first, events, chunk))


def sampling_of(body: _Sampling) -> SamplingParams:
    """``kvchat.sampling`` exactly when the backend sent it; else from OpenAI's fields (checked by the engine)."""
    if body.kvchat is not None and body.kvchat.sampling is not None:
        return body.kvchat.sampling
    fields = {
        "max_tokens": body.max_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "repetition_penalty": body.repetition_penalty,
        "repetition_penalty_scope": body.repetition_penalty_scope,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
    }
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    return SamplingParams(**{k: v for k, v in fields.items() if v is not None}, stop=stop)  # type: ignore[arg-type]


def _chunker(model_id: str, chat: bool) -> Chunk:
    rid, created = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex, int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str, token_ids: tuple[int, ...], finish: str | None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": list(token_ids)}
        if chat:
            choice["delta"] = {"content": text} if text or finish is None else {}
        else:
            choice["text"], choice["logprobs"] = text, None
        return {"id": rid, "object": kind, "created": created, "model": model_id, "choices": [choice]}

    return chunk


def _final(chunk: Chunk, done: RequestFinished) -> dict[str, Any]:
    out = chunk("", (), _OPENAI_FINISH[done.finish_reason])
    out["usage"] = usage_of(done.stats)
    out["kvchat"] = {
        "finish_reason": done.finish_reason.value,
        "stats": encode(done.stats, RequestStats),
        "prompt_logprobs": list(done.prompt_logprobs) if done.prompt_logprobs is not None else None,
    }
    return out


def _delta(chunk: Chunk, delta: TokenDelta) -> dict[str, Any]:
    out = chunk(delta.text, delta.token_ids, None)
    if delta.logprobs:
        out["kvchat"] = {"logprobs": encode(delta.logprobs, tuple[TokenLogprob, ...])}
    return out


async def _sse(
    first: GenerationEvent, events: AsyncGenerator[GenerationEvent, None], chunk: Chunk
) -> AsyncIterator[bytes]:
    """The stream; closing it (the client went away) closes ``events``, which aborts the request."""
    try:
        event: GenerationEvent | None = first
        while event is not None:
            data = _final(chunk, event) if isinstance(event, RequestFinished) else _delta(chunk, event)
            yield b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"
            event = None if isinstance(event, RequestFinished) else await anext(events, None)
        yield b"data: [DONE]\n\n"
    except EngineError as exc:  # NOTE: after the first byte an error can only be an event of the stream
        yield b"data: " + json.dumps(error_body(exc)).encode() + b"\n\n"
    finally:
        with contextlib.suppress(Exception):
            await events.aclose()


async def _whole(first: GenerationEvent, events: AsyncGenerator[GenerationEvent, None], chunk: Chunk) -> dict[str, Any]:
    event = first
    while not isinstance(event, RequestFinished):
        event = await anext(events)
    out = _final(chunk, event)
    choice = out["choices"][0]
    choice["token_ids"] = list(event.token_ids)
    if "delta" in choice:
        choice["message"] = {"role": "assistant", "content": event.text}
        del choice["delta"]
        out["object"] = "chat.completion"
    else:
        choice["text"] = event.text
        out["object"] = "text_completion"
    return out
