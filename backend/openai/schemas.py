"""Wire shapes of the OpenAI chat-completions API (the subset kvchat serves, plus vLLM's sampling extensions).

Requests ignore fields they do not know (clients send vendor extras); fields kvchat knows but cannot honour
(``n > 1``, ``logprobs``, tools, penalties, ...) are rejected by the service with a 400 that names the parameter.
Request fields are strict (``"5"`` is not a number, ``"yes"`` not a boolean) and their strings storable text
(``backend/core/limits.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backend.core.limits import INT64_MAX, SafeText

# NOTE: strict parsing of what clients send; the response models below are ours and stay lax.
_STRICT = ConfigDict(strict=True)


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: SafeText


class ContentPart(BaseModel):
    """Any content part; only ``text`` ones are accepted (checked by the service, which names the offender)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: SafeText
    text: SafeText | None = None


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    # NOTE: "developer" is OpenAI's newer name for "system"; "tool"/"function" are parsed so the 400 can say why.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: SafeText | list[ContentPart] | None = None
    name: SafeText | None = None
    tool_calls: list[dict[str, Any]] | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool = False


class ChatCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: SafeText
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT64_MAX)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=INT64_MAX)
    stop: SafeText | list[SafeText] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=INT64_MAX)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=INT64_MAX)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: SafeText | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    user: SafeText | None = None
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[Choice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "kvchat"
    # NOTE: both spellings of the context length: vLLM's ``max_model_len`` and the ``context_length`` of
    # OpenRouter/LiteLLM-style catalogues, so either kind of client finds it.
    max_model_len: int
    context_length: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorBody
