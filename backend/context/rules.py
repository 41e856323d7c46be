"""Splitter rules: a regex that marks a sentence as one block type, and the compiled set the splitter uses.

A rule is data (it lives in the ``splitter_rules`` table; ``DEFAULT_RULES`` below is the seed). ``RuleSet.compile``
compiles every enabled rule once and refuses, with the reason, a pattern that does not compile or that can match an
empty span. Among the rules that match a sentence the highest ``priority`` wins (ties: the name, so it is stable).
A rule may capture a group named ``ref`` (a section or step number) that the splitter uses to link the block to the
section or step it refers to.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from backend.context.blocks import BlockType
from backend.context.errors import InvalidRuleError

# NOTE: "can match the empty string" is undecidable in general for regexes with lookarounds; we refuse any pattern
# that yields a zero-length match on one of these probes, which catches `x*`, `|`, `\b`, `^`, `(?=…)` and the like.
_EMPTY_PROBES = (
    "",
    "\n",
    "The quick brown fox jumps over the lazy dog? 0123456789 #@-_.,:;!()[]{}",
    "中文？吗呢第一步",
)


@dataclass(frozen=True, slots=True)
class Rule:
    """One splitter rule. ``language`` is ``en``, ``zh`` or ``any`` (metadata for admins; all enabled rules apply)."""

    name: str
    pattern: str
    block_type: BlockType
    priority: int
    language: str = "any"
    enabled: bool = True


@dataclass(frozen=True, slots=True)
class RuleMatch:
    """The rule that claimed a sentence and its ``ref`` capture, if any."""

    rule: Rule
    ref: str | None


@dataclass(frozen=True, slots=True)
class _Compiled:
    rule: Rule
    regex: re.Pattern[str]


def compile_rule(rule: Rule) -> re.Pattern[str]:
    """Compile one rule or raise ``InvalidRuleError`` saying why it is refused."""
    try:
        regex = re.compile(rule.pattern)
    except re.error as exc:
        raise InvalidRuleError(rule.name, f"does not compile: {exc}") from exc
    for probe in _EMPTY_PROBES:
        for m in regex.finditer(probe):
            if m.start() == m.end():
                raise InvalidRuleError(rule.name, f"can match the empty string (at {m.start()} in {probe!r})")
    return regex


class RuleSet:
    """The enabled rules, compiled once, ordered by priority (highest first)."""

    def __init__(self, compiled: list[_Compiled]) -> None:
        self._compiled = compiled

    @classmethod
    def compile(cls, rules: Iterable[Rule]) -> RuleSet:
        enabled = sorted((r for r in rules if r.enabled), key=lambda r: (-r.priority, r.name))
        return cls([_Compiled(rule, compile_rule(rule)) for rule in enabled])

    @property
    def rules(self) -> list[Rule]:
        return [c.rule for c in self._compiled]

    def classify(self, text: str) -> RuleMatch | None:
        """The highest-priority rule that matches ``text``, or None (the caller's fallback type)."""
        for c in self._compiled:
            m = c.regex.search(text)
            if m is not None:
                ref = m.groupdict().get("ref")
                return RuleMatch(c.rule, ref)
        return None

    def find_ref(self, text: str, block_type: BlockType) -> str | None:
        """The ``ref`` capture of the first rule of ``block_type`` that matches ``text`` with one (e.g. "4")."""
        for c in self._compiled:
            if c.rule.block_type is block_type:
                for m in c.regex.finditer(text):
                    ref = m.groupdict().get("ref")
                    if ref:
                        return ref
        return None

    def find_all(self, text: str, block_type: BlockType, skip: frozenset[str] = frozenset()) -> list[str]:
        """Every span of ``text`` that a rule of ``block_type`` (not named in ``skip``) matches."""
        return [
            m.group(0)
            for c in self._compiled
            if c.rule.block_type is block_type and c.rule.name not in skip
            for m in c.regex.finditer(text)
        ]


_ZH_NUM = "[0-9一二三四五六七八九十百零两]+"

# NOTE: the seed of the splitter_rules table. Migration 0002 carries its own frozen copy of these rows, so editing
# this list changes new code's defaults without rewriting history; a later migration updates the table.
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("code_fence", r"^\s*```", BlockType.CODE, 100),
    Rule("json_object", r'^\s*[\[{][\s\S]*"[^"\n]+"\s*:[\s\S]*[\]}]\s*$', BlockType.CODE, 100),
    Rule(
        "order_number",
        r"(?<![\w-])#?\d{3}-\d{5,7}-\d{4,7}(?![\w-])|#\d{6,}(?!\d)"
        r"|(?i:\border\s*(?:id|no\.?|number)?\s*[:#]?\s*)[A-Z0-9-]*\d[A-Z0-9-]{4,}",
        BlockType.IDENTIFIER,
        90,
        "en",
    ),
    Rule(
        "account_or_ticket",
        r"(?i)\b(?:account|acct|ticket|case|tracking|awb|invoice|refund|membership|reference|ref)"
        r"\s*(?:id|no\.?|number|#)?\s*[:#]?\s*"
        r"(?=[A-Z0-9-]*\d)[A-Z0-9][A-Z0-9-]{4,}\b",
        BlockType.IDENTIFIER,
        90,
        "en",
    ),
    # Order and reference codes with a short letter prefix (OD459238745923, AMZ123456789, LP567890123456).
    Rule("prefixed_code", r"\b[A-Z]{2,4}-?\d{8,}\b", BlockType.IDENTIFIER, 90),
    Rule(
        "order_number_zh",
        r"(?:订单号?|工单号?|单号|运单号?|账号|账户|会员号)(?:码|编号)?\s*(?:是|为)?\s*[:：#]?\s*[A-Za-z0-9-]*\d[A-Za-z0-9-]{4,}",
        BlockType.IDENTIFIER,
        90,
        "zh",
    ),
    # NOTE: the CuCom data redacts e-mail addresses to the literal "[email protected]"; it still marks an identifier.
    Rule("email", r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\[email\s+protected\]", BlockType.IDENTIFIER, 90),
    Rule(
        "phone",
        r"(?<![\w-])\+?\d(?:[\s().-]?\d){9,14}(?![\w-])",
        BlockType.IDENTIFIER,
        85,
    ),
    Rule("header_bracket", r"^\s*(?:\[[^\]\n]{1,80}\]|【[^】\n]{1,80}】)\s*[:：]?", BlockType.SECTION, 80),
    Rule("header_markdown", r"^\s*#{1,6}\s+\S", BlockType.SECTION, 80),
    Rule("step_numbered", r"^\s*(?P<ref>\d{1,2})(?:[.)](?!\d)|、)\s*\S", BlockType.STEP, 70),
    Rule("step_word", r"(?i)^\s*step\s+(?P<ref>\d{1,2})\b", BlockType.STEP, 70, "en"),
    Rule("step_zh", rf"^\s*第(?P<ref>{_ZH_NUM})步", BlockType.STEP, 70, "zh"),
    Rule(
        "clause_reference",
        r"(?i)\b(?:according\s+to|as\s+per|per|under|see|in|following)\s+(?:the\s+)?"
        r"(?:section|clause|article|paragraph|§)\s*(?P<ref>\d+(?:\.\d+)*)",
        BlockType.CLAUSE_REFERENCE,
        60,
        "en",
    ),
    Rule(
        "clause_reference_zh",
        rf"(?:按照|根据|依据|依照)\s*第\s*(?P<ref>{_ZH_NUM})\s*条",
        BlockType.CLAUSE_REFERENCE,
        60,
        "zh",
    ),
    Rule(
        "clause_reference_zh_terms", r"(?:根据|按照|依据)[^。！？\n]{0,30}?条款", BlockType.CLAUSE_REFERENCE, 59, "zh"
    ),
    Rule("question_en", r"\?", BlockType.QUESTION, 50, "en"),
    Rule("question_zh", r"？|[吗呢嘛][。.!！]?\s*$", BlockType.QUESTION, 50, "zh"),
)
