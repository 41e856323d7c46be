"""Contact details in text: URLs (``https://x.y/z``, ``www.x.com``, ``shop.example.com``), e-mail addresses and
phone numbers, found by position and compared in a normal form (``ContactGuard`` keeps a reply from showing one that
its sources do not hold).

What counts:

* a URL: a scheme (``http``, ``https``, ``ftp``) and ``://``, or ``www.``, or a bare host whose last label is one of
  ``BARE_TLDS`` (``shop.example.com``), each with an optional path; trailing sentence punctuation is not part of it.
  Normal form: no scheme, the host lower-cased, no trailing ``/``;
* an e-mail address: ``local@host.tld``. Normal form: lower-cased;
* a phone number: 7 to 15 digits in groups separated by one space, ``-`` or ``.`` (a group may be in parentheses),
  optionally after ``+``; not glued to letters or to other digits by ``,``/``.``/``/``/``:``, and not a date
  (``2024-05-12``, ``12.05.2024``), a year range (``2019-2024``) or a decimal (``3.1415926``). Normal form: its
  digits. Order and tracking numbers of that shape count too (``302-1234567``): a number the sources hold passes,
  an invented one is as harmful as an invented phone number.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass


class ContactKind(enum.StrEnum):
    URL = "url"
    EMAIL = "email"
    PHONE = "phone"


@dataclass(frozen=True, slots=True)
class Contact:
    kind: ContactKind
    start: int  # in the text searched
    end: int
    text: str  # text[start:end]

    @property
    def normal(self) -> str:
        return normal_form(self.kind, self.text)


# NOTE: bare hosts only under these TLDs: with any two letters, sentences glued by a missing space ("done.So") and
# file names ("notes.md") would read as hosts. English words that are ccTLDs (it, in, is, at, to, me, no, so, us)
# are left out for the same reason; with a scheme or "www." any TLD counts.
# fmt: off
BARE_TLDS = (
    "com", "net", "org", "edu", "gov", "info", "biz", "io", "co", "ai", "app", "dev", "shop", "store", "online",
    "site", "help", "support", "xyz", "eu", "uk", "de", "fr", "ca", "au", "nl", "es", "ch", "se", "jp", "cn", "ru",
    "br", "mx", "nz", "ie",
)
# fmt: on

MIN_PHONE_DIGITS = 7
MAX_PHONE_DIGITS = 15
# Characters no contact contains: text before one of them can never become part of a contact that ends after it
# (except a phone number's single spaces, which ``ContactGuard`` handles on its own). ASCII contacts only.
BOUNDARY = re.compile(r"[\s<>\"'`{}|\\^\[\]]|[^\x00-\x7f]")

_URL_CHARS = r"[^\s<>\"'`{}|\\^\[\]\x80-\U0010ffff]"
_HOST_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_FINDER = re.compile(
    rf"""
    (?P<email>(?<![\w.%+@-])[A-Za-z0-9._%+-]+@{_HOST_LABEL}(?:\.{_HOST_LABEL})*\.[A-Za-z]{{2,24}}(?![\w-]))
    |(?P<url>(?<![\w@.-])(?:(?i:https?|ftp)://|(?i:www)\.){_URL_CHARS}+)
    |(?P<host>(?<![\w@./:-])(?:{_HOST_LABEL}\.)+(?:{"|".join(BARE_TLDS)})(?![\w@-])(?:/{_URL_CHARS}*)?)
    |(?P<phone>(?<![\w.,/:+-])\+?(?:\(\d+\)|\d+)(?:[ .-](?:\(\d+\)|\d+)|\(\d+\)|(?<=\))\d+)*(?![\w(])(?![.,/:-]\d))
    """,
    re.VERBOSE | re.ASCII,  # NOTE: ASCII digits and letters only, as BOUNDARY assumes
)
_TRAILING = ".,;:!?)*'"
_DIGITS = re.compile(r"\d+", re.ASCII)
_NOT_PHONE = (
    re.compile(r"\d{4}-\d{1,2}-\d{1,2}"),  # ISO date
    re.compile(r"\d{1,2}[.-]\d{1,2}[.-]\d{4}"),  # day, month, year
    re.compile(r"(?:19|20)\d\d-(?:19|20)\d\d"),  # a range of years
    re.compile(r"\d+\.\d+"),  # a decimal
)


def find_contacts(text: str, start: int = 0) -> list[Contact]:
    """Every contact in ``text`` from ``start`` on (the characters before it still count as what precedes), in
    order, not overlapping."""
    found: list[Contact] = []
    pos = start
    while (m := _FINDER.search(text, pos)) is not None:
        pos = m.end()
        kind = m.lastgroup
        if kind == "phone":
            if _is_phone(m.group()):
                found.append(Contact(ContactKind.PHONE, m.start(), m.end(), m.group()))
            else:  # NOTE: a number too short (or a date) must not hide what starts inside it: "0 0.com"
                pos = m.start() + 1
        elif kind == "email":
            found.append(Contact(ContactKind.EMAIL, m.start(), m.end(), m.group()))
        else:
            url = _strip_trailing(m.group())
            if "." in url.split("://", 1)[-1].removeprefix("www."):  # NOTE: "www." or "https://x" alone is no URL
                found.append(Contact(ContactKind.URL, m.start(), m.start() + len(url), url))
    return found


def normal_form(kind: ContactKind, text: str) -> str:
    """The form two mentions of one contact share (see the module's docstring)."""
    if kind is ContactKind.PHONE:
        return "".join(c for c in text if c.isdigit())
    if kind is ContactKind.EMAIL:
        return text.lower()
    rest = re.sub(r"^(?:https?|ftp)://", "", text, flags=re.IGNORECASE)
    host, slash, path = rest.partition("/")
    return (host.lower() + slash + path).rstrip("/")


def url_host(normal: str) -> str:
    """The host of a URL in normal form."""
    return normal.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]


def source_numbers(text: str) -> set[str]:
    """The numbers a source holds, as digits: every number written in the phone shape whatever its length, and
    every run of digits (each group of ``406-8765432-9876543``; ``3021234567`` inside ``ORD3021234567``)."""
    numbers = {m.group() for m in _DIGITS.finditer(text)}
    for m in _FINDER.finditer(text):
        if m.lastgroup == "phone":
            numbers.add(normal_form(ContactKind.PHONE, m.group()))
    return numbers


def _is_phone(text: str) -> bool:
    digits = sum(c.isdigit() for c in text)
    if not MIN_PHONE_DIGITS <= digits <= MAX_PHONE_DIGITS:
        return False
    bare = text.lstrip("+")
    return text.startswith("+") or not any(p.fullmatch(bare) for p in _NOT_PHONE)


def _strip_trailing(url: str) -> str:
    """A URL without the sentence punctuation after it; a closing parenthesis stays when the URL opened one."""
    while url and url[-1] in _TRAILING:
        if url[-1] == ")" and url.count("(") >= url.count(")"):
            break
        url = url[:-1]
    return url
