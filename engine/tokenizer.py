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

import bisect
import functools
import itertools
import json
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import transformers
from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from engine.errors import InvalidRequestError

ROLES = ("system", "user", "assistant", "ipython")  # ipython: a tool result in Llama 3.1+ templates

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

Offsets = list[tuple[int, int]]  # per token, its character span in the rendered (escaped) text
TEMPLATE_OWNER = -1  # ``apply_chat_template_segments``: a token no segment owns (role markers, generation prompt)


# NOTE: the tokenizer classes ``AutoTokenizer`` resolves to themselves; a folder that names one is loaded with it
# directly, because importing ``AutoTokenizer`` imports torch (through the model configs), and a backend whose engine
# runs elsewhere tokenizes without torch (tests/backend/engine_client/test_no_torch.py). Any other class goes
# through ``AutoTokenizer``, which knows the model-specific ones.
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_hf(folder: Path, gguf_file: str | None) -> PreTrainedTokenizerBase:
    named = None
    if gguf_file is None and (folder / "tokenizer_config.json").is_file():
        with open(folder / "tokenizer_config.json", encoding="utf-8") as f:
            named = json.load(f).get("tokenizer_class")
    generic = getattr(transformers, named, None) if named in _GENERIC_CLASSES else None
    if generic is not None:
        loaded: PreTrainedTokenizerBase = generic.from_pretrained(folder)
        return loaded
    from transformers import AutoTokenizer

    kwargs: dict[str, Any] = {} if gguf_file is None else {"gguf_file": gguf_file}
    auto: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(folder, **kwargs)
    return auto


class Tokenizer:
    """A loaded tokenizer: ``encode``, ``decode``, ``apply_chat_template``, ``eos_token_ids``, ``vocab_size``."""

    def __init__(self, folder: str | os.PathLike[str], gguf_file: str | None = None) -> None:
        self.hf: PreTrainedTokenizerBase = _load_hf(Path(folder), gguf_file)
        self.eos_token_ids: tuple[int, ...] = _eos_token_ids(self.hf, Path(folder))
        self.control_tokens: dict[str, int] = _control_tokens(self.hf)
        # NOTE: longest first, so a split takes the longest marker at a position, as the tokenizer does.
        self._control = _alternation(list(self.control_tokens))
        self._escapable = _alternation([*self.control_tokens, _ESCAPE_OPEN])

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token of the vocabulary stands for (its byte-level or SentencePiece form, which
        is never shorter than the text it decodes to), so ``len(text) / max_token_chars`` bounds a text's token
        count from below without tokenizing it."""
        return max((len(piece) for piece in self.hf.get_vocab()), default=1)

    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (None when it ships none: ``FALLBACK_CHAT_TEMPLATE`` renders instead)."""
        template = self.hf.chat_template
        return template if isinstance(template, str) else None

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
        tokens. A template that refuses the conversation raises ``InvalidRequestError`` with its message.
        """
        _check_messages(messages)
        originals: list[str] = []
        escaped = [{**m, "content": self._escape(m["content"], originals)} for m in messages]
        text = self._render(escaped, add_generation_prompt)
        if not originals:
            # NOTE: no content holds a control-token string, so every one in the text is the template's: one encode
            # of the whole text keeps the ids exactly what they always were (prefix-cache reuse relies on it).
            return self.encode(text, add_special_tokens=False)
        return self._encode_escaped(text, originals)[0]

    def apply_chat_template_segments(
        self, messages: Sequence[tuple[str, Sequence[str]]], add_generation_prompt: bool = True
    ) -> tuple[list[int], list[int]]:
        """``apply_chat_template`` for messages ``(role, segment texts)`` whose content is the segments joined.

        Returns the same ids ``apply_chat_template`` gives the joined messages, and for each token the number of the
        segment (counted across the conversation, in order) it belongs to, or ``TEMPLATE_OWNER``. A token belongs to
        the segment holding its first character (its last when the first is the template's); a segment the template
        does not copy verbatim into the text owns no token (its tokens count as the template's).
        """
        plain = [{"role": role, "content": "".join(parts)} for role, parts in messages]
        _check_messages(plain)
        originals: list[str] = []
        escaped: list[dict[str, str]] = []
        cuts: list[list[tuple[int, int]]] = []  # per message: each segment's span in its escaped content
        for message, (_, parts) in zip(plain, messages, strict=True):
            content, to_escaped = self._escape_mapped(message["content"], originals)
            ends = list(itertools.accumulate(len(p) for p in parts))
            cuts.append([(to_escaped(a), to_escaped(b)) for a, b in zip([0, *ends], ends, strict=False)])
            escaped.append({**message, "content": content})
        text = self._render(escaped, add_generation_prompt)
        if originals:
            ids, offsets = self._encode_escaped(text, originals)
        else:
            encoding = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
            ids, offsets = list(encoding["input_ids"]), list(encoding["offset_mapping"])
        return ids, _owners(offsets, _segment_ranges(text, escaped, cuts))

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
        template = None if self.hf.chat_template else FALLBACK_CHAT_TEMPLATE
        try:
            text = self.hf.apply_chat_template(
                messages, chat_template=template, add_generation_prompt=add_generation_prompt, tokenize=False
            )
        except TemplateError as exc:
            # NOTE: templates refuse conversations they cannot render (Mistral v0.1 and a system message, roles that
            # do not alternate) with ``raise_exception``: the request is wrong, not the engine.
            raise InvalidRequestError(f"the model's chat template refused the conversation: {exc}") from exc
        assert isinstance(text, str)  # tokenize=False on a single conversation returns the rendered string
        return text

    def _escape(self, content: str, originals: list[str]) -> str:
        """``content`` with each control-token string (and ``_ESCAPE_OPEN``) replaced by a numbered placeholder."""

        def placeholder(match: re.Match[str]) -> str:
            originals.append(match.group(0))
            return f"{_ESCAPE_OPEN}{len(originals) - 1}{_ESCAPE_CLOSE}"

        return self._escapable.sub(placeholder, content)

    def _escape_mapped(self, content: str, originals: list[str]) -> tuple[str, Callable[[int], int]]:
        """``_escape``, plus a map from a position in ``content`` to the same place in the escaped text (a position
        inside an escaped string maps to its placeholder's start)."""
        first = len(originals)
        escaped = self._escape(content, originals)
        moves: list[tuple[int, int, int]] = []  # (start, end) in content, growth of the text there
        for i, m in enumerate(self._escapable.finditer(content)):
            moves.append((m.start(), m.end(), len(f"{_ESCAPE_OPEN}{first + i}{_ESCAPE_CLOSE}") - (m.end() - m.start())))

        def to_escaped(pos: int) -> int:
            shift = 0
            for start, end, growth in moves:
                if pos <= start:
                    break
                if pos < end:
                    return start + shift
                shift += growth
            return pos + shift

        return escaped, to_escaped

    def _encode_escaped(self, text: str, originals: list[str]) -> tuple[list[int], Offsets]:
        """Encode rendered text whose content was escaped: the control tokens left in it are the template's markers.

        Text between two markers that holds a placeholder is encoded, placeholders restored, with special-token
        parsing off. Every other token keeps the id one encode of the whole text gives it, so the rest of the
        conversation encodes exactly as it would without the escaped content (and its cached prefix still matches).
        NOTE: the template already wrote every special token (BOS included, where the model wants one).
        Also returns each token's character span in ``text`` (a restored string's tokens map into its placeholder).
        """
        encoding = self.hf(text, add_special_tokens=False, return_offsets_mapping=True)
        whole: list[int] = list(encoding["input_ids"])
        offsets: Offsets = list(encoding["offset_mapping"])
        markers = [(m.start(), m.end(), self.control_tokens[m.group(0)]) for m in self._control.finditer(text)]
        ids: list[int] = []
        spans: Offsets = []
        i = pos = 0
        for start, end, marker_id in [*markers, (len(text), len(text), None)]:
            first = i
            while i < len(whole) and offsets[i][0] < start:  # the tokens of the text before this marker
                i += 1
            if _ESCAPE_OPEN in text[pos:start]:
                piece_ids, piece_spans = self._encode_restored(text, pos, start, originals)
                ids += piece_ids
                spans += piece_spans
            else:
                ids += whole[first:i]
                spans += offsets[first:i]
            if marker_id is not None:
                if i >= len(whole) or whole[i] != marker_id:
                    # NOTE: offsets that do not line up with the markers (an unusual tokenizer): encode every
                    # stretch on its own instead; the markers are still the only control tokens.
                    return self._encode_segments(text, markers, originals)
                ids.append(marker_id)
                spans.append((start, end))
                i += 1
            pos = end
        return ids, spans

    def _encode_segments(
        self, text: str, markers: list[tuple[int, int, int]], originals: list[str]
    ) -> tuple[list[int], Offsets]:
        """Each marker as its control id, each stretch between two markers encoded on its own as plain text."""
        ids: list[int] = []
        spans: Offsets = []
        pos = 0
        for start, end, marker_id in [*markers, (len(text), len(text), None)]:
            piece_ids, piece_spans = self._encode_restored(text, pos, start, originals)
            ids += piece_ids
            spans += piece_spans
            if marker_id is not None:
                ids.append(marker_id)
                spans.append((start, end))
            pos = end
        return ids, spans

    def _encode_restored(self, text: str, start: int, end: int, originals: list[str]) -> tuple[list[int], Offsets]:
        """``text[start:end]`` with its placeholders restored, encoded as plain text (no control token), with each
        token's span mapped back into ``text``."""
        segment = text[start:end]
        restored: list[str] = []
        back: list[tuple[int, int, int, int]] = []  # (start in restored, length there, start/end in segment)
        pos = length = 0
        for m in _ESCAPED.finditer(segment):
            restored.append(segment[pos : m.start()])
            length += m.start() - pos
            original = originals[int(m.group(1))]
            back.append((length, len(original), m.start(), m.end()))
            restored.append(original)
            length += len(original)
            pos = m.end()
        restored.append(segment[pos:])
        plain = "".join(restored)
        if not plain:
            return [], []
        encoding = self.hf(plain, add_special_tokens=False, split_special_tokens=True, return_offsets_mapping=True)

        def to_text(r: int, is_end: bool) -> int:
            """A token's start (``is_end`` False) or end inside a restored string maps to its placeholder's start or
            end, so the token keeps a non-empty span."""
            shift = 0
            for at, size, seg_start, seg_end in back:
                if r < at or (is_end and r == at):
                    break
                if r < at + size or (is_end and r == at + size):
                    return start + (seg_end if is_end else seg_start)
                shift = seg_end - (at + size)
            return start + r + shift

        offsets = [(to_text(a, False), to_text(b, True)) for a, b in encoding["offset_mapping"]]
        return list(encoding["input_ids"]), offsets


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


def _segment_ranges(
    text: str, messages: list[dict[str, str]], cuts: list[list[tuple[int, int]]]
) -> list[tuple[int, int, int]]:
    """``(start, end, segment number)`` in the rendered text for every segment whose message content is found there
    verbatim, or with its surrounding whitespace trimmed (Llama 3's template trims), searched in order."""
    ranges: list[tuple[int, int, int]] = []
    pos = number = 0
    for message, message_cuts in zip(messages, cuts, strict=True):
        content = message["content"]
        found = _find_content(text, content, pos)
        if found is not None:
            origin, first, last = found  # content[0] sits at text[origin]; text[first:last] holds what was found
            for j, (a, b) in enumerate(message_cuts):
                a, b = max(origin + a, first), min(origin + b, last)
                if b > a:
                    ranges.append((a, b, number + j))
            pos = last
        number += len(message_cuts)
    return ranges


def _find_content(text: str, content: str, pos: int) -> tuple[int, int, int] | None:
    """Where ``content`` (else its trimmed text) is in ``text`` from ``pos`` on: ``(where content[0] would be, start,
    end of the found text)``; None when it is not there (or empty)."""
    stripped = content.strip()
    if not stripped:
        return None
    at = text.find(content, pos)
    if at >= 0:
        return at, at, at + len(content)
    at = text.find(stripped, pos)
    if at < 0:
        return None
    lead = len(content) - len(content.lstrip())
    return at - lead, at, at + len(stripped)


def _owners(offsets: Offsets, ranges: list[tuple[int, int, int]]) -> list[int]:
    """For each token span, the segment whose range holds its first character (else its last), or TEMPLATE_OWNER."""
    starts = [r[0] for r in ranges]

    def owner(char: int) -> int | None:
        i = bisect.bisect_right(starts, char) - 1
        return ranges[i][2] if i >= 0 and char < ranges[i][1] else None

    out = []
    for start, end in offsets:
        first = owner(start) if end > start else None
        last = owner(end - 1) if end > start else None
        out.append(first if first is not None else last if last is not None else TEMPLATE_OWNER)
    return out


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
