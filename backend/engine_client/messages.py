"""The engine server's messages, declared once (pydantic): what ``RemoteEngine`` sends and ``kvchat engine-serve``
(``backend/engine_server``) parses, and the few answers that are not one of the engine's own values (those travel
as themselves: ``wire.py``).

A completion request is OpenAI's fields (what a vLLM replica reads), plus ``kvchat`` extras and vLLM's
``cache_salt``. Unknown fields are ignored, as vLLM ignores them (vllm-router adds a few of its own); the control
bodies refuse them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from backend.engine_client.values import EngineInfo, FairShare, RepetitionScope, SamplingParams, TokenSpan


class KvchatExtra(BaseModel):
    """What kvchat's backend sends beyond OpenAI: the segment spans of a token-id prompt and how many of its tokens are
    the system message(s), the session (its blocks are recorded for invalidation and erasure), and the exact sampling
    parameters (checked by ``SamplingParams`` itself: a bad one is the engine's ``InvalidSamplingParamsError``), and the
    tenant's fair share."""

    model_config = ConfigDict(extra="forbid")

    spans: tuple[TokenSpan, ...] = ()
    system_tokens: int = Field(default=0, ge=0)
    session: str | None = None
    sampling: SamplingParams | None = None
    # NOTE: the tenant the engine's fair scheduler charges (engine.fair_share); without it, every request of the
    # backend would be one tenant's in an engine process or replica, first come first served
    share: FairShare | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = False  # vLLM's: each chunk carries its token ids (kvchat's always do)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repetition_penalty: float | None = None
    repetition_penalty_scope: RepetitionScope | None = None  # kvchat's: "reply" spares the prompt's tokens
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


class _Control(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Invalidate(_Control):
    namespace: str
    session: str | None = None
    from_position: int | None = Field(default=None, ge=0)
    reason: str = "invalidated"


class InvalidatePrefix(_Control):
    """Shared text changed: the chain of ``token_ids`` from ``from_position`` on goes (``invalidate_prefix``)."""

    namespace: str
    token_ids: list[Annotated[int, Field(ge=0)]] = Field(max_length=1_000_000)
    from_position: int = Field(ge=0)
    reason: str = "invalidated"


class Flush(_Control):
    namespace: str
    reason: str = "flushed"


class SessionRef(_Control):
    session: str


class Erase(SessionRef):
    namespace: str


class Temperature(SessionRef):
    temperature: float = Field(ge=0.0, le=1.0)


class Pin(_Control):
    namespace: str
    token_ids: list[int] = Field(default_factory=list)


class Unpin(_Control):
    namespace: str


class CacheChanges(_Control):
    changes: dict[str, Any]


# ---------------------------------------------------------------------------------------------- answers


class InfoAnswer(BaseModel):
    """``/kvchat/info``: what a client checks at start (the model's fingerprint, the prompt limit)."""

    engine: str = "kvchat"
    model: str
    info: EngineInfo
    prompt_limit: int


class Released(BaseModel):
    blocks_freed: int


class Unpinned(BaseModel):
    blocks: int


class Done(BaseModel):
    ok: bool = True
