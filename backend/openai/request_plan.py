"""A ``/v1`` request checked and turned into what the engine runs: the conversation (with its tool calls and
results), the tools offered and how they may be used, the grammar, and the sampling parameters of its choices.

Every refusal here is a 400 that names the parameter: ``unsupported_parameter`` for a value kvchat does not serve
(an ``n`` past the server's cap, a tool or response format type it does not know, the deprecated ``functions``),
``invalid_request`` for a value that cannot be meant (a named tool that was not offered, a ``logit_bias`` token
outside the vocabulary). Meanings are OpenAI's, with vLLM's for the extensions.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

from backend.engine_client.values import (
    MAX_LOGPROBS,
    GrammarKind,
    InvalidSamplingParamsError,
    PromptTooLongError,
    RepetitionScope,
    SamplingParams,
    StructuredOutput,
)
from backend.openai import schemas as s
from backend.openai.errors import OpenAIError, unsupported
from backend.tools.grammar import call_grammar
from backend.tools.types import ChatTurn, ToolCall, ToolChoice, ToolChoiceMode, ToolError, ToolFamily, ToolSpec

# NOTE: each choice is its own engine request; past this many, one HTTP request would take a large share of the
# engine's batch (the app may pass its engine's own ``max_num_seqs``).
DEFAULT_MAX_N = 8
MAX_LOGIT_BIAS = 1024  # entries (the engine's cap)
_TOKEN_ID = re.compile(r"^[0-9]{1,10}$")


def invalid(param: str, why: str) -> OpenAIError:
    return OpenAIError(400, why, "invalid_request", param=param)


@dataclass(frozen=True, slots=True)
class ToolUse:
    """The request's tools, how the model may use them, and the format it writes calls in."""

    tools: tuple[ToolSpec, ...]
    choice: ToolChoice
    family: ToolFamily
    parallel: bool

    @property
    def offered(self) -> tuple[ToolSpec, ...]:
        """What the prompt lists: nothing with ``tool_choice: "none"``, only the named tool when one is forced."""
        if not self.choice.offers_tools:
            return ()
        if self.choice.mode is ToolChoiceMode.NAMED:
            return tuple(t for t in self.tools if t.name == self.choice.name)
        return self.tools

    @property
    def grammar(self) -> StructuredOutput | None:
        """The grammar that forces a call (``required`` or a named tool), else None."""
        if not self.choice.forces_call:
            return None
        parallel = self.parallel and self.choice.mode is ToolChoiceMode.REQUIRED
        return StructuredOutput(GrammarKind.LARK, call_grammar(self.offered, self.family, parallel))


@dataclass(frozen=True, slots=True)
class RequestPlan:
    turns: tuple[ChatTurn, ...]
    tools: ToolUse | None  # None: no tool is offered, and replies are not parsed for calls
    n: int
    top_logprobs: int | None  # None: no logprobs
    grammar: StructuredOutput | None
    grammar_param: str | None  # the parameter a grammar the engine refuses came from


def plan(req: s.ChatCompletionRequest, family: ToolFamily, vocab_size: int, max_n: int = DEFAULT_MAX_N) -> RequestPlan:
    """Check ``req`` and plan it for a model writing calls in ``family`` with ``vocab_size`` token ids."""
    n = req.n or 1
    if n > max_n:
        raise unsupported("n", f"n must be at most {max_n} on this server, got {n}")
    if req.top_logprobs is not None and not req.logprobs and req.top_logprobs > 0:
        raise invalid("top_logprobs", "top_logprobs needs logprobs: true")
    if req.top_logprobs is not None and req.top_logprobs > MAX_LOGPROBS:
        raise invalid("top_logprobs", f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}")
    if req.logit_bias:
        logit_bias(req.logit_bias, vocab_size)
    tools = tool_use(req, family)
    grammar, param = _grammar(req, tools)
    return RequestPlan(
        turns=conversation(req.messages),
        tools=tools if tools is not None and tools.choice.offers_tools else None,
        n=n,
        top_logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        grammar=grammar,
        grammar_param=param,
    )


def sampling_params(
    req: s.ChatCompletionRequest, plan: RequestPlan, prompt_tokens: int, limit: int, drafts: bool | None = None
) -> SamplingParams:
    """Raises ``PromptTooLongError`` / ``InvalidSamplingParamsError`` (mapped to 400 by the caller). ``limit``: the
    engine's ``prompt_limit``, the most tokens a request may hold; ``drafts``: the tenant's suffix-drafts choice
    (None: the engine's switch), which the request's own ``drafts`` field overrides."""
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
        min_p=req.min_p or 0.0,
        seed=req.seed,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        stop=stop,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        repetition_penalty_scope=RepetitionScope(req.repetition_penalty_scope or RepetitionScope.ALL),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        logit_bias=logit_bias(req.logit_bias or {}, None),
        logprobs=plan.top_logprobs,
        structured=plan.grammar,
        drafts=drafts if req.drafts is None else req.drafts,
    )


def logit_bias(raw: dict[str, float], vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"<token id>": bias}`` as the engine's pairs; ids within the vocabulary, biases in [-100, 100]."""
    if len(raw) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"logit_bias may hold at most {MAX_LOGIT_BIAS} tokens, got {len(raw)}")
    pairs: dict[int, float] = {}
    for key, bias in raw.items():
        if not _TOKEN_ID.match(key):
            raise invalid("logit_bias", f"logit_bias keys must be token ids (decimal integers), got {key!r}")
        token = int(key)
        if vocab_size is not None and token >= vocab_size:
            raise invalid("logit_bias", f"logit_bias token id {token} is outside the vocabulary [0, {vocab_size})")
        if token in pairs:
            raise invalid("logit_bias", f"logit_bias names token id {token} twice")
        if not math.isfinite(bias) or not -100.0 <= bias <= 100.0:
            raise invalid("logit_bias", f"logit_bias values must be in [-100, 100], got {bias!r} for token {token}")
        pairs[token] = float(bias)
    return tuple(pairs.items())


def conversation(messages: list[s.ChatMessageIn]) -> tuple[ChatTurn, ...]:
    """OpenAI messages → turns (``developer`` is a system message; text parts are joined by newlines)."""
    turns = []
    for i, m in enumerate(messages):
        if m.role == "function":
            raise unsupported(f"messages[{i}]", "function messages (deprecated) are not supported: send tool messages")
        if m.tool_calls and m.role != "assistant":
            raise invalid(f"messages[{i}].tool_calls", "only assistant messages carry tool_calls")
        calls = tuple(_history_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls or ()))
        role = "system" if m.role == "developer" else m.role
        turns.append(ChatTurn(role, _text(m, i, allow_empty=m.role == "assistant"), calls))
    return tuple(turns)


def _history_call(call: s.ToolCallIn, where: str) -> ToolCall:
    if call.type != "function":
        raise unsupported(f"{where}.type", f"tool calls of type {call.type!r} are not supported (only 'function')")
    return ToolCall(call.function.name, call.function.arguments, call.id)


def _text(m: s.ChatMessageIn, i: int, allow_empty: bool) -> str:
    if m.content is None:
        if allow_empty:
            return ""
        raise invalid(f"messages[{i}].content", f"messages[{i}].content is required for a {m.role} message")
    if isinstance(m.content, str):
        return m.content
    texts = []
    for part in m.content:
        if part.type != "text" or part.text is None:
            raise unsupported(f"messages[{i}].content", f"content parts of type {part.type!r} are not supported")
        texts.append(part.text)
    return "\n".join(texts)


def tool_use(req: s.ChatCompletionRequest, family: ToolFamily) -> ToolUse | None:
    """The request's tools and tool choice (None when it offers none)."""
    if req.functions or req.function_call:
        raise unsupported("functions", "functions and function_call (deprecated) are not supported: send tools")
    specs: list[ToolSpec] = []
    for i, tool in enumerate(req.tools or ()):
        if tool.type != "function":
            raise unsupported(f"tools[{i}].type", f"tools of type {tool.type!r} are not supported (only 'function')")
        if tool.function is None:
            raise invalid(f"tools[{i}].function", "a function tool needs its function")
        f = tool.function
        try:
            specs.append(ToolSpec(f.name, f.description or "", f.parameters or {"type": "object", "properties": {}}))
        except ToolError as exc:
            raise invalid(f"tools[{i}].function", str(exc)) from None
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise invalid("tools", "tool names must be distinct")
    choice = _tool_choice(req.tool_choice, names)
    if not specs:
        return None
    return ToolUse(tuple(specs), choice, family, req.parallel_tool_calls is not False)


def _tool_choice(raw: str | s.NamedToolChoice | None, names: list[str]) -> ToolChoice:
    if raw is None:
        return ToolChoice(ToolChoiceMode.AUTO)  # OpenAI's default with tools (without, nothing is offered)
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise invalid("tool_choice", f"tool_choice must be 'auto', 'none', 'required' or a function, got {raw!r}")
        if raw == "required" and not names:
            raise invalid("tool_choice", "tool_choice 'required' needs tools")
        return ToolChoice(ToolChoiceMode(raw))
    if raw.type != "function":
        raise unsupported("tool_choice.type", f"tool_choice of type {raw.type!r} is not supported (only 'function')")
    if raw.function.name not in names:
        raise invalid("tool_choice", f"tool_choice names {raw.function.name!r}, which is not among the tools")
    return ToolChoice(ToolChoiceMode.NAMED, raw.function.name)


def _grammar(req: s.ChatCompletionRequest, tools: ToolUse | None) -> tuple[StructuredOutput | None, str | None]:
    """The reply's grammar: a JSON ``response_format``, or the forced call of ``tools``; and where it came from."""
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        forced = tools.grammar if tools is not None else None
        return forced, "tools" if forced is not None else None
    if tools is not None and tools.choice.offers_tools:
        raise unsupported("response_format", "a JSON response_format cannot be combined with tools the model may call")
    try:
        if fmt.type == "json_object":
            return StructuredOutput(GrammarKind.JSON_OBJECT), "response_format"
        if fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise invalid("response_format.json_schema", "response_format json_schema needs its json_schema")
            schema = fmt.json_schema.schema_
            if schema is None:  # NOTE: OpenAI's schema is optional; without one, any JSON object
                return StructuredOutput(GrammarKind.JSON_OBJECT), "response_format"
            return StructuredOutput(GrammarKind.JSON_SCHEMA, json.dumps(schema)), "response_format"
    except InvalidSamplingParamsError as exc:
        raise invalid("response_format", str(exc)) from None
    raise unsupported(
        "response_format.type",
        f"response_format type {fmt.type!r} is not supported (only 'text', 'json_object' and 'json_schema')",
    )
