"""The splitter: units and types per default rule in English and Chinese, merging, spans, parents."""

from __future__ import annotations

import pytest

from backend.context.blocks import BlockKey, BlockType, content_hash
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.splitter import Splitter, word_count, zh_number

RULES = RuleSet.compile(DEFAULT_RULES)


def split(text: str, min_block_length: int = 1) -> list[tuple[str, str]]:
    blocks = Splitter(RULES, word_count, min_block_length).split(text, seq=1, epoch=0)
    return [(b.type.value, b.text) for b in blocks]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "My parcel never came. Where is it? I paid extra for express.",
            [
                ("context", "My parcel never came."),
                ("question", "Where is it?"),
                ("context", "I paid extra for express."),
            ],
        ),
        (
            "我的包裹没到。它在哪里？我付了加急费。",
            [("context", "我的包裹没到。"), ("question", "它在哪里？"), ("context", "我付了加急费。")],
        ),
        ("能退货吗", [("question", "能退货吗")]),
        (
            "To return it:\n1. Open your orders.\n2) Pick the item.\nStep 3 print the label.",
            [
                ("context", "To return it:"),
                ("step", "1. Open your orders."),
                ("step", "2) Pick the item."),
                ("step", "Step 3 print the label."),
            ],
        ),
        ("第一步，打开订单。第二步，选择商品。", [("step", "第一步，打开订单。"), ("step", "第二步，选择商品。")]),
        (
            "[Refund policy]: refunds take 5-7 days.\n## Returns\nReturn within 30 days.",
            [
                ("section", "[Refund policy]: refunds take 5-7 days."),
                ("section", "## Returns"),
                ("context", "Return within 30 days."),
            ],
        ),
        (
            "According to section 4, I get a refund. 按照第4条，应该退款。根据退货条款，可以退。",
            [
                ("clause_reference", "According to section 4, I get a refund."),
                ("clause_reference", "按照第4条，应该退款。"),
                ("clause_reference", "根据退货条款，可以退。"),
            ],
        ),
        (
            "Order #617-8899001-1122334 marked delivered. Mail: [email protected] or 9876543210.",
            [
                ("identifier", "Order #617-8899001-1122334 marked delivered."),
                ("identifier", "Mail: [email protected] or 9876543210."),
            ],
        ),
        ("订单号：2024051812345。还没发货。", [("identifier", "订单号：2024051812345。"), ("context", "还没发货。")]),
        (
            'Here is the payload:\n{"order": "1",\n "items": [1, 2]}\nand the script:\n```\nx = 1. y = 2.\n```',
            [
                ("context", "Here is the payload:"),
                ("code", '{"order": "1",\n "items": [1, 2]}'),
                ("context", "and the script:"),
                ("code", "```\nx = 1. y = 2.\n```"),
            ],
        ),
        ("Nothing special here at all", [("context", "Nothing special here at all")]),
        ("Hello! 我要转人工客服！", [("greeting", "Hello!"), ("handoff", "我要转人工客服！")]),
        ("您好。Can I talk to a human?", [("greeting", "您好。"), ("handoff", "Can I talk to a human?")]),
    ],
)
def test_default_rules_split_and_type_english_and_chinese(text: str, expected: list[tuple[str, str]]) -> None:
    assert split(text) == expected


def test_spans_hashes_and_token_counts_describe_the_text_exactly() -> None:
    text = "  Hello there.   Where is order #7894561230?  "
    blocks = Splitter(RULES, word_count, 1).split(text, seq=7, epoch=2)
    assert [(b.key, b.start, b.end) for b in blocks] == [(BlockKey(7, 0), 2, 14), (BlockKey(7, 1), 17, 44)]
    for b in blocks:
        assert b.text == text[b.start : b.end]
        assert b.content_hash == content_hash(b.text) and len(b.content_hash) == 64
        assert b.token_count == word_count(b.text) and b.epoch == 2
    assert [b.token_count for b in blocks] == [2, 4]


def test_short_fragments_merge_and_the_merged_block_keeps_the_stronger_type() -> None:
    text = "Hi. Thanks for the quick reply earlier today. Order #7894561230. Ok. I will now wait for the courier here."
    assert split(text, min_block_length=1) == [
        ("greeting", "Hi."),
        ("context", "Thanks for the quick reply earlier today."),
        ("identifier", "Order #7894561230."),
        ("context", "Ok."),
        ("context", "I will now wait for the courier here."),
    ]
    # 4 tokens minimum: "Hi." joins the next sentence; "Order #…" (2) and "Ok." (1) join the block before them,
    # which becomes an identifier block; the last sentence is long enough to stand alone
    assert split(text, min_block_length=4) == [
        ("identifier", "Hi. Thanks for the quick reply earlier today. Order #7894561230. Ok."),
        ("context", "I will now wait for the courier here."),
    ]
    # 12: the first block (11 tokens) is still short, so the last sentence joins it too
    assert split(text, min_block_length=12) == [("identifier", text)]


def test_merging_chinese_counts_each_character_as_a_token() -> None:
    assert word_count("还没发货。") == 5
    assert split("好的。订单号：2024051812345。还没发货。", min_block_length=4) == [
        ("identifier", "好的。订单号：2024051812345。"),
        ("context", "还没发货。"),
    ]


def test_section_headers_never_merge_even_when_short() -> None:
    assert split("## 4\nYou may return an item within thirty days.", min_block_length=8) == [
        ("section", "## 4"),
        ("context", "You may return an item within thirty days."),
    ]


def test_a_message_shorter_than_the_minimum_is_still_one_block() -> None:
    assert split("ok", min_block_length=8) == [("context", "ok")]
    assert split("   ", min_block_length=8) == []


def test_parents_step_and_clause_references_else_the_previous_block_of_the_epoch() -> None:
    splitter = Splitter(RULES, word_count, 1)
    policy = splitter.split("## 4 Returns\n1. Open your orders page.\n2. Click the return button.", seq=1, epoch=0)
    assert [(b.type, b.parent) for b in policy] == [
        (BlockType.SECTION, None),
        (BlockType.STEP, BlockKey(1, 0)),
        (BlockType.STEP, BlockKey(1, 1)),
    ]
    asked = splitter.split(
        "I did that. Can you explain step 2 of that? According to section 4, is it free?",
        seq=2,
        epoch=0,
        history=policy,
    )
    assert [(b.type, b.parent) for b in asked] == [
        (BlockType.CONTEXT, BlockKey(1, 2)),  # previous block of the epoch
        (BlockType.QUESTION, BlockKey(1, 2)),  # step 2 of that → the step numbered 2
        (BlockType.CLAUSE_REFERENCE, BlockKey(1, 0)),  # section 4 → its header
    ]
    zh = splitter.split("第二步是什么意思？按照第四条，运费谁出？", seq=3, epoch=0, history=policy)
    assert [b.parent for b in zh] == [BlockKey(1, 2), BlockKey(1, 0)]


def test_an_identifier_block_still_links_to_the_section_it_cites() -> None:
    splitter = Splitter(RULES, word_count, 1)
    policy = splitter.split("[Section 4]: refunds", seq=1, epoch=0)
    asked = splitter.split("Per clause 4, refund order #7894561230 now", seq=2, epoch=0, history=policy)
    assert [(b.type, b.parent) for b in asked] == [(BlockType.IDENTIFIER, BlockKey(1, 0))]


def test_a_new_epoch_starts_without_a_parent_and_unknown_references_fall_back() -> None:
    splitter = Splitter(RULES, word_count, 1)
    old = splitter.split("Where is order #7894561230?", seq=1, epoch=0)
    new = splitter.split("New topic: my card was charged twice. See section 9 please.", seq=3, epoch=1, history=old)
    assert [b.parent for b in new] == [None, BlockKey(3, 0)]  # no section 9 anywhere: the previous block
    steps = splitter.split("Step 5 is unclear.", seq=4, epoch=1, history=[*old, *new])
    assert [b.parent for b in steps] == [BlockKey(3, 1)]  # a step itself is not a reference to another step


@pytest.mark.parametrize(
    ("text", "value"), [("4", 4), ("四", 4), ("十", 10), ("十二", 12), ("二十三", 23), ("x", None)]
)
def test_zh_numbers(text: str, value: int | None) -> None:
    assert zh_number(text) == value


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Where is my parcel? The tracking no. 1Z999AA10123456784 shows nothing since Monday.",
            [
                ("question", "Where is my parcel?"),
                ("identifier", "The tracking no. 1Z999AA10123456784 shows nothing since Monday."),
            ],
        ),
        (
            "Order no. A1234567 never arrived, can you check?",
            [("identifier", "Order no. A1234567 never arrived, can you check?")],
        ),
        ("Order no. A1234567", [("identifier", "Order no. A1234567")]),
        (
            "It takes approx. 3 days. Dr. Rao said so.",
            [("context", "It takes approx. 3 days."), ("context", "Dr. Rao said so.")],
        ),
        # "no." ends a sentence when no code follows it
        ("I said no. Then he left.", [("context", "I said no."), ("context", "Then he left.")]),
    ],
)
def test_a_period_after_an_abbreviation_does_not_cut_the_sentence(text: str, expected: list[tuple[str, str]]) -> None:
    assert split(text) == expected
