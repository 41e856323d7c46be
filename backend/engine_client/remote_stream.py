"""One streamed completion from an engine server (``kvchat engine-serve`` or vLLM), read as the engine's events.

``StreamReader`` turns the SSE ``data:`` lines of ``/v1/completions`` into ``TokenDelta``s and one ``RequestFinished``:
kvchat's server puts the request's full ``RequestStats`` under ``kvchat.stats``; from vLLM, the stats are what its
``usage`` says (``prompt_tokens_details.cached_tokens``), the rest zero. A line that is not what an engine writes
raises ``WireError``; an error event raises the engine error it names.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from backend.engine_client.remote_errors import EngineProtocolError
from backend.engine_client.values import (
    EngineError,
    FinishReason,
    RequestFinished,
    RequestStats,
    TokenDelta,
    TokenLogprob,
)
from backend.engine_client.wire import WireError, decode, error_from_body

_FROM_OPENAI = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORTED}


@dataclass(slots=True)
class StreamReader:
    """Reads one request's SSE lines; ``line`` returns the event a line completes (or None), ``finished`` the end."""

    request_id: str
    prompt_tokens: int
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    reason: FinishReason | None = None
    stats: RequestStats | None = None
    prompt_logprobs: tuple[float | None, ...] | None = None
    done: bool = False

    def line(self, raw: str) -> TokenDelta | RequestFinished | None:
        if not raw.strip() or raw.startswith(":"):
            return None  # (a keep-alive or a comment)
        if not raw.startswith("data:"):
            raise WireError(f"not a server-sent event line: {raw[:80]!r}")
        payload = raw[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return self.finished()
        try:
            data = json.loads(payload)
        except ValueError:
            raise WireError(f"an event that is not JSON: {payload[:80]!r}") from None
        if not isinstance(data, dict):
            raise WireError("an event that is not a JSON object")
        if "error" in data:
            raise error_from_body(data, "the engine failed mid-reply")
        return self._chunk(data)

    def _chunk(self, data: dict[str, Any]) -> TokenDelta | None:
        choices = data.get("choices")
        if not isinstance(choices, list):
            raise WireError("an event without choices")
        extra: dict[str, Any] = data["kvchat"] if isinstance(data.get("kvchat"), dict) else {}
        if isinstance(data.get("usage"), dict) and self.stats is None:
            self.stats = self._stats_of(data["usage"], extra)
        if not choices:
            return None  # (vLLM's usage-only chunk)
        choice = choices[0]
        if not isinstance(choice, dict):
            raise WireError("a choice that is not an object")
        if choice.get("finish_reason") is not None:
            self.reason = self._reason_of(choice["finish_reason"], extra)
            if "prompt_logprobs" in extra and extra["prompt_logprobs"] is not None:
                self.prompt_logprobs = tuple(extra["prompt_logprobs"])
        text, ids = choice.get("text", ""), choice.get("token_ids") or []
        if not isinstance(text, str) or not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise WireError("a choice whose text or token_ids are of the wrong kind")
        if not text and not ids:
            return None
        logprobs = decode(tuple[TokenLogprob, ...], extra["logprobs"]) if "logprobs" in extra else ()
        self.text.append(text)
        self.token_ids.extend(ids)
        self.logprobs.extend(logprobs)
        return TokenDelta(self.request_id, tuple(ids), text, logprobs)

    def _reason_of(self, openai: object, extra: dict[str, Any]) -> FinishReason:
        if "finish_reason" in extra:
            return decode(FinishReason, extra["finish_reason"])
        if openai not in _FROM_OPENAI:
            raise WireError(f"unknown finish reason {openai!r}")
        return _FROM_OPENAI[str(openai)]

    def _stats_of(self, usage: dict[str, Any], extra: dict[str, Any]) -> RequestStats:
        if "stats" in extra:
            return decode(RequestStats, extra["stats"])
        details = usage.get("prompt_tokens_details") or {}
        try:
            return RequestStats(
                prompt_tokens=int(usage["prompt_tokens"]),
                cached_tokens=int(details.get("cached_tokens") or 0),
                prefilled_tokens=int(usage["prompt_tokens"]) - int(details.get("cached_tokens") or 0),
                completion_tokens=int(usage["completion_tokens"]),
                ttft_s=0.0,
                decode_tokens_per_s=0.0,
                queue_s=0.0,
                num_preemptions=0,
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"bad usage: {exc}") from None

    def finished(self, reason: FinishReason | None = None) -> RequestFinished:
        """The end of the request: what the server said, or ``reason`` (an abort) with what arrived so far."""
        final = reason or self.reason
        if final is None:
            raise WireError("the stream ended without a finish reason")
        stats = self.stats or RequestStats(self.prompt_tokens, 0, 0, len(self.token_ids), 0.0, 0.0, 0.0, 0)
        logprobs = tuple(self.logprobs) if self.logprobs else None
        return RequestFinished(
            self.request_id, final, "".join(self.text), tuple(self.token_ids), stats, self.prompt_logprobs, logprobs
        )


def error_of_response(status: int, body: bytes, where: str) -> EngineError:
    """The engine error an HTTP error answer stands for (its JSON body's code; else a clear protocol error)."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        return error_from_body(data, f"{where} answered {status}")
    text = " ".join(body.decode("utf-8", "replace").split())[:160]
    return EngineProtocolError(f"{where} answered {status} with something that is not an engine's answer: {text!r}")
