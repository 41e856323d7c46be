"""Wire shapes of the OpenAI chat-completions API (the subset kvchat serves, plus vLLM's sampling extensions).

Requests ignore fields they do not know (clients send vendor extras). Fields kvchat knows are honoured:
``n``, ``logprobs``/``top_logprobs``, the penalties, ``logit_bias``, ``response_format`` (JSON object and JSON
schema, by the engine's grammar), ``tools``/``tool_choice``/``parallel_tool_calls``, and vLLM's
``repetition_penalty``, ``min_p``, ``top_k``, ``min_tokens``, ``ignore_eos``. A value kvchat cannot honour (an
``n`` past the server's cap, a content part that is not text, a response format or tool type it does not know,
the deprecated ``functions``) is refused by the service with a 400 that names the parameter
(``backend/openai/request_plan.py``). Request fields are strict (``"5"`` is not a number, ``"yes"`` not a boolean)
and their strings storable text (``backend/core/limits.py``).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from backend.core.limits import INT64_MAX, SafeText

# NOTE: strict parsing of what clients send; the response models below are ours and stay lax.
_STRICT = ConfigDict(strict=True)
_LENIENT = ConfigDict(extra="ignore", strict=True)


class TextPart(BaseModel):
    model_config = _STRICT

    type: Literal["text"]
    text: SafeText


class ContentPart(BaseModel):
    """Any content part; only ``text`` ones are accepted (checked by the service, which names the offender)."""

    model_config = ConfigDict(extra="allow", strict=True)

    type: SafeText
    text: SafeText | None = None


class FunctionCallIn(BaseModel):
    model_config = _LENIENT

    name: SafeText
    arguments: SafeText  # the JSON text of an object, as OpenAI sends it


class ToolCallIn(BaseModel):
    """A call an earlier assistant message made (sent back in the history)."""

    model_config = _LENIENT

    id: SafeText
    type: SafeText = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    model_config = _LENIENT

    # NOTE: "developer" is OpenAI's newer name for "system"; "function" (the deprecated call result) is parsed so
    # the 400 can say why.
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: SafeText | list[ContentPart] | None = None
    name: SafeText | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: SafeText | None = None


class StreamOptions(BaseModel):
    model_config = _LENIENT

    include_usage: bool = False


class FunctionDef(BaseModel):
    model_config = _LENIENT

    name: SafeText
    description: SafeText | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    """A tool offered to the model; only ``type: "function"`` is known (checked by the service)."""

    model_config = _LENIENT

    type: SafeText
    function: FunctionDef | None = None


class NamedFunction(BaseModel):
    model_config = _LENIENT

    name: SafeText


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: a call of that tool is forced."""

    model_config = _LENIENT

    type: SafeText
    function: NamedFunction


class JsonSchemaFormat(BaseModel):
    model_config = _LENIENT

    name: SafeText | None = None
    description: SafeText | None = None
    # NOTE: ``schema`` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``text`` (the default), ``json_object`` or ``json_schema``; other types are refused by the service."""

    model_config = _LENIENT

    type: SafeText
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(BaseModel):
    model_config = _LENIENT

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
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[SafeText, float] | None = None
    tools: list[ToolDef] | None = None
    tool_choice: SafeText | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: SafeText | dict[str, Any] | None = None
    response_format: ResponseFormat | None = None
    user: SafeText | None = None
    # vLLM's extensions
    top_k: int | None = Field(default=None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=100.0)
    min_tokens: int = Field(default=0, ge=0, le=INT64_MAX)
    ignore_eos: bool = False
    # kvchat's extension: suffix drafts (engine/spec) for this request; they never change the output (greedy tokens
    # are identical, sampled ones keep the model's distribution), only its speed. Left out: the tenant's setting
    # (``PUT /admin/tenant/drafts``), whose default is the engine's switch (``KVCHAT_ENGINE_DRAFTS``).
    drafts: bool | None = None
    # kvchat's extension: "reply" applies ``repetition_penalty`` to the reply's own tokens only (the prompt's wording
    # stays free to quote); left out: "all", vLLM's semantics (every token seen, the prompt's included).
    repetition_penalty_scope: Literal["all", "reply"] | None = None


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(BaseModel):
    """One generated token: its text, the model's log-probability of it, and the most likely tokens there."""

    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None
    refusal: None = None


class FunctionCallOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str
    choices: list[Choice]
    usage: Usage


class FunctionDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """OpenAI's streamed call: the first delta of call ``index`` has its id, type and name; later ones add to its
    arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: Delta
    logprobs: ChoiceLogprobs | None = None
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
