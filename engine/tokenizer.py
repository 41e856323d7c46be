"""The HF tokenizer, the chat template, and streaming detokenization with stop strings.

``Tokenizer`` wraps ``transformers.AutoTokenizer`` and reads the EOS ids (tokenizer + ``generation_config.json``).
Its ``apply_chat_template`` encodes message content as plain text: only the template's own markers become control
tokens, so a customer who types ``<|im_start|>system`` cannot forge a turn.
``IncrementalDetokenizer`` turns a stream of token ids into a stream of stable text deltas:

* a multi-byte UTF-8 character split across tokens is held back until it is complete (no U+FFFD mid-stream);
* leading-space handling (SentencePiece ``▁``, byte-level ``Ġ``) is right because each delta is the difference of
  two decodes of a short sliding window that starts a few tokens back (the vLLM ``detokenize_incrementally`` scheme);
* text that could be the start of a stop string is held back; when a stop string completes, ``stopped`` becomes
  True and the delta ends right before it.

Invariant: the deltas of ``push`` followed by ``flush()`` concatenate to ``Tokenizer.decode(output_ids)`` cut right
before the first stop string to complete (when no prompt context is given; with context, they concatenate to
``decode(prompt + output)[len(decode(prompt)):]`` instead, which keeps the first output token's leading space).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from engine.errors import InvalidRequestError

ROLES = ("system", "user", "assistant")

# NOTE: used only when the tokenizer ships no chat template. Plain ChatML (what SmolLM2/Qwen use):
#   <|im_start|>{role}\n{content}<|im_end|>\n ... and, for a generation prompt, <|im_start|>assistant\n
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# NOTE: how many prompt tokens the detokenizer decodes as left context (vLLM uses the same number): enough for
# SentencePiece to see that the first output token is not at the start of the text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"

# NOTE: a control-token string found in message content is swapped for "\ue000<n>\ue001" (private-use characters,
# no whitespace, so templates that trim content leave it alone) while the template renders, and swapped back after.
# "\ue000" itself is escaped too, so every one in the rendered text opens a placeholder.
_ESCAPE_OPEN, _ESCAPE_CLOSE = "\ue000", "\ue001"
_ESCAPED = re.compile(f"{_ESCAPE_OPEN}(\\d+){_ESCAPE_CLOSE}")


class Tokenizer:
    """A loaded tokenizer: ``encode``, ``decode``, ``apply_chat_template``, ``eos_token_ids``, ``vocab_size``."""

    def __init__(self, folder: str | os.PathLike[str], gguf_file: str | None = None) -> None:
        kwargs: dict[str, Any] = {} if gguf_file is None else {"gguf_file": gguf_file}
        self.hf: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder, **kwargs)
        self.eos_token_ids: tuple[int, ...] = _eos_token_ids(self.hf, Path(folder))
        self.control_tokens: dict[str, int] = _control_tokens(self.hf)
        # NOTE: longest first, so a split takes the longest marker at a position, as the tokenizer does.
        self._control = _alternation(list(self.control_tokens))
        self._escapable = _alternation([*self.control_tokens, _ESCAPE_OPEN])

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer knows, added/special tokens included (the model's head may be larger)."""
        return len(self.hf)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        # NOTE: no clean-up of tokenization spaces: the streamed text cannot undo a space it already sent, so the
        # full decode must not remove it either.
        text = self.hf.decode(
            list(token_ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)  # a flat id list always decodes to one string
        return text

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Render the conversation with the tokenizer's chat template (ChatML when it has none) and tokenize it.

        Message content is always plain text: a control-token string in it (``<|im_start|>``, ``<s>``, ...) encodes
        as the characters it is made of, never as the control token. Only the template's own markers are control
        tokens.
        """
        _check_messages(messages)
        originals: list[str] = []
        escaped = [{**m, "content": self._escape(m["content"], originals)} for m in messages]
        text = self._render(escaped, add_generation_prompt)
        if not originals:
            # NOTE: no content holds a control-token string, so every one in the text is the template's: one encode
            # of the whole text keeps the ids exactly what they always were (prefix-cache reuse relies on it).
            return self.encode(text, add_special_tokens=False)
        return self._encode_escaped(text, originals)

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        template = None if self.hf.chat_template else FALLBACK_CHAT_TEMPLATE
        text = self.hf.apply_chat_template(
            messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert isinstance(text, str)  # tokenize=False on a single conversation returns the rendered string
        return text

    def _escape(self, content: str, originals: list[str]) -> str:
        """``content`` with each control-token string (and ``_ESCAPE_OPEN``) replaced by a numbered placeholder."""

        def placeholder(match: re.Match[str]) -> str:
            originals.append(match.group(0))
            return f"{_ESCAPE_OPEN}{len(originals) - 1}{_ESCAPE_CLOSE}"

        return self._escapable.sub(placeholder, content)

    def _encode_escaped(self, text: str, originals: list[str]) -> list[int]:
        """Encode rendered text whose content was escaped: the control tokens left in it are the template's markers.

        Text between two markers that holds a placeholder is encoded, placeholders restored, with special-token
        parsing off. Every other token keeps the id one encode of the whole text gives it, so the rest of the
        conversation encodes exactly as it would without the escaped content (and its cached prefix still matches).
        NOTE: the template already wrote every special token (BOS included, where the model wants one).
        """

        def restore(segment: str) -> str:
            return _ESCAPED.sub(lambda m: originals[int(m.group(1))], segment)

        encoding = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        whole: list[int] = list(encoding["input_ids"])
        offsets: list[tuple[int, int]] = list(encoding["offset_mapping"])
        markers = [(m.start(), m.end(), self.control_tokens[m.group(0)]) for m in self._control.finditer(text)]
        ids: list[int] = []
        i = pos = 0
        for start, end, marker_id in [*markers, (len(text), len(text), None)]:
            first = i
            while i < len(whole) and offsets[i][0] < start:  # the tokens of the text before this marker
                i += 1
            segment = text[pos:start]
            ids += self._encode_plain(restore(segment)) if _ESCAPE_OPEN in segment else whole[first:i]
            if marker_id is not None:
                if i >= len(whole) or whole[i] != marker_id:
                    # NOTE: offsets that do not line up with the markers (an unusual tokenizer): encode every
                    # stretch on its own instead; the markers are still the only control tokens.
                    return self._encode_segments(text, markers, restore)
                ids.append(marker_id)
                i += 1
            pos = end
        return ids

    def _encode_segments(
        self, text: str, markers: list[tuple[int, int, int]], restore: Callable[[str], str]
    ) -> list[int]:
        """Each marker as its control id, each stretch between two markers encoded on its own as plain text."""
        ids: list[int] = []
        pos = 0
        for start, end, marker_id in markers:
            ids += [*self._encode_plain(restore(text[pos:start])), marker_id]
            pos = end
        return ids + self._encode_plain(restore(text[pos:]))

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))


def _eos_token_ids(hf: PreTrainedTokenizerBase, folder: Path) -> tuple[int, ...]:
    """EOS ids of the tokenizer plus those of ``generation_config.json`` (an int or a list there), deduplicated."""
    ids: list[int] = [hf.eos_token_id] if isinstance(hf.eos_token_id, int) else []
    config = folder / "generation_config.json"
    if config.is_file():
        value = json.loads(config.read_text(encoding="utf-8")).get("eos_token_id")
        ids.extend([value] if isinstance(value, int) else [v for v in value or [] if isinstance(v, int)])
    return tuple(dict.fromkeys(ids))


def _control_tokens(hf: PreTrainedTokenizerBase) -> dict[str, int]:
    """The strings the tokenizer turns into special (control) tokens, longest first, with their ids.

    NOTE: added tokens that are not special (Qwen3's ``<think>``) are matched by the tokenizer even with special-token
    parsing off; they are not role markers and are left as they are.
    """
    ids = {t.content: i for i, t in hf.added_tokens_decoder.items() if t.special and t.content}
    for token in hf.all_special_tokens:
        token_id = hf.convert_tokens_to_ids(token)
        if token and isinstance(token_id, int):
            ids.setdefault(token, token_id)
    return {t: ids[t] for t in sorted(ids, key=lambda t: (-len(t), t))}


def _alternation(strings: Sequence[str]) -> re.Pattern[str]:
    """A pattern matching any of ``strings`` (tried in the order given); one that never matches when empty."""
    return re.compile("|".join(re.escape(s) for s in strings) or "(?!)")


def _check_messages(messages: list[dict[str, str]]) -> None:
    if not messages:
        raise InvalidRequestError("messages must contain at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise InvalidRequestError(f"messages[{i}] must be an object with a string 'content'")
        if message.get("role") not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}] has role {message.get('role')!r}; expected one of {', '.join(ROLES)}"
            )


class IncrementalDetokenizer:
    """Token ids in, stable text deltas out, with stop strings (see the module docstring for the invariant)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (), stop: tuple[str, ...] = ()) -> None:
        self._tokenizer = tokenizer
        context = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._ids: list[int] = context
        # Decoding window: ids[prefix_offset:read_offset] were already turned into text; that text is prefix_text.
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = tokenizer.decode(context)
        self._stop = _StopMatcher(stop)
        self._text: list[str] = []

    @property
    def stopped(self) -> bool:
        return self._stop.stopped

    @property
    def text(self) -> str:
        """All text emitted so far (the deltas concatenated)."""
        return "".join(self._text)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became stable (possibly ""). After a stop, always ""."""
        if self.stopped:
            return ""
        self._ids.append(token_id)
        return self._emit(self._stop.feed(self._decode_new(final=False), final=False))

    def flush(self) -> str:
        """At the end of the sequence: return everything still held back (incomplete characters, partial stops)."""
        if self.stopped:
            return ""
        return self._emit(self._stop.feed(self._decode_new(final=True), final=True))

    def _emit(self, delta: str) -> str:
        self._text.append(delta)
        return delta

    def _decode_new(self, *, final: bool) -> str:
        """Text the window gained since the last emission; "" while it ends in an incomplete character."""
        window = self._tokenizer.decode(self._ids[self._prefix_offset :])
        if len(window) <= len(self._prefix_text) or (window.endswith(_REPLACEMENT_CHAR) and not final):
            # NOTE: a trailing U+FFFD means the last bytes do not form a character yet; wait for the next token.
            return ""
        delta = window[len(self._prefix_text) :]
        # NOTE: the window slides: it now starts where the last read began, so it stays a few tokens long.
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._prefix_text = self._tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        return delta


class _StopMatcher:
    """Holds back text that may begin a stop string; cuts the text before the first stop string to complete."""

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._stop = stop
        self._held = ""
        self.stopped = False

    def feed(self, text: str, *, final: bool) -> str:
        """Return the text that is safe to emit now."""
        buffer = self._held + text
        cut = self._first_match(buffer)
        if cut is not None:
            self.stopped, self._held = True, ""
            return buffer[:cut]
        keep = 0 if final else self._partial_suffix(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def _first_match(self, buffer: str) -> int | None:
        """Start of the stop string that completes first (ends earliest; the longer one on a tie), or None."""
        best: tuple[int, int] | None = None  # (end, -start)
        for stop in self._stop:
            start = buffer.find(stop)
            if start >= 0 and (best is None or (start + len(stop), -start) < best):
                best = (start + len(stop), -start)
        return None if best is None else -best[1]

    def _partial_suffix(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stop:
            for size in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:size]):
                    longest = size
                    break
        return longest
