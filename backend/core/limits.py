"""The one set of input constraints every boundary shares: REST, the OpenAI API and the websocket.

Strings that reach the database or the tokenizer must be storable and encodable: no NUL (Postgres ``text`` cannot
hold it) and no lone UTF-16 surrogates (JSON's ``"\\ud800"`` escape decodes to one, and it cannot be encoded as
UTF-8). Integers must fit the columns they are compared with (int64, or int32 for ``seq``). Numbers and booleans are
strict: ``"5"``, ``true`` and ``"yes"`` are not numbers, and ``"yes"`` is not a boolean.

``text_problem`` and ``json_too_deep`` are plain functions, so the websocket parser and the HTTP middleware use the
same rules as the pydantic types below.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field, StrictBool, StrictInt

INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
# NOTE: no request of ours nests deeper than ~6 levels; 64 leaves room for clients' extras while keeping every
# recursive walk (json, pydantic, error rendering) far from Python's recursion limit.
MAX_JSON_DEPTH = 64

_SURROGATE = re.compile("[\ud800-\udfff]")
# NOTE: unrolled ("normal* (special normal*)*"): a run of plain characters is one step, not one step each, so a
# 0.6 MB string literal is cut in 2 ms instead of 70 ms, during which this thread holds the GIL (issue 28: /livez).
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_BRACKET = re.compile(rb"[\[\]{}]")


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored or tokenized, or None when it can."""
    if "\x00" in value:
        return "must not contain NUL characters"
    if _SURROGATE.search(value) is not None:
        return "must not contain lone UTF-16 surrogates"
    return None


def _checked_text(value: str) -> str:
    problem = text_problem(value)
    if problem is not None:
        raise ValueError(problem)
    return value


def json_too_deep(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when the JSON text nests arrays/objects deeper than ``limit`` (checked before it is parsed).

    NOTE: string literals are cut out first (a C-speed regex), so brackets inside strings do not count; the scan
    stops at the first level over the limit, so a hostile ``[[[[...`` costs ``limit`` steps.
    """
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth = 0
    for match in _BRACKET.finditer(_JSON_STRING.sub(b'""', data)):
        depth += 1 if match.group() in (b"[", b"{") else -1
        if depth > limit:
            return True
    return False


# Strings: storable text, with the length limits of the columns they go into.
SafeText = Annotated[str, AfterValidator(_checked_text)]
Identifier = Annotated[str, Field(min_length=1, max_length=100), AfterValidator(_checked_text)]
SessionId = Annotated[str, Field(min_length=1, max_length=64), AfterValidator(_checked_text)]
ExternalRef = Annotated[str, Field(max_length=200), AfterValidator(_checked_text)]

# Numbers in JSON bodies: strict (no "5", no true), in the range the database can compare.
NonNegativeInt64 = Annotated[StrictInt, Field(ge=0, le=INT64_MAX)]
Seq = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # message seq is a 32-bit column
Flag = StrictBool
# Numbers in query strings arrive as text, so they are parsed, but never past what the database can compare.
QueryOffset = Annotated[int, Field(ge=0, le=INT64_MAX)]
