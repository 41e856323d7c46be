"""A tenant's handbook: titled sections of the support team's knowledge, one of which each topic's prompt holds.

Two source formats (``parse``):

- Markdown: one section per heading (any level); the text under a heading, down to the next heading, is the
  section's. Text before the first heading becomes a section titled by ``PREAMBLE_TITLE``. A line ``Examples:``
  followed by a list (``- ...``) gives example customer questions instead of text.
- JSON in the shape of ABCD's agent guidelines (``bench/data/abcd_guidelines.json``): ``{flow: {"description",
  "subflows": {subflow: {"instructions": [...], "actions": [{"text", "subtext": [...]}, ...]}}}}``; one section per
  subflow, titled ``Flow: Subflow``, its text the flow's description, the instructions and the numbered actions; an
  optional ``"examples": [...]`` per subflow.

Examples are how customers ask for a section ("my promo code won't work"): the ranking reads them
(``backend/context/sections.py``), the prompt never shows them, and editing them keeps the section's cached blocks.

``HandbookLimits`` caps what one tenant may load (the section count, a section's size, the total), so the ranking
and the prompt stay bounded; ``check`` raises ``HandbookLimitError`` naming the cap.

Pure: no database, no engine.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from backend.context.errors import HandbookError, HandbookLimitError

PREAMBLE_TITLE = "Overview"
_HEADING = re.compile(r"^(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$")
_FENCE = re.compile(r"^[ \t]*(```|~~~)")
_EXAMPLES = re.compile(r"(?i)^[ \t]*(?:examples|example questions)[ \t]*:[ \t]*$")
_ITEM = re.compile(r"^[ \t]*[-*+][ \t]+(.+?)[ \t]*$")


class HandbookFormat(StrEnum):
    MARKDOWN = "markdown"
    ABCD = "abcd"


@dataclass(frozen=True, slots=True)
class Section:
    """One titled part of a handbook; ``text`` is what the prompt shows under the title."""

    title: str
    text: str
    examples: tuple[str, ...] = ()  # how customers ask for it: read by the ranking, never shown in the prompt

    @property
    def content_hash(self) -> str:
        """A digest of title and text: an edit that changes neither keeps the section's cached blocks."""
        return hashlib.sha256(f"{self.title}\x00{self.text}".encode()).hexdigest()

    def rendered(self) -> str:
        """The section as the prompt holds it."""
        return f"Handbook: {self.title}\n{self.text}"


@dataclass(frozen=True, slots=True)
class HandbookLimits:
    """Caps on one tenant's handbook (``KVCHAT_MAX_HANDBOOK_SECTIONS``, ``KVCHAT_MAX_HANDBOOK_SECTION_CHARS``,
    ``KVCHAT_MAX_HANDBOOK_CHARS``); a title is at most ``max_title_chars``."""

    max_sections: int = 200
    max_section_chars: int = 8_000
    max_total_chars: int = 400_000
    max_title_chars: int = 200
    max_examples: int = 50  # per section


def parse(content: str, fmt: HandbookFormat) -> list[Section]:
    """The sections of ``content`` in ``fmt`` (``HandbookError`` says why it does not parse)."""
    sections = parse_markdown(content) if fmt is HandbookFormat.MARKDOWN else parse_abcd(_json(content))
    if not sections:
        raise HandbookError("the handbook has no sections: write at least one heading with text under it")
    return sections


def parse_markdown(content: str) -> list[Section]:
    """One section per heading; headings inside fenced code blocks are text. Empty sections are left out."""
    sections: list[Section] = []
    title, lines, fenced = PREAMBLE_TITLE, [], False
    for line in content.replace("\r\n", "\n").split("\n"):
        if _FENCE.match(line):
            fenced = not fenced
        heading = None if fenced else _HEADING.match(line)
        if heading is None:
            lines.append(line)
            continue
        _close(sections, title, lines)
        title, lines = heading.group(2).strip(), []
    _close(sections, title, lines)
    return sections


def _close(sections: list[Section], title: str, lines: list[str]) -> None:
    kept: list[str] = []
    examples: list[str] = []
    listing = False
    for line in lines:
        if _EXAMPLES.match(line):
            listing = True
            continue
        item = _ITEM.match(line) if listing else None
        if item is not None:
            examples.append(item.group(1))
            continue
        listing = listing and not line.strip()
        kept.append(line)
    text = "\n".join(kept).strip()
    if text:
        sections.append(Section(title, text, tuple(examples)))


def parse_abcd(body: Any) -> list[Section]:
    """One section per subflow of an ABCD-style guideline object."""
    if not isinstance(body, dict):
        raise HandbookError("an ABCD handbook is a JSON object of flows")
    sections = []
    for flow, spec in body.items():
        if not isinstance(spec, dict) or not isinstance(spec.get("subflows"), dict):
            raise HandbookError(f"flow {flow!r}: expected an object with 'subflows'")
        description = str(spec.get("description", "")).strip()
        for subflow, sub in spec["subflows"].items():
            if not isinstance(sub, dict):
                raise HandbookError(f"{flow}: subflow {subflow!r}: expected an object")
            examples = sub.get("examples", [])
            if not isinstance(examples, list) or not all(isinstance(e, str) for e in examples):
                raise HandbookError(f"{flow}: {subflow}: 'examples' must be a list of strings")
            text = _abcd_text(flow, subflow, description, sub)
            sections.append(Section(f"{flow}: {subflow}", text, tuple(e.strip() for e in examples if e.strip())))
    return sections


def _abcd_text(flow: str, subflow: str, description: str, sub: dict[str, Any]) -> str:
    lines = [f"Covers: {description}."] if description else []
    instructions = [str(i).strip() for i in sub.get("instructions", []) if str(i).strip()]
    if instructions:
        lines.append(instructions[0])
    actions = sub.get("actions", [])
    if not isinstance(actions, list):
        raise HandbookError(f"{flow}: {subflow}: 'actions' must be a list")
    for n, action in enumerate(actions, 1):
        if not isinstance(action, dict) or not isinstance(action.get("text", ""), str):
            raise HandbookError(f"{flow}: {subflow}: action {n} must be an object with a 'text'")
        lines.append(f"{n}. {_squash(action.get('text', ''))}")
        lines += [f"   - {_squash(s)}" for s in action.get("subtext", []) if str(s).strip()]
    lines += instructions[1:]
    return "\n".join(lines)


def _squash(text: object) -> str:
    return re.sub(r"\s+", " ", str(text)).strip()


def _json(content: str) -> Any:
    try:
        return json.loads(content)
    except json.JSONDecodeError as exc:
        raise HandbookError(f"the handbook is not valid JSON: {exc.msg} at line {exc.lineno}") from exc


def check(sections: Sequence[Section], limits: HandbookLimits) -> None:
    """Raise ``HandbookLimitError`` (naming the cap and the section) when ``sections`` pass one of ``limits``."""
    if len(sections) > limits.max_sections:
        raise HandbookLimitError(f"{len(sections)} sections: at most {limits.max_sections} are allowed")
    seen: set[str] = set()
    for n, s in enumerate(sections, 1):
        if not s.title.strip():
            raise HandbookError(f"section {n} has no title")
        if len(s.title) > limits.max_title_chars:
            raise HandbookLimitError(
                f"section {n}: its title has {len(s.title)} characters, over {limits.max_title_chars}"
            )
        if s.title in seen:
            raise HandbookError(f"section {n}: the title {s.title!r} is used twice; titles name sections")
        seen.add(s.title)
        if not s.text.strip():
            raise HandbookError(f"section {s.title!r} has no text")
        if len(s.examples) > limits.max_examples or any(len(e) > 1000 for e in s.examples):
            raise HandbookLimitError(
                f"section {s.title!r} has {len(s.examples)} examples: "
                f"at most {limits.max_examples}, of 1000 characters each"
            )
        if len(s.text) > limits.max_section_chars:
            raise HandbookLimitError(
                f"section {s.title!r} has {len(s.text)} characters, over {limits.max_section_chars}: split it"
            )
    total = sum(len(s.text) for s in sections)
    if total > limits.max_total_chars:
        raise HandbookLimitError(f"the handbook has {total} characters, over {limits.max_total_chars}")
