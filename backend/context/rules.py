"""Splitter rules: a regex that marks a sentence as one block type, and the compiled set the splitter uses.

A rule is data (it lives in the ``splitter_rules`` table; ``DEFAULT_RULES`` below is the seed). Patterns are RE2
syntax, compiled with google-re2: matching takes time linear in the text, whatever the pattern, so no tenant's rule
can stall a turn (``(a+)+$`` is as fast as ``a+$``). ``compile_rule`` refuses, with the reason, a pattern that RE2
cannot express (lookarounds, backreferences), one whose compiled program is over ``MAX_PROGRAM_SIZE``, and one that
can match an empty span. Among the rules that match a sentence the highest ``priority`` wins (ties: the name, so it
is stable). A rule may capture a group named ``ref`` (a section or step number) that the splitter uses to link the
block to the section or step it refers to.

NOTE: RE2's ``\\d``, ``\\s``, ``\\w`` and ``\\b`` are ASCII, and it has no lookarounds. A rule that must look at the
character before or after its text consumes it outside a group named ``value``: the group is what the rule found
(``find_all`` returns it) and the next search resumes at its end, so that character is still there for the next
match, as a lookaround would leave it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import re2

from backend.context.acts import GREETING, HANDOFF
from backend.context.blocks import BlockType
from backend.context.errors import InvalidRuleError

# NOTE: the size of a compiled pattern, in RE2 program instructions. A search costs at most text length x program
# size when RE2 has to leave its DFA for its NFA (measured: up to ~2 ns per byte and instruction), so this bounds one
# rule's cost; the sum over a tenant's own rules is capped by the admin service. The largest default rule compiles to
# under 5,000: a Unicode class such as \p{L} takes many instructions, though the DFA runs it as fast as [a-z].
MAX_PROGRAM_SIZE = 10_000

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False  # NOTE: a refused pattern is the admin's 422, not a line on the server's stderr

# NOTE: an empty match depends only on the characters around it, and RE2's assertions (^ $ \A \z \b \B, with or
# without (?m)) tell four kinds apart: none (the text's edge), a word character, a newline, anything else. Every
# position of every text of up to two characters drawn from one of each covers every pair, so an empty match at
# any of them is exactly "can match the empty string".
_KINDS = ("a", "\n", " ")
_EMPTY_PROBES = ("", *_KINDS, *(x + y for x in _KINDS for y in _KINDS))

# RE2's error for a lookaround or a backreference, which Python's re has: the reason then says so.
_LOOKAROUND = re2.compile(r"invalid perl operator: \(\?<?[=!]|invalid escape sequence: \\\d", _OPTIONS)


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
class CompiledRule:
    """A rule and its compiled pattern; ``program_size`` is what ``MAX_PROGRAM_SIZE`` bounds."""

    rule: Rule
    regex: Any  # re2._Regexp (google-re2 ships no type hints)
    program_size: int


def compile_rule(rule: Rule) -> CompiledRule:
    """Compile one rule or raise ``InvalidRuleError`` saying why it is refused."""
    try:
        regex = re2.compile(rule.pattern, _OPTIONS)
    except re2.error as exc:
        raise InvalidRuleError(rule.name, f"not RE2 syntax: {_reason(exc)}") from exc
    size = int(regex.programsize)
    if size > MAX_PROGRAM_SIZE:
        raise InvalidRuleError(
            rule.name, f"compiles to {size} RE2 instructions; the limit is {MAX_PROGRAM_SIZE} (simplify the pattern)"
        )
    for probe in _EMPTY_PROBES:
        for at in range(len(probe) + 1):
            if regex.fullmatch(probe, at, at) is not None:
                raise InvalidRuleError(rule.name, f"can match the empty string (at {at} in {probe!r})")
    return CompiledRule(rule, regex, size)


def program_sizes(patterns: Iterable[str]) -> list[int]:
    """The RE2 program size of each pattern (0 for one RE2 refuses: a stored rule the chat leaves out)."""
    sizes = []
    for pattern in patterns:
        try:
            sizes.append(int(re2.compile(pattern, _OPTIONS).programsize))
        except re2.error:
            sizes.append(0)
    return sizes


def _reason(exc: Exception) -> str:
    raw = exc.args[0] if exc.args else exc
    reason = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    if _LOOKAROUND.search(reason):
        reason += " (RE2 has no lookarounds or backreferences)"
    return reason


def _matches(regex: Any, data: bytes) -> Iterator[tuple[str, Any]]:
    """Each match in UTF-8 ``data``: its text (the ``value`` group when it took part, else the whole match) and the
    match. The next search starts where that text ends, so a character that a rule consumed as context can be the
    next match's context.

    NOTE: bytes, encoded once by the caller: google-re2 encodes a ``str`` again on every call, which made a search
    per match quadratic in the message.
    """
    value = regex.groupindex.get("value")
    pos = 0
    while pos <= len(data):
        m = regex.search(data, pos)
        if m is None:
            return
        start, end = m.span(value) if value is not None and m.span(value) != (-1, -1) else m.span()
        yield data[start:end].decode("utf-8", "surrogatepass"), m
        pos = end if end > pos else pos + 1


def _ref(m: Any) -> str | None:
    ref: bytes | None = m.groupdict().get("ref")
    return ref.decode("utf-8", "surrogatepass") if ref is not None else None


def _by_priority(rules: Iterable[Rule]) -> list[Rule]:
    return sorted((r for r in rules if r.enabled), key=lambda r: (-r.priority, r.name))


class RuleSet:
    """The enabled rules, compiled once, ordered by priority (highest first)."""

    def __init__(self, compiled: list[CompiledRule]) -> None:
        self._compiled = compiled

    @classmethod
    def compile(cls, rules: Iterable[Rule]) -> RuleSet:
        """Every enabled rule, or ``InvalidRuleError`` for the first one refused."""
        return cls([compile_rule(rule) for rule in _by_priority(rules)])

    @classmethod
    def compile_usable(cls, rules: Iterable[Rule]) -> tuple[RuleSet, list[InvalidRuleError]]:
        """The enabled rules that compile, and why each other one was refused: a stored rule that a newer check
        refuses (a Python-only pattern from before RE2) must not stop its tenant's chat."""
        usable: list[CompiledRule] = []
        refused: list[InvalidRuleError] = []
        for rule in _by_priority(rules):
            try:
                usable.append(compile_rule(rule))
            except InvalidRuleError as exc:
                refused.append(exc)
        return cls(usable), refused

    @property
    def rules(self) -> list[Rule]:
        return [c.rule for c in self._compiled]

    def classify(self, text: str) -> RuleMatch | None:
        """The highest-priority rule that matches ``text``, or None (the caller's fallback type)."""
        data = text.encode("utf-8", "surrogatepass")
        for c in self._compiled:
            m = c.regex.search(data)
            if m is not None:
                return RuleMatch(c.rule, _ref(m))
        return None

    def find_ref(self, text: str, block_type: BlockType) -> str | None:
        """The ``ref`` capture of the first rule of ``block_type`` that matches ``text`` with one (e.g. "4")."""
        data = text.encode("utf-8", "surrogatepass")
        for c in self._compiled:
            if c.rule.block_type is block_type:
                for _, m in _matches(c.regex, data):
                    ref = _ref(m)
                    if ref:
                        return ref
        return None

    def find_all(self, text: str, block_type: BlockType, skip: frozenset[str] = frozenset()) -> list[str]:
        """What each rule of ``block_type`` (not named in ``skip``) finds in ``text``, rule by rule in order."""
        data = text.encode("utf-8", "surrogatepass")
        return [
            found
            for c in self._compiled
            if c.rule.block_type is block_type and c.rule.name not in skip
            for found, _ in _matches(c.regex, data)
        ]


_ZH_NUM = "[0-9一二三四五六七八九十百零两]+"
# NOTE: Python's Unicode \w, which the patterns were first written against (RE2's \w is ASCII only): a number
# glued to a Chinese word ("手机13812345678") is part of that word, not an identifier of its own.
_W = r"\p{L}\p{N}_"
_D = r"\p{Nd}"  # Python's Unicode \d: "１３８１２３４５６７８" typed in full width is a phone number too
_EDGE = rf"(?:^|[^{_W}-])"  # no word character or dash before (consumed, outside ``value``)
_END = rf"(?:[^{_W}-]|$)"  # nor after

# NOTE: the seed of the splitter_rules table. Each migration that seeds or updates it carries its own frozen copy
# (0002 the first, 0006 the RE2 rewrite), so editing this list changes new code's defaults without rewriting
# history; a later migration updates the table, and tests/migrations fails while the table at head differs.
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule("code_fence", r"^\s*```", BlockType.CODE, 100),
    Rule("json_object", r'^\s*[\[{][\s\S]*"[^"\n]+"\s*:[\s\S]*[\]}]\s*$', BlockType.CODE, 100),
    Rule(
        "order_number",
        rf"{_EDGE}(?P<value>#?{_D}{{3}}-{_D}{{5,7}}-{_D}{{4,7}}){_END}|#{_D}{{6,}}"
        r"|(?i:\border\s*(?:id|no\.?|number)?\s*[:#]?\s*)[A-Z0-9-]*\d[A-Z0-9-]{4,}",
        BlockType.IDENTIFIER,
        90,
        "en",
    ),
    # An id of 5+ letters, digits and dashes with a digit in it, spelled out by where that first digit is.
    Rule(
        "account_or_ticket",
        r"(?i)\b(?:account|acct|ticket|case|tracking|awb|invoice|refund|membership|reference|ref)"
        r"\s*(?:id|no\.?|number|#)?\s*[:#]?\s*"
        r"(?:\d[A-Z0-9-]{4,}|[A-Z](?:[A-Z-]{3,}\d|[A-Z-]{2}\d[A-Z0-9-]|[A-Z-]\d[A-Z0-9-]{2}|\d[A-Z0-9-]{3})"
        r"[A-Z0-9-]*)\b",
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
    Rule(
        "email",
        rf"[{_W}.+-]+@[{_W}-]+(?:\.[{_W}-]+)+|\[email\s+protected\]",
        BlockType.IDENTIFIER,
        90,
    ),
    Rule("phone", rf"{_EDGE}(?P<value>\+?{_D}(?:[\s().-]?{_D}){{9,14}}){_END}", BlockType.IDENTIFIER, 85),
    Rule("header_bracket", r"^\s*(?:\[[^\]\n]{1,80}\]|【[^】\n]{1,80}】)\s*[:：]?", BlockType.SECTION, 80),
    Rule("header_markdown", r"^\s*#{1,6}\s+\S", BlockType.SECTION, 80),
    # "1. Open", "2) Choose", "3、填写"; not "1.5 kg" (a digit right after the dot).
    Rule("step_numbered", r"^\s*(?P<ref>\d{1,2})(?:[.)](?:\s+\S|[^\d\s])|、\s*\S)", BlockType.STEP, 70),
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
    Rule("handoff_request", HANDOFF, BlockType.HANDOFF, 58),
    Rule("greeting", GREETING, BlockType.GREETING, 55),
    Rule("question_en", r"\?", BlockType.QUESTION, 50, "en"),
    Rule("question_zh", r"？|[吗呢嘛][。.!！]?\s*$", BlockType.QUESTION, 50, "zh"),
)
