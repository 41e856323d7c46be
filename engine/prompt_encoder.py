"""Every prompt form the engine accepts, turned into token ids (with segment spans), and the one prompt-limit check.

Forms: chat messages (the model's chat template), a string (plain encoding), token ids (checked against the
vocabulary), a ``SegmentedPrompt`` (the chat template over its messages, each token labelled with its segment), and a
``TokenizedPrompt`` — what ``encode`` returned earlier, e.g. when the caller needed the token count first — which is
never tokenized again (its ids are only checked). A caller that tokenizes once passes the ``TokenizedPrompt`` on.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from engine.errors import EmptyPromptError, InvalidRequestError, PromptTooLongError
from engine.prompt import SegmentedPrompt, TokenizedPrompt, common_prefix, spans_from_owners

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

ChatMessages = Sequence[dict[str, str]]
Prompt = ChatMessages | Sequence[int] | str | SegmentedPrompt | TokenizedPrompt


def needs_tokenizing(prompt: Prompt) -> bool:
    """Whether ``encode`` runs the tokenizer for ``prompt`` (milliseconds for a long chat: not on an event loop)."""
    if isinstance(prompt, TokenizedPrompt | str | SegmentedPrompt):
        return not isinstance(prompt, TokenizedPrompt)
    return not all(isinstance(t, int) for t in prompt)


def _is_system(message: dict[str, str]) -> bool:
    return message.get("role") == "system"


class PromptEncoder:
    """Encodes prompts for one model and checks them against its limit (``limit`` tokens, prompt and reply)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int, pool_tokens: int) -> None:
        self.tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_model_len = max_model_len
        self._pool_tokens = pool_tokens
        # NOTE: a deployment has a few system prompts and sends one with every turn: render each once, not per request
        self._render_system = functools.lru_cache(maxsize=64)(self._render_system_uncached)

    @property
    def limit(self) -> int:
        """The most tokens a request may hold (prompt and reply): the model's context or the KV pool, the smaller."""
        return min(self._max_model_len, self._pool_tokens)

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``EmptyPromptError`` or ``PromptTooLongError`` (naming the bound: context or pool)."""
        if prompt_tokens == 0:
            raise EmptyPromptError()
        if prompt_tokens + max_tokens > self.limit:
            what = "model context" if self.limit == self._max_model_len else "KV cache pool"
            raise PromptTooLongError(prompt_tokens, max_tokens, self.limit, what)

    def token_floor(self, texts: Iterable[str]) -> int:
        """A lower bound of the tokens ``texts`` encode to, from their length alone (no tokenizing): a caller can
        refuse a prompt that can never fit before paying for its encoding."""
        return sum(len(t) for t in texts) // self.tokenizer.max_token_chars

    def encode(self, prompt: Prompt) -> TokenizedPrompt:
        """The prompt's token ids, the spans of a ``SegmentedPrompt``'s segments and template (none otherwise), and
        how many ids a chat prompt's leading system message(s) fill."""
        if isinstance(prompt, TokenizedPrompt):
            ids = self._checked_ids(prompt.token_ids)
            return TokenizedPrompt(ids, prompt.spans, min(prompt.system_tokens, len(ids)))
        if isinstance(prompt, SegmentedPrompt):
            if not prompt.messages:
                raise EmptyPromptError()
            parts = [(m.role, [s.text for s in m.segments]) for m in prompt.messages]
            ids, owners = self.tokenizer.apply_chat_template_segments(parts, prompt.add_generation_prompt)
            system = self._system_tokens(ids, prompt.as_messages())
            return TokenizedPrompt(ids, spans_from_owners(owners, prompt.segments), system)
        if isinstance(prompt, str):
            return TokenizedPrompt(self.tokenizer.encode(prompt))
        items: list[object] = list(prompt)
        if not items:
            raise EmptyPromptError()
        ids = [t for t in items if isinstance(t, int) and not isinstance(t, bool)]
        if len(ids) == len(items):
            return TokenizedPrompt(self._checked_ids(ids))
        messages = [m for m in items if isinstance(m, dict)]
        if len(messages) == len(items):
            ids = self.tokenizer.apply_chat_template(messages)
            return TokenizedPrompt(ids, system_tokens=self._system_tokens(ids, messages))
        raise InvalidRequestError("prompt must be chat messages, a string, or a list of token ids")

    def _system_tokens(self, ids: Sequence[int], messages: ChatMessages) -> int:
        """How many of ``ids`` (``messages`` rendered) are the leading system message(s): the length of the prefix
        they share with those messages rendered alone (any template: no assumption on where a message ends)."""
        lead = tuple((m["role"], m["content"]) for m in itertools.takewhile(_is_system, messages))
        return common_prefix(ids, self._render_system(lead)) if lead else 0

    def _render_system_uncached(self, lead: tuple[tuple[str, str], ...]) -> tuple[int, ...]:
        messages = [{"role": role, "content": content} for role, content in lead]
        return tuple(self.tokenizer.apply_chat_template(messages, add_generation_prompt=False))

    def _checked_ids(self, ids: Sequence[object]) -> list[int]:
        if not ids:
            raise EmptyPromptError()
        out = [t for t in ids if isinstance(t, int) and not isinstance(t, bool)]
        if len(out) != len(ids):
            raise InvalidRequestError("prompt must be chat messages, a string, or a list of token ids")
        bad = [t for t in out if not 0 <= t < self._vocab_size]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {self._vocab_size})")
        return out
