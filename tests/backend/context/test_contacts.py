"""What counts as a contact detail (backend/context/contacts.py): exact spans, kinds and normal forms."""

from __future__ import annotations

import pytest

from backend.context.contacts import ContactKind, find_contacts, normal_form, source_numbers

URL, EMAIL, PHONE = ContactKind.URL, ContactKind.EMAIL, ContactKind.PHONE


def found(text: str) -> list[tuple[ContactKind, str]]:
    return [(c.kind, c.text) for c in find_contacts(text)]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Visit https://www.supportusolutionsoftware.com/services/.",
            [(URL, "https://www.supportusolutionsoftware.com/services/")],
        ),
        ("see www.example.com, then", [(URL, "www.example.com")]),
        ("shop.example.com/returns?x=1).", [(URL, "shop.example.com/returns?x=1")]),
        ("(see https://en.wikipedia.org/wiki/Foo_(bar))", [(URL, "https://en.wikipedia.org/wiki/Foo_(bar)")]),
        ("HTTPS://Shop.Example.com/A", [(URL, "HTTPS://Shop.Example.com/A")]),
        ("amazon.com's page", [(URL, "amazon.com")]),
        ("mail John.Doe@Shop.Example.COM, thanks", [(EMAIL, "John.Doe@Shop.Example.COM")]),
        ("call 1082567394 now", [(PHONE, "1082567394")]),
        ("Order 302-1234567.", [(PHONE, "302-1234567")]),
        ("Call +1 (555) 123-4567 or (555)123-4567", [(PHONE, "+1 (555) 123-4567"), (PHONE, "(555)123-4567")]),
        ("dial 555 0199 or 1.800.555.0199", [(PHONE, "555 0199"), (PHONE, "1.800.555.0199")]),
        ("+44 20 7946 0958", [(PHONE, "+44 20 7946 0958")]),
    ],
)
def test_finds(text: str, expected: list[tuple[ContactKind, str]]) -> None:
    assert found(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "tracking 406-8765432-9876543",  # 17 digits: no phone number
        "123456 is six digits",
        "on 2024-05-12 and 12.05.2024 or 12-05-2024",
        "in 2019-2024",
        "pi is 3.1415926",
        "$1,234,567 and 1234567,89",
        "A1234567 and 1234567B",
        "12345678901234567890a",
        "done.So e.g. i.e. notes.md Node.js v2.0.1",
        "www. and https://x and ftp://",
        "a@b and @home",
        "\u0663\u0660\u0662-\u0661\u0662\u0663\u0664\u0665\u0666\u0667",  # not ASCII digits: ASCII contacts only
    ],
)
def test_leaves_alone(text: str) -> None:
    assert found(text) == []


@pytest.mark.parametrize(
    ("kind", "text", "normal"),
    [
        (URL, "HTTPS://Shop.Example.com/Returns/", "shop.example.com/Returns"),
        (URL, "www.Example.com", "www.example.com"),
        (EMAIL, "Jo@Mail.COM", "jo@mail.com"),
        (PHONE, "+1 (555) 123-4567", "15551234567"),
    ],
)
def test_normal_form(kind: ContactKind, text: str, normal: str) -> None:
    assert normal_form(kind, text) == normal


def test_source_numbers_hold_every_group_and_run() -> None:
    assert source_numbers("tracking 406-8765432-9876543, ref ORD3021234567") == {
        "406",
        "8765432",
        "9876543",
        "4068765432987654" + "3",
        "3021234567",
    }


def test_a_start_keeps_what_precedes_it() -> None:
    text = "x555-123-4567 and 555-123-4567"
    assert [(c.start, c.text) for c in find_contacts(text, 1)] == [(18, "555-123-4567")]
