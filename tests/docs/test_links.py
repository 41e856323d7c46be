"""Every relative link in README.md and the Markdown under docs/ (and the folders' READMEs) resolves: the file is
there, and a ``#fragment`` names a heading of the target (GitHub's anchors)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    page
    for page in [
        ROOT / "README.md",
        *ROOT.glob("docs/**/*.md"),
        *ROOT.glob("*/README.md"),
        ROOT / "bench/data/README.md",
    ]
    if not any(part.startswith(".") for part in page.relative_to(ROOT).parts)
)
# [text](target) or [text](target "title"); images too. Code spans and fenced blocks are removed first.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def links(page: Path) -> list[str]:
    text = _CODE_SPAN.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [target for target in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but ``-`` and ``_`` dropped, spaces to ``-``; repeats get
    ``-1``, ``-2``..."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    for heading in _HEADING.findall(text):
        plain = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", plain.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken(page: Path) -> list[str]:
    problems = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            problems.append(f"{target}: no heading #{fragment} in {os.path.relpath(resolved, page.parent)}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken(page) == []


def test_the_pages_checked_include_the_reference_docs() -> None:
    names = {str(p.relative_to(ROOT)) for p in PAGES}
    assert {"README.md", "docs/architecture.md", "docs/configuration.md", "docs/benchmarks.md"} <= names


def test_a_missing_file_and_a_missing_heading_are_caught(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title here\n\n## Replies: repetition rate\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#replies-repetition-rate) [gone](missing.md) [bad](other.md#nope) [web](https://x.y/z) "
        "`[code](missing-in-code.md)` [self](#a-heading)\n\n## A heading\n",
        encoding="utf-8",
    )
    assert broken(page) == ["missing.md: no such file", "other.md#nope: no heading #nope in other.md"]
