"""A reply's contact details checked while it streams: a URL, e-mail address or phone number (``contacts.py``) may
be shown only when its sources (``Grounding``) hold it, in normal form; any other is replaced by a placeholder.

``feed`` takes the reply's text as it streams and returns what may be shown now; ``flush``, at the end, the rest
(checked). Held back is only the tail that could still become, or grow into, a contact: the text after the last
character no contact contains (``contacts.BOUNDARY``: a space, a quote, a bracket), and, when the text ends in digits
and phone separators, the number being written. What was returned is never taken back, and the output is the same
however the text was split into deltas.

What passes, besides a contact the sources hold: a URL that is only the host of a source's URL or e-mail address
(``shop.example.com`` when a source has ``https://shop.example.com/returns``), and a number whose digits a source
holds in any layout (``contacts.source_numbers``), with or without a country code (``+1 555 123 4567`` and
``555-123-4567``).

NOTE: the customer's own messages are sources: repeating the customer's order number or e-mail address back is not
inventing it. NOTE: a blocked contact becomes a placeholder (``PLACEHOLDERS``), not nothing: dropping it leaves
sentences like "call us at  or write to ." that read as a fault, and the placeholder keeps the stored transcript
(stored = shown) legible to the agent who reads it later.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from backend.context.contacts import (
    BOUNDARY,
    MIN_PHONE_DIGITS,
    Contact,
    ContactKind,
    find_contacts,
    normal_form,
    source_numbers,
    url_host,
)
from backend.context.grounding import Grounding

PLACEHOLDERS = {
    ContactKind.URL: "[link removed]",
    ContactKind.EMAIL: "[email removed]",
    ContactKind.PHONE: "[number removed]",
}
_PHONE_TAIL = frozenset("0123456789()+ .-")
COUNTRY_CODE_DIGITS = 3
SOURCE_CACHE_SIZE = 512  # sources whose contacts are kept (a tenant's prompt and policy, recent sessions' messages)


class ContactGuard:
    """One reply's guard. ``on_block`` hears of each contact it replaces (for metrics), with its kind."""

    def __init__(self, grounding: Grounding, on_block: Callable[[ContactKind], None] | None = None) -> None:
        self._urls: set[str] = set()
        self._hosts: set[str] = set()
        self._emails: set[str] = set()
        self._numbers: set[str] = set()
        self.grounding = grounding
        self._on_block = on_block
        self._text = ""  # the reply so far
        self._done = 0  # characters of it decided (returned, checked)
        self.blocked: collections.Counter[ContactKind] = collections.Counter()
        self.add_sources(grounding.texts)

    def add_sources(self, texts: Iterable[str]) -> None:
        """More sources (a tool's results, read during the turn)."""
        for text in texts:
            held = _held_by(text)
            self._urls |= held.urls
            self._hosts |= held.hosts
            self._emails |= held.emails
            self._numbers |= held.numbers

    def allows(self, kind: ContactKind, text: str) -> bool:
        """Whether the sources hold this contact (``text`` as written in the reply)."""
        normal = normal_form(kind, text)
        if kind is ContactKind.URL:
            return normal in self._urls or normal in self._hosts
        if kind is ContactKind.EMAIL:
            return normal in self._emails
        return normal in self._numbers or any(_same_number(normal, text, n) for n in self._numbers)

    def feed(self, delta: str) -> str:
        """Take the next piece of the reply; returns what may be shown now."""
        self._text += delta
        contacts = find_contacts(self._text, self._done)
        return self._release(self._hold_from(contacts), contacts)

    def flush(self) -> str:
        """The reply ended: the rest, checked."""
        return self._release(len(self._text), find_contacts(self._text, self._done))

    def _hold_from(self, contacts: list[Contact]) -> int:
        """Where the tail that could still become a contact starts: after the last boundary, or where the number
        the text ends in starts (its groups may be separated by spaces)."""
        text, i = self._text, len(self._text)
        while i > self._done and not BOUNDARY.match(text, i - 1):
            i -= 1
        hold, j = i, len(text)
        while j > self._done and text[j - 1] in _PHONE_TAIL:
            j -= 1
        tail = text[j:]
        if any(c.isdigit() for c in tail):
            hold = min(hold, len(text) - len(tail.lstrip(" .-")))
        for c in contacts:
            if c.start < hold < c.end:
                hold = c.start  # NOTE: none crosses a boundary, nor a number's start: a guard against a missed case
        return hold

    def _release(self, upto: int, contacts: list[Contact]) -> str:
        """Decide ``[done, upto)``: its contacts checked, the blocked ones replaced."""
        out, pos = [], self._done
        for c in contacts:
            if c.end > upto:
                break
            out += [self._text[pos : c.start], self._shown(c)]
            pos = c.end
        out.append(self._text[pos:upto])
        self._done = upto
        return "".join(out)

    def _shown(self, c: Contact) -> str:
        if self.allows(c.kind, c.text):
            return c.text
        self.blocked[c.kind] += 1
        if self._on_block is not None:
            self._on_block(c.kind)
        return PLACEHOLDERS[c.kind]


@dataclass(frozen=True, slots=True)
class _Held:
    """The contacts one source holds, in normal form."""

    urls: frozenset[str]
    hosts: frozenset[str]  # of its URLs and e-mail addresses
    emails: frozenset[str]
    numbers: frozenset[str]


@functools.lru_cache(maxsize=SOURCE_CACHE_SIZE)
def _held_by(text: str) -> _Held:
    """NOTE: cached: a turn's sources are mostly the last turn's (the tenant's prompt and policy, the session's
    earlier messages); reading 20 kB of them takes ~6 ms, which every turn would otherwise pay on the event loop."""
    # NOTE: a JSON body may escape "/" as "\/"; the model reads and copies the URL without it.
    text = text.replace("\\/", "/")
    urls, hosts, emails = set(), set(), set()
    for c in find_contacts(text):
        if c.kind is ContactKind.URL:
            urls.add(c.normal)
            hosts.add(url_host(c.normal))
        elif c.kind is ContactKind.EMAIL:
            emails.add(c.normal)
            hosts.add(c.normal.rsplit("@", 1)[1])
    return _Held(frozenset(urls), frozenset(hosts), frozenset(emails), frozenset(source_numbers(text)))


def _same_number(digits: str, written: str, source: str) -> bool:
    """One number with and without its country code: the reply's drops up to 3 leading digits of the source's, or
    (written with ``+``) adds up to 3 in front of it; the shorter has at least ``MIN_PHONE_DIGITS``."""
    extra = len(source) - len(digits)
    if 0 < extra <= COUNTRY_CODE_DIGITS and len(digits) >= MIN_PHONE_DIGITS:
        return source.endswith(digits)
    if 0 < -extra <= COUNTRY_CODE_DIGITS and len(source) >= MIN_PHONE_DIGITS and written.startswith("+"):
        return digits.endswith(source)
    return False


def guarded(text: str, grounding: Grounding) -> str:
    """``text`` as the guard shows it, whole (a reply that is not streamed)."""
    guard = ContactGuard(grounding)
    return guard.feed(text) + guard.flush()
