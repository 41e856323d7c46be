"""The context builder: turns a session into the engine request, a ``SegmentedPrompt``, under a token budget.

The prompt is assembled in a fixed order:

1. the tenant's system prompt and policy text (``prefix_segments``), alone at the start and byte for byte the same in
   every session and every turn, so their KV blocks are shared by all of the tenant's sessions (and can be pinned);
   then the topic's handbook section(s) (``section_segments``), shared by every session on that topic;
2. the session's pinned context (customer facts), then the blocks of left-out messages that the kept history still
   depends on (``CarryMode``; by default ``referenced``: the steps and sections a kept block refers to through its
   ``parent`` link, and the identifier blocks whose order or account numbers the kept messages name again);
3. the history, by the tenant's policy:
   - ``full``: every turn (the oldest go only when the budget forces it);
   - ``epoch``: the current topic epoch in full; earlier epochs survive only through their blocks in part 2;
   - ``budget``: the oldest turns go first once the prompt passes ``policy_budget_tokens``.

Whatever the policy, the prompt fits ``budget_tokens``: the oldest turns go first (the history always starts on a
customer message and always ends with the newest one), then the oldest carried blocks.

NOTE: parts 1 and 2 live in one system message, not two: several chat templates (Llama 3, Mistral) only honour a
first system message. A message's segments cover its text exactly (the gap before a block belongs to it), so the
engine renders the same token ids as for the plain messages, and a turn whose context lost nothing extends the
previous turn's prompt token for token: the prefix cache serves all of it but the new tail.

Pure: no database, no engine; tokens are counted by the callable the caller passes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from backend.context.blocks import Block, BlockKey, BlockType
from backend.domain import HistoryPolicy, MessageRole
from backend.engine_client.values import Segment, SegmentedMessage, SegmentedPrompt

CountTokens = Callable[[SegmentedPrompt], int]

# Block types of the engine request beyond the splitter's (``BlockType``): the stats by block type show them apart.
SYSTEM_PROMPT = "system_prompt"
POLICY_TEXT = "policy_text"
PINNED_CONTEXT = "pinned_context"
HANDBOOK_SECTION = "handbook_section"
PREFIX_TYPES = frozenset({SYSTEM_PROMPT, POLICY_TEXT})  # part 1: the tenant-wide prefix
SHARED_TYPES = PREFIX_TYPES | {HANDBOOK_SECTION}  # what sessions of a tenant on the same topic share

CARRIED_TYPES = frozenset({BlockType.IDENTIFIER, BlockType.CLAUSE_REFERENCE})
REFERENCE_TARGETS = frozenset({BlockType.STEP, BlockType.SECTION})
Identify = Callable[[str], frozenset[str]]
CARRIED_HEADER = "Noted earlier in this conversation:"
_SEPARATOR = "\n\n"
_ITEM = "\n- "


class CarryMode(StrEnum):
    """Which blocks of left-out messages part 2 carries.

    - ``referenced``: those the kept history depends on: a kept block's ``parent`` when it is a step or section, or
      in another epoch (the splitter links across epochs only for "step 2 of that" and "per section 4"), and each
      identifier block naming an order, account or ticket number that a kept message names again;
    - ``typed``: every identifier and clause-reference block, referenced or not;
    - ``none``: nothing.
    """

    REFERENCED = "referenced"
    TYPED = "typed"
    NONE = "none"


class DropReason(StrEnum):
    """Why a message is not in the history: its epoch is over (``epoch`` policy), or the budget had no room."""

    EPOCH = "epoch"
    BUDGET = "budget"


@dataclass(frozen=True, slots=True)
class HistoryMessage:
    """A stored message that is context (customer messages and complete replies), in conversation order.

    ``tool_messages``: a reply's tool calls and their results, written before it (the prompt it was generated from).
    """

    seq: int
    role: MessageRole
    content: str
    epoch: int
    blocks: tuple[Block, ...] = ()
    tool_messages: tuple[SegmentedMessage, ...] = ()


@dataclass(frozen=True, slots=True)
class ContextRequest:
    """Everything the builder needs about one turn. ``block_ids`` maps a block to its stored row id (segment ids)."""

    system_prompt: str
    history: tuple[HistoryMessage, ...]
    current_epoch: int
    policy: HistoryPolicy
    budget_tokens: int
    pinned_context: str = ""
    policy_text: str = ""
    sections: tuple[str, ...] = ()  # the topic's handbook sections, rendered (``Section.rendered``)
    policy_budget_tokens: int | None = None  # the ``budget`` policy's own limit (None: only ``budget_tokens``)
    block_ids: Mapping[BlockKey, int] = field(default_factory=dict)
    carry: CarryMode = CarryMode.REFERENCED
    identify: Identify | None = None  # a text's identifier keys (``topic.identifier_keys``); None: none match


@dataclass(frozen=True, slots=True)
class Dropped:
    seq: int
    reason: DropReason


@dataclass(frozen=True, slots=True)
class BuiltContext:
    """The engine request, and what it holds and leaves out (the caller invalidates what the last turn had)."""

    prompt: SegmentedPrompt
    tokens: int
    kept: tuple[int, ...]  # seqs of the history messages, in order
    dropped: tuple[Dropped, ...]  # messages left out of the history, oldest first
    carried: tuple[BlockKey, ...]  # blocks of left-out messages that part 2 carries
    fits: bool  # False: even the smallest context is over the budget (the engine will refuse it)


@dataclass(frozen=True, slots=True)
class _Choice:
    kept: tuple[HistoryMessage, ...]
    dropped: tuple[Dropped, ...]
    carried: tuple[Block, ...]


def build_context(request: ContextRequest, count_tokens: CountTokens) -> BuiltContext:
    """The largest context the policy allows that fits the budget (the smallest one when none fits)."""
    limit = request.budget_tokens
    if request.policy is HistoryPolicy.BUDGET and request.policy_budget_tokens is not None:
        limit = min(limit, request.policy_budget_tokens)
    if not request.history:
        raise ValueError("the history is empty: a turn needs the customer's message")
    for choice in _choices(request):
        prompt = _render(request, choice)
        tokens = count_tokens(prompt)
        if tokens <= limit:
            break
    return BuiltContext(
        prompt,
        tokens,
        tuple(m.seq for m in choice.kept),
        choice.dropped,
        tuple(b.key for b in choice.carried),
        tokens <= limit,
    )


def _choices(request: ContextRequest) -> Iterator[_Choice]:
    """Candidate contexts, largest first: the policy's history, then ever later starts, then fewer carried blocks."""
    history = request.history
    if request.policy is HistoryPolicy.EPOCH:
        over = tuple(Dropped(m.seq, DropReason.EPOCH) for m in history if m.epoch < request.current_epoch)
        history = tuple(m for m in history if m.epoch >= request.current_epoch)
    else:
        over = ()
    # NOTE: never start the history on a reply: chat templates expect a customer turn first.
    starts = [i for i, m in enumerate(history) if m.role == MessageRole.USER] or [len(history) - 1]
    left_out_seqs = {d.seq for d in over}
    earlier = [m for m in request.history if m.seq in left_out_seqs]
    for n, start in enumerate(starts):
        dropped = over + tuple(Dropped(m.seq, DropReason.BUDGET) for m in history[:start])
        carried = _carried(request, (*earlier, *history[:start]), history[start:])
        yield _Choice(history[start:], dropped, carried)
        if n == len(starts) - 1:
            for first in range(1, len(carried) + 1):  # the last resort: the oldest carried blocks go too
                yield _Choice(history[start:], dropped, carried[first:])


def _carried(
    request: ContextRequest, left_out: Sequence[HistoryMessage], kept: Sequence[HistoryMessage]
) -> tuple[Block, ...]:
    """The blocks of ``left_out`` that part 2 carries under ``request.carry``, in conversation order."""
    blocks = [b for m in left_out for b in m.blocks]
    if request.carry is CarryMode.NONE:
        return ()
    if request.carry is CarryMode.TYPED:
        return tuple(b for b in blocks if b.type in CARRIED_TYPES)
    by_key = {b.key: b for b in blocks}
    wanted = {
        b.parent
        for m in kept
        for b in m.blocks
        if b.parent in by_key and (by_key[b.parent].type in REFERENCE_TARGETS or by_key[b.parent].epoch != b.epoch)
    }
    identify = request.identify
    if identify is not None:
        named = frozenset().union(*(identify(m.content) for m in kept))
        wanted |= {b.key for b in blocks if b.type is BlockType.IDENTIFIER and identify(b.text) & named}
    return tuple(b for b in blocks if b.key in wanted)


def _render(request: ContextRequest, choice: _Choice) -> SegmentedPrompt:
    system = _system_segments(request, choice.carried)
    messages: list[tuple[str, list[Segment]]] = [(MessageRole.SYSTEM.value, system)] if system else []
    for m in choice.kept:
        messages += [(t.role, list(t.segments)) for t in m.tool_messages]
        messages.append((m.role.value, message_segments(m, request.block_ids)))
    return SegmentedPrompt.of(*messages)


def prefix_segments(system_prompt: str, policy_text: str) -> list[Segment]:
    """Part 1: the system prompt, then the policy text; the same bytes for every session and turn of the tenant."""
    segments: list[Segment] = []
    if system_prompt:
        segments.append(Segment(system_prompt, SYSTEM_PROMPT))
    if policy_text:
        segments.append(Segment((_SEPARATOR if segments else "") + policy_text, POLICY_TEXT))
    return segments


def prefix_prompt(system_prompt: str, policy_text: str) -> SegmentedPrompt | None:
    """Part 1 alone, as a system message without a generation prompt (what a tenant pins); None when empty.

    NOTE: the tokens of its ``PREFIX_TYPES`` spans are the prefix of every prompt of the tenant; the template's
    closing tokens after them are not (part 2 may follow in the same system message).
    """
    segments = prefix_segments(system_prompt, policy_text)
    if not segments:
        return None
    return SegmentedPrompt.of((MessageRole.SYSTEM.value, segments), add_generation_prompt=False)


def section_segments(lead: bool, sections: Sequence[str]) -> list[Segment]:
    """The topic's handbook sections, after part 1 (``lead``: something comes before them)."""
    out: list[Segment] = []
    for text in sections:
        out.append(Segment((_SEPARATOR if lead or out else "") + text, HANDBOOK_SECTION))
    return out


def _system_segments(request: ContextRequest, carried: Sequence[Block]) -> list[Segment]:
    segments = prefix_segments(request.system_prompt, request.policy_text)
    segments += section_segments(bool(segments), request.sections)
    if request.pinned_context:
        lead = _SEPARATOR if segments else ""
        segments.append(Segment(lead + request.pinned_context, PINNED_CONTEXT))
    if carried:
        lead = _SEPARATOR if segments else ""
        segments.append(Segment(lead + CARRIED_HEADER, PINNED_CONTEXT))
        ids = request.block_ids
        for block in carried:
            parent = ids.get(block.parent) if block.parent is not None else None
            segments.append(Segment(_ITEM + block.text, block.type.value, ids.get(block.key), parent))
    return segments


def message_segments(message: HistoryMessage, block_ids: Mapping[BlockKey, int]) -> list[Segment]:
    """The message's text cut at its blocks (each block takes the gap before it; the last one, the text after).

    A message without blocks, or whose blocks no longer match its text, is one ``context`` segment.
    """
    text, blocks = message.content, message.blocks
    if not blocks or not _blocks_match(text, blocks):
        return [Segment(text, BlockType.CONTEXT.value)]
    segments: list[Segment] = []
    pos = 0
    for i, block in enumerate(blocks):
        end = len(text) if i == len(blocks) - 1 else block.end
        parent = block_ids.get(block.parent) if block.parent is not None else None
        segments.append(Segment(text[pos:end], block.type.value, block_ids.get(block.key), parent))
        pos = end
    return segments


def _blocks_match(text: str, blocks: Sequence[Block]) -> bool:
    pos = 0
    for block in blocks:
        if block.start < pos or block.end < block.start or text[block.start : block.end] != block.text:
            return False
        pos = block.end
    return True
