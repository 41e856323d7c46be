"""The engine server's request bodies (pydantic): OpenAI's completion fields, plus ``kvchat`` extras and vLLM's
``cache_salt``. Unknown fields are ignored, as vLLM ignores them (vllm-router adds a few of its own)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


class KvchatExtra(BaseModel):
    """What kvchat's backend sends beyond OpenAI: the segment spans of a token-id prompt and how many of its tokens are
    the system message(s), the session (its blocks are recorded for invalidation and erasure), and the exact sampling
    parameters (``wire.sampling_to_json``)."""

    model_config = ConfigDict(extra="forbid")

    spans: list[list[Any]] = Field(default_factory=list)
    system_tokens: int = Field(default=0, ge=0)
    session: str | None = None
    sampling: dict[str, Any] | None = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)  # vLLM's: the namespace
    kvchat: KvchatExtra | None = None


class CompletionRequest(_Sampling):
    prompt: list[int] | str = Field(min_length=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


class Invalidate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str
    session: str | None = None
    from_position: int | None = Field(default=None, ge=0)
    reason: str = "invalidated"


class InvalidatePrefix(BaseModel):
    """Shared text changed: the chain of ``token_ids`` from ``from_position`` on goes (``invalidate_prefix``)."""

    model_config = ConfigDict(extra="forbid")

    namespace: str
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(max_length=1_000_000)
    from_position: int = Field(ge=0)
    reason: str = "invalidated"


class Flush(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str
    reason: str = "flushed"


class SessionRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    session: str


class Erase(SessionRef):
    namespace: str


class Temperature(SessionRef):
    temperature: float = Field(ge=0.0, le=1.0)


class Pin(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str
    token_ids: list[int] = Field(default_factory=list)


class Unpin(BaseModel):
    model_config = ConfigDict(extra="forbid")

    namespace: str


class CacheChanges(BaseModel):
    model_config = ConfigDict(extra="forbid")

    changes: dict[str, Any]
