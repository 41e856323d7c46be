"""Splitter rules: each default rule on English and Chinese text, priority order, bad rules refused with the reason,
and each claim of the module's docstring (RE2: linear time, no lookarounds; the ``value`` group; the size cap)."""

from __future__ import annotations

import pytest

from backend.context.blocks import BlockType
from backend.context.errors import ContextError, InvalidRuleError
from backend.context.rules import DEFAULT_RULES, MAX_PROGRAM_SIZE, Rule, RuleSet, compile_rule

RULES = RuleSet.compile(DEFAULT_RULES)


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
        ("手机：１３８１２３４５６７８", "phone", BlockType.IDENTIFIER),  # full-width digits are digits
        ("9876543210", "phone", BlockType.IDENTIFIER),  # the text's edges stand for the lookarounds' "nothing"
        ("ticket no. 4821-77", "account_or_ticket", BlockType.IDENTIFIER),  # digit first
        ("case ABCD9 again", "account_or_ticket", BlockType.IDENTIFIER),  # the digit last, five characters
        ("refund A1BCD", "account_or_ticket", BlockType.IDENTIFIER),  # the digit second
        ("邮箱 张三@例子.中国", "email", BlockType.IDENTIFIER),  # Unicode letters, as Python's \w had them
        ("1.Open the Orders page", "step_numbered", BlockType.STEP),  # no space after the dot
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
        "手机13812345678",  # digits glued to a Chinese word are part of it (Python's Unicode \w)
        "call 9876543210abc",  # letters glued to the digits: not a phone number
        "1.5 kg of rice",  # a digit right after the dot: a decimal, not a step
        "case ABCDEF is open",  # no digit: not an identifier
        "ticket A12B",  # four characters: too short
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


LOOKAROUNDS = "(RE2 has no lookarounds or backreferences)"
TOO_LARGE = f"compiles to 11204 RE2 instructions; the limit is {MAX_PROGRAM_SIZE} (simplify the pattern)"


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("(unclosed", "not RE2 syntax: missing ): (unclosed"),
        ("[a-", "not RE2 syntax: missing ]: [a-"),
        ("(?=x)", f"not RE2 syntax: invalid perl operator: (?= {LOOKAROUNDS}"),
        ("x(?!y)", f"not RE2 syntax: invalid perl operator: (?! {LOOKAROUNDS}"),
        ("(?<=x)y", f"not RE2 syntax: invalid perl operator: (?<= {LOOKAROUNDS}"),
        ("(?<!x)y", f"not RE2 syntax: invalid perl operator: (?<! {LOOKAROUNDS}"),
        (r"(a)\1", rf"not RE2 syntax: invalid escape sequence: \1 {LOOKAROUNDS}"),
        ("a{1001}", "not RE2 syntax: invalid repetition size: {1001}"),
        (".{1000}.{400}", TOO_LARGE),
        (r"\d*", "can match the empty string (at 0 in '')"),
        ("a|", "can match the empty string (at 0 in '')"),
        ("^", "can match the empty string (at 0 in '')"),
        (r"\B", "can match the empty string (at 0 in '')"),
        (r"\b", "can match the empty string (at 0 in 'a')"),
        (r"\b$", "can match the empty string (at 1 in 'a')"),  # only after a word character, at the end
        (r"(?m)^$", "can match the empty string (at 0 in '')"),
        (r"x*\b\n", None),  # never empty: the newline is always there
    ],
)
def test_a_bad_rule_is_refused_with_its_reason(pattern: str, reason: str | None) -> None:
    bad = Rule("bad", pattern, BlockType.CONTEXT, 1)
    if reason is None:
        RuleSet.compile([*DEFAULT_RULES, bad])
        return
    with pytest.raises(InvalidRuleError) as refused:
        RuleSet.compile([*DEFAULT_RULES, bad])
    assert (refused.value.code, refused.value.rule, refused.value.reason) == ("invalid_rule", "bad", reason)
    assert str(refused.value) == f"rule 'bad' refused: {reason}"
    assert isinstance(refused.value, ContextError)


def test_every_default_rule_compiles() -> None:
    for rule in DEFAULT_RULES:
        compile_rule(rule)
    assert len({r.name for r in DEFAULT_RULES}) == len(DEFAULT_RULES)


HOSTILE = "a" * 10_000 + "!"


@pytest.mark.parametrize(
    ("pattern", "found"),
    [
        (r"(a+)+$", []),
        (r"(\w+\s?)+$", []),
        (r"^(([a-z])+.)+[A-Z]([a-z])+$", []),
        (r"(.*a){20}", [HOSTILE * 3 + "a" * 10_000]),  # to the last "a"
    ],
)
def test_patterns_that_backtrack_exponentially_match_in_linear_time(pattern: str, found: list[str]) -> None:
    """The issue's ReDoS rules: with a backtracking engine each of these texts would take longer than the test
    suite's timeout (27 a's took 11.7 s, each further one doubles it); RE2 answers at once."""
    rules = RuleSet.compile([Rule("redos", pattern, BlockType.CODE, 1)])
    text = HOSTILE * 4
    assert (rules.classify(text) is not None) == bool(found)
    assert rules.find_all(text, BlockType.CODE) == found


def test_the_value_group_is_what_a_rule_finds_and_the_next_search_resumes_at_its_end() -> None:
    """The phone rule consumes the character after the number to check it is no word character; that character
    is still there for the next number, as a lookahead would have left it."""
    assert RULES.find_all("9876543210/9876543211 or +91 98765 43212.", BlockType.IDENTIFIER) == [
        "9876543210",
        "9876543211",
        "+91 98765 43212",
    ]
    rules = RuleSet.compile([Rule("a", "x(?P<value>y)z", BlockType.CODE, 1), Rule("b", "yz", BlockType.CODE, 0)])
    assert rules.find_all("xyz xyz", BlockType.CODE) == ["y", "y", "yz", "yz"]


def test_the_largest_default_rule_is_well_under_the_size_cap() -> None:
    sizes = {r.name: compile_rule(r).program_size for r in DEFAULT_RULES}
    assert max(sizes.values()) < MAX_PROGRAM_SIZE // 2
    assert sizes["question_en"] < sizes["phone"]  # sizes are RE2 instructions, not characters


def test_re2_classes_are_ascii_and_unicode_classes_say_so() -> None:
    """What the docstring warns a rule's author of: \\w, \\d and \\b are ASCII in RE2; \\p{L} and \\p{Nd} are not."""
    rules = RuleSet.compile(
        [
            Rule("ascii_word", r"\w{2}", BlockType.CODE, 3),
            Rule("letters", r"\p{L}{2}", BlockType.STEP, 2),
            Rule("digits", r"\p{Nd}{2}", BlockType.IDENTIFIER, 1),
        ]
    )
    assert rules.find_all("中文", BlockType.CODE) == []
    assert rules.find_all("中文", BlockType.STEP) == ["中文"]
    assert rules.find_all("１２", BlockType.IDENTIFIER) == ["１２"]
    assert rules.classify("１２") is not None and rules.classify("１２").rule.name == "digits"  # type: ignore[union-attr]
