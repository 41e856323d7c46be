"""Errors raised by the engine.

The hierarchy (everything the engine raises on purpose derives from ``EngineError``)::

    EngineError
    ├── InvalidRequestError          the request itself is wrong; retrying it unchanged fails again
    │   ├── EmptyPromptError         the prompt has no tokens
    │   ├── PromptTooLongError       prompt (+ max_tokens) does not fit the model context / KV pool
    │   └── InvalidSamplingParamsError   a sampling parameter is out of range
    ├── EngineBusy                   admission control refused the request; carries ``retry_after_s``
    ├── RequestAborted               the request was aborted (by the caller or because the engine stopped)
    ├── RequestFailed                this request alone failed inside an engine step (its forward pass, non-finite
    │                                logits, sampling or detokenizing); the rest of its batch went on
    ├── EngineStopped                the engine is not running
    └── ModelLoadError               the model could not be found, parsed or converted

The backend maps these once, at its boundary, to HTTP statuses / websocket codes.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""

    code: str = "engine_error"


class InvalidRequestError(EngineError):
    code = "invalid_request"


class EmptyPromptError(InvalidRequestError):
    code = "empty_prompt"

    def __init__(self) -> None:
        super().__init__("the prompt is empty: it must contain at least one token")


class PromptTooLongError(InvalidRequestError):
    code = "prompt_too_long"

    def __init__(self, prompt_tokens: int, max_tokens: int, limit: int, what: str = "model context") -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.limit = limit
        super().__init__(
            f"prompt of {prompt_tokens} tokens plus max_tokens={max_tokens} exceeds the {what} of {limit} tokens"
        )


class InvalidSamplingParamsError(InvalidRequestError):
    code = "invalid_sampling_params"


class EngineBusy(EngineError):
    code = "busy"

    def __init__(self, message: str, retry_after_s: float) -> None:
        self.retry_after_s = retry_after_s
        super().__init__(f"{message}; retry after {retry_after_s:.1f}s")


class RequestAborted(EngineError):
    code = "aborted"


class RequestFailed(EngineError):
    code = "request_failed"


class EngineStopped(EngineError):
    code = "engine_stopped"


class ModelLoadError(EngineError):
    code = "model_load_failed"
