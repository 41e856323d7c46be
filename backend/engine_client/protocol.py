"""The engine as the backend sees it: the one interface the chat service, the OpenAI service and the admin services
call (the app state holds one, ``backend/api/state.py``).

The in-process ``LLMEngine`` satisfies it as it is (mypy checks that below); a client of remote engine replicas is the
other implementation (issue 31). So the interface speaks plain values only (``backend/engine_client/values.py``):
prompts as text, chat messages or token ids with their segment spans (``TokenizedPrompt``: the backend tokenizes,
the engine only checks), ``SamplingParams``, and results as frozen dataclasses — all of which cross HTTP as JSON.
Nothing in it is a tensor, a lock or a part of the engine.

Calling it:

- ``generate`` is the one stream, and the one bridge from the engine's thread to the event loop: an async iterator
  of ``TokenDelta`` events, then one ``RequestFinished``; closing it early aborts the request, as does ``abort``.
- Tokenizing takes milliseconds for a long chat: callers run it off the event loop (``backend/core/offload.py``).
- Every control call is awaited through ``backend/engine_client/control.py``, with a deadline for an engine whose
  ``control_blocks`` is true (a remote engine). Cache control that may write or delete disk files
  (``invalidate``, ``invalidate_prefix``, ``flush_namespace``, ``release_session``, ``erase_session``,
  ``configure_cache``) runs on a thread for every engine (``control.threaded``); the reads and pins (``stats``,
  ``session_footprint``, ``pin_prefix``, ``unpin``, ``cache_settings``) run in place for the in-process engine
  (bookkeeping in memory).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from backend.engine_client.values import (
    DEFAULT_SHARE,
    CacheFootprint,
    CacheSettings,
    EngineInfo,
    EngineStats,
    ErasureResult,
    FairShare,
    GenerationEvent,
    InvalidationResult,
    PinResult,
    Prompt,
    SamplingParams,
    TokenizedPrompt,
)


class TextTokenizer(Protocol):
    """The model's tokenizer, as the backend counts text with it (the splitter's block lengths, the prompt guard)."""

    # NOTE: the Hugging Face tokenizer itself: the prompt guard counts a huge prompt with its Rust batch encoder,
    # which leaves the GIL free (backend/openai/prompt_guard.py).
    hf: Any

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...


class EngineClient(Protocol):
    """What the backend asks of an inference engine, and nothing more."""

    @property
    def info(self) -> EngineInfo:
        """Fixed at load: block size, KV blocks, the model's context, its fingerprint."""
        ...

    @property
    def is_running(self) -> bool:
        """The engine serves (its model loaded, its loop running)."""
        ...

    @property
    def tokenizer(self) -> TextTokenizer: ...

    # ------------------------------------------------------------------ prompts

    @property
    def prompt_limit(self) -> int:
        """The most tokens a request may hold, prompt and reply: the one prompt-limit formula."""
        ...

    def prompt_token_floor(self, texts: Iterable[str]) -> int:
        """A lower bound of the tokens ``texts`` encode to, from their length alone (no tokenizing)."""
        ...

    def tokenize(self, prompt: Prompt) -> list[int]: ...

    def tokenize_prompt(self, prompt: Prompt) -> TokenizedPrompt:
        """Token ids and segment spans; a ``TokenizedPrompt`` passed to ``generate`` is never tokenized again."""
        ...

    # ------------------------------------------------------------------ requests

    def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        namespace: str = "default",
        request_id: str | None = None,
        session: str | None = None,
        share: FairShare = DEFAULT_SHARE,
    ) -> AsyncGenerator[GenerationEvent, None]:
        """Stream the reply; raises the engine's errors (``backend/engine_client/values.py``) from the iterator.
        ``share``: the tenant (and its weight) the engine's fair scheduler charges the request to."""
        ...

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is (a finished or unknown one: nothing happens)."""
        ...

    # ------------------------------------------------------------------ sessions and the cache

    def invalidate(
        self,
        namespace: str,
        *,
        session: str | None = None,
        from_position: int | None = None,
        reason: str = "invalidated",
    ) -> InvalidationResult:
        """Free ``session``'s cached blocks from token ``from_position`` on, and every block that depends on them."""
        ...

    def invalidate_prefix(
        self, namespace: str, token_ids: Sequence[int], from_position: int, reason: str = "invalidated"
    ) -> InvalidationResult:
        """Shared text changed (a handbook section): free the cached chain ``token_ids`` spells from token
        ``from_position`` on, and every block that depends on it, in every session of ``namespace``."""
        ...

    def flush_namespace(self, namespace: str, reason: str = "flushed") -> InvalidationResult: ...

    def release_session(self, session: str) -> int:
        """Free the blocks only ``session`` used (to disk where there is a disk tier); returns the blocks freed."""
        ...

    def erase_session(self, session: str, namespace: str) -> ErasureResult:
        """Remove ``session``'s blocks from every tier (erasure)."""
        ...

    def session_footprint(self, session: str) -> CacheFootprint: ...

    def pin_prefix(self, namespace: str, token_ids: Sequence[int]) -> PinResult: ...

    def unpin(self, namespace: str) -> int: ...

    def set_session_temperature(self, session: str, temperature: float) -> None:
        """The session's semantic temperature (0 cold .. 1 hot), which eviction may weigh."""
        ...

    def cache_settings(self) -> CacheSettings: ...

    def configure_cache(self, **changes: object) -> CacheSettings:
        """Change engine-wide cache settings at runtime (``InvalidRequestError`` names a value it refuses)."""
        ...

    def stats(self) -> EngineStats: ...


if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

    def _in_process(engine: LLMEngine) -> EngineClient:
        return engine  # NOTE: mypy's proof that the in-process engine satisfies the interface
