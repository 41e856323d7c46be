"""The streaming contact guard (backend/context/contact_guard.py): what passes, what is replaced, what is held back,
and that the output does not depend on how the reply was split into deltas."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from backend.context.contact_guard import PLACEHOLDERS, ContactGuard, guarded
from backend.context.contacts import ContactKind
from backend.context.grounding import Grounding

SOURCES = Grounding(
    (
        "You are the assistant of Example Shop. Returns: https://shop.example.com/returns. Phone +1 (555) 123-4567.",
        "Write to help@example.com.",
        "Hi, my blender arrived broken. Order 302-1234567, my mail is Jo@Mail.com",  # the customer's message
        '{"order": "406-8765432-9876543", "track": "https:\\/\\/track.example.net\\/p\\/9"}',  # a tool's JSON
    )
)
REPLY = (
    "Sure! See https://shop.example.com/returns or www.fake-help.com, call 555-123-4567 or 1-800-999-0000. "
    "Your order 302-1234567 (406-8765432-9876543) ships, see https://track.example.net/p/9. "
    "Mail jo@mail.com or help@fake.com, or call 1082567394."
)
EXPECTED = (
    "Sure! See https://shop.example.com/returns or [link removed], call 555-123-4567 or [number removed]. "
    "Your order 302-1234567 (406-8765432-9876543) ships, see https://track.example.net/p/9. "
    "Mail jo@mail.com or [email removed], or call [number removed]."
)


def test_allowed_pass_invented_are_replaced_and_counted() -> None:
    kinds: list[ContactKind] = []
    guard = ContactGuard(SOURCES, kinds.append)
    assert guard.feed(REPLY) + guard.flush() == EXPECTED
    assert kinds == [ContactKind.URL, ContactKind.PHONE, ContactKind.EMAIL, ContactKind.PHONE]
    assert guard.blocked == {ContactKind.URL: 1, ContactKind.PHONE: 2, ContactKind.EMAIL: 1}


def test_one_character_at_a_time_releases_each_word_once_decided() -> None:
    guard = ContactGuard(SOURCES)
    shown = [out for out in (guard.feed(c) for c in "Call 1-800-999-0000 now, see x.com.") if out]
    shown.append(guard.flush())
    assert shown == ["Call ", "[number removed] ", "now, ", "see ", "[link removed]."]


def test_a_number_with_spaces_is_held_until_it_ends() -> None:
    guard = ContactGuard(SOURCES)
    assert guard.feed("call 1 800 ") == "call "
    assert guard.feed("999 0000") == ""
    assert guard.feed(" today") == "[number removed] "
    assert guard.flush() == "today"


def test_plain_words_are_held_only_to_the_next_boundary() -> None:
    guard = ContactGuard(Grounding())
    assert guard.feed("Hello there") == "Hello "
    assert guard.feed(", friend. ") == "there, friend. "
    assert guard.flush() == ""


def test_sources_added_later_count() -> None:
    guard = ContactGuard(Grounding())
    assert guard.feed("see www.a-tool.com ") == "see [link removed] "
    guard.add_sources(['{"url": "www.a-tool.com"}'])
    assert guard.feed("or www.a-tool.com ") == "or www.a-tool.com "


def test_host_of_a_source_url_or_address_passes_but_not_another_path() -> None:
    text = "shop.example.com, example.com, shop.example.com/other, https://shop.example.com/returns/"
    assert guarded(text, SOURCES) == "shop.example.com, example.com, [link removed], https://shop.example.com/returns/"


def test_numbers_with_and_without_country_code() -> None:
    sources = Grounding(("call 555-123-4567 or +44 20 7946 0958",))
    text = "+1 555 123 4567, 1 555 123 4567, 020 7946 0958, 20 7946 0958, 7946 0958, 123-4567"
    # a country code is up to 3 digits: added only when written with "+"; "0" + the national number is another
    # number; the last 7 digits of a 10-digit number are its local form
    assert guarded(text, sources) == (
        "+1 555 123 4567, [number removed], [number removed], 20 7946 0958, [number removed], 123-4567"
    )


def test_part_of_a_customer_tracking_number_passes_an_invented_one_does_not() -> None:
    sources = Grounding(("my tracking number is 406-8765432-9876543",))
    assert guarded("8765432 and 406-8765432-9876543 and 406-1111111", sources) == (
        "8765432 and 406-8765432-9876543 and [number removed]"
    )


def test_nothing_to_check_passes_unchanged() -> None:
    text = "Thanks for waiting! Your refund of $49.99 was sent on 2024-05-12. 😊 Anything else?"
    assert guarded(text, Grounding()) == text


_ALPHABET = st.sampled_from([*"ab .,-:/@+()0123459wmoc\n", "www.", "https://", ".com", "555", "é", "\u0663"])
_TEXTS = st.lists(_ALPHABET, max_size=40).map("".join)


@example(pieces=["0 0.com", " "])  # (a number too short to be a phone once hid the host that starts inside it)
@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_TEXTS, max_size=8))
def test_output_is_the_same_however_the_text_is_split(pieces: list[str]) -> None:
    sources = Grounding(("mail ab@ab.com, 555-1234-5555, www.ab.com",))
    guard = ContactGuard(sources)
    streamed = "".join(guard.feed(p) for p in pieces) + guard.flush()
    assert streamed == guarded("".join(pieces), sources)


@settings(max_examples=300, deadline=None)
@given(text=_TEXTS, cuts=st.lists(st.integers(0, 40), max_size=6))
def test_no_prefix_of_a_blocked_contact_is_ever_shown(text: str, cuts: list[int]) -> None:
    guard = ContactGuard(Grounding())
    shown, last = "", 0
    for cut in [*sorted(c for c in cuts if c <= len(text)), len(text)]:
        shown += guard.feed(text[last:cut])
        last = cut
        # what is shown so far is a prefix of the final output: nothing is taken back
        assert guarded(text, Grounding()).startswith(shown)
    shown += guard.flush()
    assert shown == guarded(text, Grounding())


def test_every_split_of_the_reply_gives_the_same_output() -> None:
    for i in range(len(REPLY) + 1):
        for j in range(i, len(REPLY) + 1, 7):
            guard = ContactGuard(SOURCES)
            assert guard.feed(REPLY[:i]) + guard.feed(REPLY[i:j]) + guard.feed(REPLY[j:]) + guard.flush() == EXPECTED


def test_placeholders_name_the_kind() -> None:
    assert PLACEHOLDERS == {
        ContactKind.URL: "[link removed]",
        ContactKind.EMAIL: "[email removed]",
        ContactKind.PHONE: "[number removed]",
    }
