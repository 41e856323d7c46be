"""Split one message into typed semantic blocks.

1. Cut the text into units: a fenced code block or a bracket-balanced JSON value is one unit; other lines are cut
   into sentences (after ``. ! ?`` plus whitespace, or after ``。！？``), never right after a step marker (``1.``) or
   an abbreviation (``no.``, ``ref.``, ``e.g.``: "tracking no. 1Z999…" is one sentence, so it stays an identifier).
2. Type each unit with the rule set (``RuleSet.classify``); no match is ``context``.
3. Merge fragments shorter than ``min_block_length`` tokens into their neighbour (section headers excepted); the
   merged block takes the type of the higher-ranked part, so a short order number never loses ``identifier``.
4. Link each block to its parent: a step reference ("step 2 of that") → that step (else the latest step); a clause
   reference ("according to section 4") → the section whose header names 4; otherwise the previous block of the
   same epoch (in this message or the session's history).

Pure: tokens are counted by the callable the caller passes (the engine's tokenizer in the server, a word count in
tests), so the splitter runs without a model.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from backend.context.blocks import Block, BlockKey, BlockType, content_hash
from backend.context.rules import RuleSet

TokenCounter = Callable[[str], int]

DEFAULT_MIN_BLOCK_LENGTH = 8

_SENTENCE_END = re.compile(r"[.!?]+[\"')\]]*\s+|[。！？]+[\"'”’)\]]*\s*")
# NOTE: a period after these is not a sentence end ("Dr. Rao", "approx. 3 days", "e.g. a refund"); after the words
# that also end sentences ("no", "num", "art", "sec") only when a code follows: "Order no. A1234567" is one sentence,
# "I said no. Then he left." two.
_ABBREVIATION = re.compile(
    r"(?i)(?<![\w.])(?:nr|nos|ref|acct|tel|approx|vs|e\.g|i\.e|mr|mrs|ms|dr|dept|qty|pcs|pp|pg|vol|fig|para)\.$"
)
_ABBREVIATION_BEFORE_CODE = re.compile(r"(?i)(?<![\w.])(?:no|num|art|sec|ph)\.$")
_CODE_NEXT = re.compile(r"\s*#?[\w-]*\d")
_STEP_MARKER_ONLY = re.compile(r"^\s*(?:\d{1,2}[.)]|(?i:step)\s+\d{1,2}[.:)]?)\s*$")
_STEP_REFERENCE = re.compile(r"(?i)\bstep\s+(\d{1,2})\b|第\s*([0-9一二三四五六七八九十]+)\s*步")
_ZH_DIGITS = {"零": 0, "一": 1, "二": 2, "两": 2, "三": 3, "四": 4, "五": 5, "六": 6, "七": 7, "八": 8, "九": 9}

# Type precedence when fragments merge: what a context builder must never lose ranks first.
_RANK = {
    BlockType.CODE: 8,
    BlockType.IDENTIFIER: 7,
    BlockType.SECTION: 6,
    BlockType.STEP: 5,
    BlockType.CLAUSE_REFERENCE: 4,
    BlockType.HANDOFF: 3,
    BlockType.QUESTION: 2,
    BlockType.CONTEXT: 1,
    BlockType.GREETING: 0,  # "Hi." merged into the sentence after it is that sentence's type
}


@dataclass(frozen=True, slots=True)
class _Unit:
    start: int
    end: int
    type: BlockType


def word_count(text: str) -> int:
    """A model-free token count for tests and benchmarks: words, and each CJK character as one token."""
    return len(re.findall(r"[\u4e00-\u9fff]|[^\s\u4e00-\u9fff]+", text))


def zh_number(text: str) -> int | None:
    """``"4"`` → 4, ``"十二"`` → 12, ``"三"`` → 3; None for anything else."""
    if text.isdigit():
        return int(text)
    if text and all(ch in _ZH_DIGITS or ch == "十" for ch in text):
        if "十" not in text:
            return int("".join(str(_ZH_DIGITS[ch]) for ch in text))
        tens, _, ones = text.partition("十")
        return (_ZH_DIGITS[tens] if tens else 1) * 10 + (_ZH_DIGITS[ones] if ones else 0)
    return None


class Splitter:
    """Splits messages with one compiled rule set; cheap to call, safe to share (no mutable state)."""

    def __init__(
        self, rules: RuleSet, count_tokens: TokenCounter, min_block_length: int = DEFAULT_MIN_BLOCK_LENGTH
    ) -> None:
        self.rules = rules
        self.count_tokens = count_tokens
        self.min_block_length = min_block_length

    def split(self, text: str, *, seq: int, epoch: int, history: Sequence[Block] = ()) -> list[Block]:
        """The blocks of message ``seq`` (in order); ``history`` is the session's earlier blocks, oldest first."""
        units = [self._typed(text, start, end) for start, end in _unit_spans(text)]
        merged = self._merge(text, units)
        blocks: list[Block] = []
        for index, unit in enumerate(merged):
            body = text[unit.start : unit.end]
            parent = self._parent(body, unit.type, epoch, [*history, *blocks])
            blocks.append(
                Block(
                    BlockKey(seq, index),
                    unit.type,
                    unit.start,
                    unit.end,
                    body,
                    self.count_tokens(body),
                    content_hash(body),
                    epoch,
                    parent,
                )
            )
        return blocks

    def _typed(self, text: str, start: int, end: int) -> _Unit:
        match = self.rules.classify(text[start:end])
        return _Unit(start, end, match.rule.block_type if match else BlockType.CONTEXT)

    def _parent(self, body: str, kind: BlockType, epoch: int, earlier: list[Block]) -> BlockKey | None:
        # NOTE: references are looked for whatever type won: "per section 4, order #123?" is an identifier block
        # that still depends on section 4.
        ref = self.rules.find_ref(body, BlockType.CLAUSE_REFERENCE)
        section = _find_section(ref, earlier) if ref is not None else None
        if section is not None:
            return section
        step = _find_step(body, earlier) if kind is not BlockType.STEP else None  # "Step 3" is a step, not a reference
        if step is not None:
            return step
        same_epoch = [b for b in earlier if b.epoch == epoch]
        return same_epoch[-1].key if same_epoch else None

    def _merge(self, text: str, units: list[_Unit]) -> list[_Unit]:
        # NOTE: section headers never merge: they are short by nature, and clause references must find them whole.
        out: list[_Unit] = []
        for unit in units:
            joinable = out and BlockType.SECTION not in (out[-1].type, unit.type)
            if joinable and (self._short(text, out[-1]) or self._short(text, unit)):
                out[-1] = _join(out[-1], unit)
            else:
                out.append(unit)
        return out

    def _short(self, text: str, unit: _Unit) -> bool:
        return self.count_tokens(text[unit.start : unit.end]) < self.min_block_length


def _join(a: _Unit, b: _Unit) -> _Unit:
    return _Unit(a.start, b.end, a.type if _RANK[a.type] >= _RANK[b.type] else b.type)


def _unit_spans(text: str) -> list[tuple[int, int]]:
    """Character spans of the units, whitespace trimmed, in order."""
    spans: list[tuple[int, int]] = []
    lines = _line_spans(text)
    i = 0
    while i < len(lines):
        start, end = lines[i]
        line = text[start:end]
        stripped = line.lstrip()
        if stripped.startswith("```"):
            j = next((k for k in range(i + 1, len(lines)) if text[slice(*lines[k])].strip().startswith("```")), None)
            if j is not None:
                spans.append((start, lines[j][1]))
                i = j + 1
                continue
        if stripped[:1] in "{[" and stripped[:1]:
            j = _balanced_end(text, lines, i)
            if j is not None:
                spans.append((start, lines[j][1]))
                i = j + 1
                continue
        spans.extend(_sentence_spans(text, start, end))
        i += 1
    return [_trim(text, s, e) for s, e in spans if text[s:e].strip()]


def _line_spans(text: str) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for line in text.splitlines(keepends=True):
        spans.append((pos, pos + len(line.rstrip("\r\n"))))
        pos += len(line)
    return spans


def _balanced_end(text: str, lines: list[tuple[int, int]], first: int) -> int | None:
    """The line where the JSON value opened on line ``first`` closes (brackets outside strings), or None."""
    depth, in_string, escaped = 0, False, False
    for k in range(first, len(lines)):
        for ch in text[slice(*lines[k])]:
            if in_string:
                escaped = not escaped and ch == "\\"
                in_string = escaped or ch != '"'
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return k
    return None


def _sentence_spans(text: str, start: int, end: int) -> list[tuple[int, int]]:
    spans, begin = [], start
    for m in _SENTENCE_END.finditer(text, start, end):
        if _STEP_MARKER_ONLY.match(text[begin : m.end()]) or m.end() >= end or _after_abbreviation(text, begin, m):
            continue
        spans.append((begin, m.end()))
        begin = m.end()
    spans.append((begin, end))
    return spans


def _after_abbreviation(text: str, begin: int, m: re.Match[str]) -> bool:
    """Whether the cut at ``m`` is only the period of an abbreviation ("no." in "Order no. A1234567")."""
    if m.group(0).rstrip() != ".":
        return False
    if _ABBREVIATION.search(text, begin, m.start() + 1) is not None:
        return True
    return _ABBREVIATION_BEFORE_CODE.search(text, begin, m.start() + 1) is not None and bool(
        _CODE_NEXT.match(text, m.end())
    )


def _trim(text: str, start: int, end: int) -> tuple[int, int]:
    while start < end and text[start].isspace():
        start += 1
    while end > start and text[end - 1].isspace():
        end -= 1
    return start, end


def _find_section(ref: str, earlier: list[Block]) -> BlockKey | None:
    """The latest section block whose header names ``ref`` (``## 4 Returns``, ``[Section 4]:``, ``第四条``)."""
    number = zh_number(ref)
    labels = {ref} | ({str(number)} if number is not None else set())
    for block in reversed(earlier):
        if block.type is not BlockType.SECTION:
            continue
        header = block.text.splitlines()[0] if block.text else ""
        for label in labels:
            if re.search(rf"(?<![\d.]){re.escape(label)}(?![\d])", header):
                return block.key
        if number is not None and re.search(rf"第\s*{_zh_or_digits(number)}\s*条", header):
            return block.key
    return None


def _zh_or_digits(number: int) -> str:
    zh = "零一二三四五六七八九"
    spelled = (
        zh[number]
        if number < 10
        else ("十" if number < 20 else zh[number // 10] + "十") + (zh[number % 10] if number % 10 else "")
    )
    return f"(?:{number}|{spelled})"


def _find_step(body: str, earlier: list[Block]) -> BlockKey | None:
    """For "step 2 of that" / "第二步": the step block numbered 2, else the latest step block; None if no reference."""
    m = _STEP_REFERENCE.search(body)
    if m is None:
        return None
    number = zh_number(m.group(1) or m.group(2))
    steps = [b for b in earlier if b.type is BlockType.STEP]
    for block in reversed(steps):
        if number is not None and _step_number(block.text) == number:
            return block.key
    return steps[-1].key if steps else None


def _step_number(text: str) -> int | None:
    m = re.match(r"\s*(?:(\d{1,2})(?:[.)]|、)|(?i:step)\s+(\d{1,2})|第([0-9一二三四五六七八九十]+)步)", text)
    if m is None:
        return None
    return zh_number(next(g for g in m.groups() if g))
