"""What a turn knows of its session's context, as values: ``SessionContext`` (what one read gives), ``Observation``
(a customer message observed), ``Plan`` (a turn's worker-thread step), ``PreparedPrompt`` (the engine request) and
``LastPrompt`` (what the next prompt is compared with). ``backend/services/context_service.py`` makes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from backend.context.blocks import Block, BlockKey
from backend.context.builder import BuiltContext
from backend.context.rules import RuleSet
from backend.context.sections import SectionIndex
from backend.context.topic import TopicUpdate
from backend.db.models import Message
from backend.engine_client.values import SegmentedPrompt, TokenizedPrompt
from backend.services.context_history import in_order
from backend.services.context_store import ContextSettings


@dataclass(frozen=True, slots=True)
class SessionContext:
    """What one turn reads from the database (``turn_read.py``: one round trip on Postgres, whatever the history's
    length)."""

    tenant_id: str
    session_id: str
    namespace: str  # the engine cache namespace of the tenant (backend/core/namespaces.py)
    system_prompt: str
    policy_text: str
    epoch: int  # the session's current topic epoch
    temperature: float | None
    pinned_context: str
    messages: list[Message]
    epochs: dict[int, int]  # seq → topic epoch, for every message
    temperatures: dict[int, float]  # customer message seq → the temperature it left
    blocks: list[Block]  # oldest first
    block_ids: dict[BlockKey, int]
    settings: ContextSettings
    rules: RuleSet
    handbook: SectionIndex  # the tenant's handbook at its current version
    sections: dict[int, tuple[str, ...]]  # customer message seq → the titles of the topic's sections after it

    @property
    def last_seq(self) -> int:
        """The seq of the session's newest message when it was read."""
        return max((m.seq for m in self.messages), default=0)

    def with_message(self, message: Message) -> SessionContext:
        """This context with customer ``message``, stored after the read as the newest: in the epoch of the message
        before it (``epochs_of``) until it is observed."""
        ordered = in_order(self.messages)
        epoch = self.epochs[ordered[-1].seq] if ordered else 0
        return dataclasses.replace(self, messages=[*self.messages, message], epochs={**self.epochs, message.seq: epoch})

    def sections_at(self, seq: int) -> tuple[str, ...]:
        """The handbook sections of the topic of customer message ``seq`` (the latest choice at or before it)."""
        earlier = [s for s in self.sections if s <= seq]
        return self.sections[max(earlier)] if earlier else ()

    def observed(
        self,
        seq: int,
        update: TopicUpdate,
        blocks: Sequence[Block],
        ids: Sequence[int] | None,
        sections: tuple[str, ...] = (),
    ) -> SessionContext:
        """This context after customer message ``seq`` was observed (``update``, its ``blocks`` stored as ``ids``):
        what reading it again would give, without reading it again. ``ids`` None: the blocks are not stored yet
        (``plan``: the prompt goes to the engine first; their segments carry no row id)."""
        return dataclasses.replace(
            self,
            epoch=update.epoch,
            temperature=update.temperature,
            # NOTE: seq is the newest message in conversation order: no later one inherits its epoch.
            epochs={**self.epochs, seq: update.epoch},
            temperatures={**self.temperatures, seq: update.temperature},
            blocks=[*self.blocks, *blocks],
            block_ids={**self.block_ids, **{b.key: i for b, i in zip(blocks, ids or (), strict=ids is not None)}},
            sections={**self.sections, seq: sections},
        )


@dataclass(frozen=True, slots=True)
class Observation:
    """A customer message observed: the topic update, the message's blocks, and the topic's handbook sections."""

    update: TopicUpdate
    blocks: tuple[Block, ...]
    sections: tuple[str, ...] = ()  # the titles of the topic's handbook sections after the message


@dataclass(frozen=True, slots=True)
class Plan:
    """A turn's worker-thread step: the message observed (None: not observed again, a retry; or the layer failed),
    the context as it stands after (the message's blocks without row ids), and the prompt."""

    observation: Observation | None
    context: SessionContext
    prepared: PreparedPrompt


@dataclass(frozen=True, slots=True)
class PreparedPrompt:
    built: BuiltContext
    tokenized: TokenizedPrompt  # what the engine runs (never tokenized again)
    sent: SegmentedPrompt  # the built prompt with the tenant's tools offered: what ``tokenized`` holds
    context_from: int  # the first token after the tenant's system prompt and policy: the session's own context
    namespace: str
    epoch: int  # the topic of the message the turn answers
    temperature: float | None
    sections: tuple[str, ...] = ()  # the handbook sections the prompt holds (their titles)

    @property
    def prompt(self) -> SegmentedPrompt:
        return self.built.prompt

    @property
    def token_ids(self) -> list[int]:
        return self.tokenized.token_ids


@dataclass(frozen=True, slots=True)
class LastPrompt:
    """A session's latest prompt: what the next one is compared with."""

    token_ids: list[int]
    kept: frozenset[int]
    context_from: int
