"""The context builder: order of the parts, each history policy, the budget, carried blocks, and the extension
property (turn N+1's prompt extends turn N's token for token) on the tiny engine's real tokenizer."""

from __future__ import annotations

import pytest

from backend.context.blocks import Block, BlockKey, BlockType
from backend.context.builder import (
    CARRIED_HEADER,
    PINNED_CONTEXT,
    POLICY_TEXT,
    SYSTEM_PROMPT,
    CarryMode,
    ContextRequest,
    Dropped,
    DropReason,
    HistoryMessage,
    build_context,
    message_segments,
    prefix_prompt,
    prefix_segments,
)
from backend.context.rules import DEFAULT_RULES, RuleSet
from backend.context.splitter import Splitter, word_count
from backend.context.topic import identifier_keys
from backend.domain import HistoryPolicy, MessageRole
from engine.llm_engine import LLMEngine
from engine.prompt import SegmentedPrompt

SPLITTER = Splitter(RuleSet.compile(DEFAULT_RULES), word_count, min_block_length=1)
SYSTEM = "You help Acme's customers."
USER, BOT = MessageRole.USER, MessageRole.ASSISTANT


def words(prompt: SegmentedPrompt) -> int:
    """A model-free count: words of every segment plus 2 template tokens per message."""
    return sum(word_count(s.text) for s in prompt.segments) + 2 * len(prompt.messages)


def msg(seq: int, role: MessageRole, text: str, epoch: int = 0) -> HistoryMessage:
    return HistoryMessage(seq, role, text, epoch, tuple(SPLITTER.split(text, seq=seq, epoch=epoch)))


# Two topics: a late parcel (epoch 0), then a broken kettle (epoch 1).
CONVERSATION = (
    msg(1, USER, "My parcel is late. Order #4061234567 was due Monday."),
    msg(2, BOT, "Sorry about that. It ships tomorrow."),
    msg(3, USER, "Per section 4 I want a refund of the shipping fee."),
    msg(4, BOT, "Done, the fee is refunded."),
    msg(5, USER, "Another thing: my kettle broke. Can I return it?", epoch=1),
    msg(6, BOT, "Yes, within 30 days.", epoch=1),
    msg(7, USER, "How do I send it back?", epoch=1),
)


def request(policy: HistoryPolicy, budget: int = 10_000, **extra: object) -> ContextRequest:
    values: dict[str, object] = {
        "system_prompt": SYSTEM,
        "history": CONVERSATION,
        "current_epoch": 1,
        "policy": policy,
        "budget_tokens": budget,
        "carry": CarryMode.TYPED,  # the tests below carry by type; test_referenced_* test the default
    }
    return ContextRequest(**(values | extra))  # type: ignore[arg-type]


def contents(prompt: SegmentedPrompt) -> list[tuple[str, str]]:
    return [(m["role"], m["content"]) for m in prompt.as_messages()]


CARRIED_SYSTEM = (
    f"{SYSTEM}\n\n{CARRIED_HEADER}\n- Order #4061234567 was due Monday."
    "\n- Per section 4 I want a refund of the shipping fee."
)


@pytest.mark.parametrize(
    ("policy", "budget", "policy_budget", "kept", "dropped", "system"),
    [
        (HistoryPolicy.FULL, 10_000, None, (1, 2, 3, 4, 5, 6, 7), (), SYSTEM),
        (
            HistoryPolicy.EPOCH,
            10_000,
            None,
            (5, 6, 7),
            ((1, DropReason.EPOCH), (2, DropReason.EPOCH), (3, DropReason.EPOCH), (4, DropReason.EPOCH)),
            CARRIED_SYSTEM,
        ),
        # budget policy: 60 tokens keep the last two turns; the dropped turns' identifier and clause blocks stay
        (
            HistoryPolicy.BUDGET,
            10_000,
            60,
            (5, 6, 7),
            ((1, DropReason.BUDGET), (2, DropReason.BUDGET), (3, DropReason.BUDGET), (4, DropReason.BUDGET)),
            CARRIED_SYSTEM,
        ),
        (HistoryPolicy.BUDGET, 10_000, 10_000, (1, 2, 3, 4, 5, 6, 7), (), SYSTEM),
        # full under a tight model budget: the oldest turns go, never leaving a reply first
        (
            HistoryPolicy.FULL,
            62,
            None,
            (3, 4, 5, 6, 7),
            ((1, DropReason.BUDGET), (2, DropReason.BUDGET)),
            f"{SYSTEM}\n\n{CARRIED_HEADER}\n- Order #4061234567 was due Monday.",
        ),
    ],
)
def test_each_policy_keeps_exactly_its_history(
    policy: HistoryPolicy,
    budget: int,
    policy_budget: int | None,
    kept: tuple[int, ...],
    dropped: tuple[tuple[int, DropReason], ...],
    system: str,
) -> None:
    built = build_context(request(policy, budget, policy_budget_tokens=policy_budget), words)
    assert built.kept == kept
    assert built.dropped == tuple(Dropped(seq, why) for seq, why in dropped)
    by_seq = {m.seq: m for m in CONVERSATION}
    expected = [("system", system)] + [(by_seq[s].role.value, by_seq[s].content) for s in kept]
    assert contents(built.prompt) == expected
    assert built.tokens == words(built.prompt)
    assert built.fits


def test_the_sizes_the_table_relies_on() -> None:
    # a changed splitter or counter shows up here first
    assert build_context(request(HistoryPolicy.FULL), words).tokens == 70
    assert build_context(request(HistoryPolicy.EPOCH), words).tokens == 54
    assert build_context(request(HistoryPolicy.FULL, 61), words).kept == (5, 6, 7)


def test_the_budget_is_always_respected_and_the_history_starts_on_a_customer_message() -> None:
    full = build_context(request(HistoryPolicy.FULL), words).tokens
    smallest = None
    for budget in range(full, 0, -1):
        built = build_context(request(HistoryPolicy.FULL, budget), words)
        first = built.prompt.messages[1]
        assert first.role == "user"
        assert built.kept[-1] == 7  # the newest message is always there
        if built.fits:
            assert built.tokens <= budget
            smallest = budget
    # below the smallest context (system prompt + the newest message) nothing fits: the smallest one is returned
    tight = build_context(request(HistoryPolicy.FULL, 5), words)
    assert (tight.fits, tight.kept, tight.carried) == (False, (7,), ())
    assert tight.tokens == words(tight.prompt) == smallest == 14


def test_carried_blocks_go_oldest_first_once_no_turn_is_left_to_drop() -> None:
    # epoch policy, current epoch's turns kept down to the newest; the parcel's identifier block goes, the clause stays
    built = build_context(request(HistoryPolicy.EPOCH, 31), words)
    assert built.kept == (7,)
    assert built.carried == (BlockKey(3, 0),)
    assert contents(built.prompt)[0] == (
        "system",
        f"{SYSTEM}\n\n{CARRIED_HEADER}\n- Per section 4 I want a refund of the shipping fee.",
    )
    assert built.tokens == 31


def test_epoch_policy_keeps_identifiers_of_earlier_epochs_with_their_ids() -> None:
    ids = {b.key: 100 + b.key.seq * 10 + b.key.index for m in CONVERSATION for b in m.blocks}
    built = build_context(request(HistoryPolicy.EPOCH, block_ids=ids, pinned_context="VIP customer."), words)
    system = built.prompt.messages[0].segments
    assert [(s.block_type, s.text, s.block_id, s.parent_id) for s in system] == [
        (SYSTEM_PROMPT, SYSTEM, None, None),
        (PINNED_CONTEXT, "\n\nVIP customer.", None, None),
        (PINNED_CONTEXT, f"\n\n{CARRIED_HEADER}", None, None),
        (BlockType.IDENTIFIER.value, "\n- Order #4061234567 was due Monday.", 111, 110),
        (BlockType.CLAUSE_REFERENCE.value, "\n- Per section 4 I want a refund of the shipping fee.", 130, None),
    ]
    assert built.carried == (BlockKey(1, 1), BlockKey(3, 0))
    newest = built.prompt.messages[-1].segments
    assert [(s.block_type, s.block_id) for s in newest] == [("question", 170)]
    kettle = built.prompt.messages[1].segments  # a block's parent: the block before it in the same epoch
    assert [(s.block_type, s.block_id, s.parent_id) for s in kettle] == [("context", 150, None), ("question", 151, 150)]


def test_segments_cover_the_message_text_exactly_gaps_included() -> None:
    text = "  My order is late.\n\nWhere is order #4061234567?  "
    m = HistoryMessage(1, USER, text, 0, tuple(SPLITTER.split(text, seq=1, epoch=0)))
    segments = message_segments(m, {})
    assert "".join(s.text for s in segments) == text
    assert [(s.block_type, s.text) for s in segments] == [
        ("context", "  My order is late."),
        ("identifier", "\n\nWhere is order #4061234567?  "),
    ]
    stale = HistoryMessage(1, USER, "edited text", 0, m.blocks)  # blocks that no longer match: one segment
    assert [(s.block_type, s.text) for s in message_segments(stale, {})] == [("context", "edited text")]


@pytest.mark.parametrize("policy", list(HistoryPolicy))
def test_turn_n_plus_1_extends_turn_n_token_for_token(policy: HistoryPolicy, tiny_engine: LLMEngine) -> None:
    def count(prompt: SegmentedPrompt) -> int:
        return len(tiny_engine.tokenize(prompt))

    previous: list[int] = []
    previous_dropped: tuple[Dropped, ...] = ()
    shifts = 0
    for n in range(1, len(CONVERSATION) + 1, 2):  # after each customer message, as a chat turn would
        history = CONVERSATION[:n]
        current = max(m.epoch for m in history)
        req = ContextRequest(SYSTEM, history, current, policy, 10_000, policy_budget_tokens=10_000)
        built = build_context(req, count)
        ids = tiny_engine.tokenize(built.prompt)
        assert ids == tiny_engine.tokenize(built.prompt.as_messages())  # segments change no token
        if built.dropped == previous_dropped:
            assert ids[: len(previous)] == previous
            assert len(ids) > len(previous)
        else:  # the topic shift at seq 5 drops epoch 0: the prompt changes inside the system message
            shifts += 1
            assert ids[: len(previous)] != previous
        previous, previous_dropped = ids, built.dropped
    assert shifts == (1 if policy is HistoryPolicy.EPOCH else 0)


def test_part_one_is_the_system_prompt_then_the_policy_identical_every_turn() -> None:
    prompts = [
        build_context(
            request(
                HistoryPolicy.FULL, history=CONVERSATION[:n], pinned_context="VIP", policy_text="Refunds: 30 days."
            ),
            words,
        ).prompt
        for n in (1, 3, 7)
    ]
    for prompt in prompts:
        system = prompt.messages[0]
        assert [(s.text, s.block_type) for s in system.segments[:2]] == [
            (SYSTEM, SYSTEM_PROMPT),
            ("\n\nRefunds: 30 days.", POLICY_TEXT),
        ]
        assert system.content.startswith(f"{SYSTEM}\n\nRefunds: 30 days.\n\nVIP")
    assert prompts[0].messages[0] == prompts[1].messages[0]  # part 1 (and 2) byte for byte, turn after turn
    assert [(s.text, s.block_type) for s in prefix_segments("", "Policy only.")] == [("Policy only.", POLICY_TEXT)]
    assert prefix_prompt("", "") is None
    alone = prefix_prompt(SYSTEM, "Refunds: 30 days.")
    assert alone is not None and not alone.add_generation_prompt
    assert [(m.role, m.segments) for m in alone.messages] == [("system", prompts[0].messages[0].segments[:2])]


IDENT = identifier_keys(RuleSet.compile(DEFAULT_RULES))


def _carried_texts(history: tuple[HistoryMessage, ...], carry: CarryMode = CarryMode.REFERENCED) -> list[str]:
    built = build_context(request(HistoryPolicy.EPOCH, history=history, carry=carry, identify=IDENT), words)
    by_key = {b.key: b for m in history for b in m.blocks}
    return [by_key[k].text for k in built.carried]


def test_referenced_carry_drops_what_the_new_topic_never_refers_to() -> None:
    assert ContextRequest("", CONVERSATION, 1, HistoryPolicy.EPOCH, 1).carry is CarryMode.REFERENCED  # the default
    assert _carried_texts(CONVERSATION) == []  # the kettle never refers to the parcel, its order or section 4
    assert _carried_texts(CONVERSATION, CarryMode.NONE) == []
    assert _carried_texts(CONVERSATION, CarryMode.TYPED) == [
        "Order #4061234567 was due Monday.",
        "Per section 4 I want a refund of the shipping fee.",
    ]


def test_referenced_carry_keeps_a_number_named_again_and_a_step_asked_about_again() -> None:
    history: list[HistoryMessage] = []
    blocks: list[Block] = []

    def add(seq: int, role: MessageRole, text: str, epoch: int) -> None:
        split = SPLITTER.split(text, seq=seq, epoch=epoch, history=blocks)
        blocks.extend(split)
        history.append(HistoryMessage(seq, role, text, epoch, tuple(split)))

    add(1, USER, "My parcel is late. Order #4061234567 was due Monday.", 0)
    add(2, BOT, "To claim the fee back:\n1. Open your orders.\n2. Pick the parcel and click claim.", 0)
    add(3, USER, "Also, my kettle from order #5550001111 broke.", 1)
    add(4, BOT, "Sorry! Send us a photo of it.", 1)
    add(5, USER, "Here it is. And step 2 of that claim, is it still open for #4061234567?", 1)
    assert _carried_texts(tuple(history)) == [
        "Order #4061234567 was due Monday.",  # named again in epoch 1
        "2. Pick the parcel and click claim.",  # "step 2 of that": the block's parent, in epoch 0
    ]
