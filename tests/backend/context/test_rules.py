"""Splitter rules: each default rule on English and Chinese text, priority order, and bad rules refused."""

from __future__ import annotations

import pytest

from backend.context.blocks import BlockType
from backend.context.errors import ContextError, InvalidRuleError
from backend.context.rules import DEFAULT_RULES, Rule, RuleSet, compile_rule

RULES = RuleSet.compile(DEFAULT_RULES)
PANGRAM = "The quick brown fox jumps over the lazy dog? 0123456789 #@-_.,:;!()[]{}"


@pytest.mark.parametrize(
    ("text", "rule", "block_type"),
    [
        # questions
        ("Where is my parcel?", "question_en", BlockType.QUESTION),
        ("Can you check it? thanks", "question_en", BlockType.QUESTION),
        ("我的包裹在哪里？", "question_zh", BlockType.QUESTION),
        ("这个可以退货吗", "question_zh", BlockType.QUESTION),
        ("那退款呢。", "question_zh", BlockType.QUESTION),
        # numbered steps
        ("1. Open the Orders page", "step_numbered", BlockType.STEP),
        ("2) Choose the item to return", "step_numbered", BlockType.STEP),
        ("3、填写退货原因", "step_numbered", BlockType.STEP),
        ("Step 3: print the label", "step_word", BlockType.STEP),
        ("step 12 ship it back", "step_word", BlockType.STEP),
        ("第一步，打开订单页面", "step_zh", BlockType.STEP),
        ("第3步：打印标签", "step_zh", BlockType.STEP),
        # section headers
        ("[Refund policy]: refunds take 5-7 days", "header_bracket", BlockType.SECTION),
        ("【退货政策】：七天无理由退货", "header_bracket", BlockType.SECTION),
        ("## 4 Returns", "header_markdown", BlockType.SECTION),
        ("### 退货", "header_markdown", BlockType.SECTION),
        # clause references
        ("According to section 4, I can return it", "clause_reference", BlockType.CLAUSE_REFERENCE),
        ("per clause 3.2 you owe me a refund", "clause_reference", BlockType.CLAUSE_REFERENCE),
        ("As per Article 7 this is covered", "clause_reference", BlockType.CLAUSE_REFERENCE),
        ("根据退货条款，我可以退款", "clause_reference_zh_terms", BlockType.CLAUSE_REFERENCE),
        ("按照第4条，应该全额退款", "clause_reference_zh", BlockType.CLAUSE_REFERENCE),
        ("根据第十二条处理", "clause_reference_zh", BlockType.CLAUSE_REFERENCE),
        # identifiers, as they appear in the CuCom conversations
        ("Order #617-8899001-1122334 marked delivered but never got it", "order_number", BlockType.IDENTIFIER),
        ("My order number 406-8765432-9876543 contained an incorrect item", "order_number", BlockType.IDENTIFIER),
        ("Regarding order #7894561230, I was charged", "order_number", BlockType.IDENTIFIER),
        ("Order ID: AMZ123456789 arrived late", "order_number", BlockType.IDENTIFIER),
        ("Order 1234567890 is marked as delivered", "order_number", BlockType.IDENTIFIER),
        ("My order OD459238745923 is showing delivered", "order_number", BlockType.IDENTIFIER),
        ("it was OD459238745923 I think", "prefixed_code", BlockType.IDENTIFIER),
        ("Reference ID: 7894561230", "account_or_ticket", BlockType.IDENTIFIER),
        ("my account no. AC-7781234 is locked", "account_or_ticket", BlockType.IDENTIFIER),
        ("Ticket #TK48213 is still open", "account_or_ticket", BlockType.IDENTIFIER),
        ("订单号：2024051812345 还没发货", "order_number_zh", BlockType.IDENTIFIER),
        ("我的账号是 user2024x 登不上", "order_number_zh", BlockType.IDENTIFIER),
        ("mail me at priya.s+shop@example.co.in", "email", BlockType.IDENTIFIER),
        ("It's [email protected] and that's my mail", "email", BlockType.IDENTIFIER),
        ("call me on 9876543210", "phone", BlockType.IDENTIFIER),
        ("my number is +91 98765 43210", "phone", BlockType.IDENTIFIER),
        ("手机 13812345678 可以联系我", "phone", BlockType.IDENTIFIER),
        # code / JSON
        ("```python\nprint(1)\n```", "code_fence", BlockType.CODE),
        ('{"order": "123", "items": [1, 2]}', "json_object", BlockType.CODE),
    ],
)
def test_each_default_rule_claims_its_text(text: str, rule: str, block_type: BlockType) -> None:
    match = RULES.classify(text)
    assert match is not None
    assert (match.rule.name, match.rule.block_type) == (rule, block_type)


@pytest.mark.parametrize(
    "text",
    [
        "The parcel arrived yesterday but the box was wet.",
        "包裹昨天到了，但是盒子湿了。",
        "It costs 1,299 rupees and came in 2 boxes.",  # small numbers are not identifiers
        "I bought the WH-1000XM4 headphones.",  # a product model, not an identifier
        "Version 3.2 of the app crashes.",  # a number after "version" is no clause reference
    ],
)
def test_plain_text_is_claimed_by_no_rule(text: str) -> None:
    assert RULES.classify(text) is None


def test_the_highest_priority_match_wins_and_ties_go_by_name() -> None:
    match = RULES.classify("According to section 4, where is order #617-8899001-1122334?")
    assert match is not None and match.rule.name == "order_number"  # identifier (90) beats clause (60), question (50)
    tied = RuleSet.compile([Rule("b", "x", BlockType.STEP, 5), Rule("a", "x", BlockType.CODE, 5)])
    assert [r.name for r in tied.rules] == ["a", "b"]
    assert tied.classify("x") is not None and tied.classify("x").rule.name == "a"  # type: ignore[union-attr]


def test_disabled_rules_are_not_compiled() -> None:
    rules = RuleSet.compile([Rule("q", r"\?", BlockType.QUESTION, 1, enabled=False)])
    assert rules.rules == [] and rules.classify("why?") is None


def test_refs_and_identifiers_are_found_in_text() -> None:
    assert RULES.find_ref("well, per clause 3.2 of it", BlockType.CLAUSE_REFERENCE) == "3.2"
    assert RULES.find_ref("按照第四条处理", BlockType.CLAUSE_REFERENCE) == "四"
    assert RULES.find_ref("no reference here", BlockType.CLAUSE_REFERENCE) is None
    found = RULES.find_all("order #617-8899001-1122334, phone 9876543210", BlockType.IDENTIFIER)
    assert found == ["order #617-8899001-1122334", "9876543210"]  # rules in priority order, then by name
    assert RULES.find_all("phone 9876543210", BlockType.IDENTIFIER, skip=frozenset({"phone"})) == []


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("(unclosed", "does not compile: missing ), unterminated subpattern at position 0"),
        ("[a-", "does not compile: unterminated character set at position 0"),
        (r"\d*", "can match the empty string (at 0 in '')"),
        ("a|", "can match the empty string (at 0 in '')"),
        (r"\b", f"can match the empty string (at 0 in {PANGRAM!r})"),
        ("(?=x)", f"can match the empty string (at 18 in {PANGRAM!r})"),
        ("^", "can match the empty string (at 0 in '')"),
    ],
)
def test_a_bad_rule_is_refused_with_its_reason(pattern: str, reason: str) -> None:
    bad = Rule("bad", pattern, BlockType.CONTEXT, 1)
    with pytest.raises(InvalidRuleError) as refused:
        RuleSet.compile([*DEFAULT_RULES, bad])
    assert (refused.value.code, refused.value.rule, refused.value.reason) == ("invalid_rule", "bad", reason)
    assert str(refused.value) == f"rule 'bad' refused: {reason}"
    assert isinstance(refused.value, ContextError)


def test_every_default_rule_compiles() -> None:
    for rule in DEFAULT_RULES:
        compile_rule(rule)
    assert len({r.name for r in DEFAULT_RULES}) == len(DEFAULT_RULES)
