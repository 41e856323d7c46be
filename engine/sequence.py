"""One request's state inside the engine: its tokens, status and counters."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from engine.errors import EmptyPromptError
from engine.fair_share import DEFAULT_SHARE, FairShare
from engine.kv.block_hash import BlockHash
from engine.kv.block_meta import SpanMap
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "finished_stopped"  # EOS, a stop token or a stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens (or the model context) reached
    FINISHED_ABORTED = "finished_aborted"  # aborted by the caller, or rejected by the scheduler

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH, SequenceStatus.FINISHED_ABORTED}
)


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    root: BlockHash  # chain root of the request's namespace (see engine.kv.block_hash.root_hash)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose K/V is in the pool (cached hits + computed)
    num_cached_tokens: int = 0  # prefix-hit tokens at the FIRST admission (what the user is told was cached)
    num_prefilled_tokens: int = 0  # prompt tokens actually computed, summed over admissions (recompute included)
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    spans: SpanMap = field(default_factory=SpanMap)  # block type of each position (engine.prompt); the rest: fill
    # An invalidation reached this request: its blocks from this index on are never published (engine.invalidate).
    publish_limit: int | None = None
    # With params.prompt_logprobs: log p(prompt token p | tokens before it) at index p (None at 0 and until computed).
    prompt_logprobs: list[float | None] | None = None
    session: str | None = None  # the chat session it belongs to (owner of the blocks it publishes)
    system_tokens: int = 0  # its prompt's leading system message(s) (engine.prompt.TokenizedPrompt)
    # Tiers: while True, blocks of its prefix are being loaded from disk and the scheduler does not admit it yet;
    # ``promoted`` holds the hashes loaded for it, so the hit can be reported by tier.
    loading: bool = False
    promoted: frozenset[BlockHash] = frozenset()
    num_disk_cached_tokens: int = 0  # of num_cached_tokens, those promoted from disk for this request
    share: FairShare = DEFAULT_SHARE  # the tenant it is charged to (engine.fair_share); one shared one by default
    # Suffix drafts (engine.spec): the tokens proposed to follow its last token, verified in its next decode step;
    # and how many were verified / accepted over the request.
    draft_token_ids: list[int] = field(default_factory=list)
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise EmptyPromptError()
        if self.params.prompt_logprobs and self.prompt_logprobs is None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)

    def logprob_targets(self, start: int, end: int) -> list[int] | None:
        """For a step computing positions ``start .. end - 1``: the prompt tokens its leading rows predict (those at
        ``start + 1 .. min(end, num_prompt_tokens - 1)``); None when the request wants no prompt log-probabilities."""
        if self.prompt_logprobs is None:
            return None
        return self.prompt_token_ids[start + 1 : min(end + 1, len(self.prompt_token_ids))]

    def store_prompt_logprobs(self, start: int, values: list[float]) -> None:
        """Record the values a step computed for positions ``start + 1 ..`` (a recompute writes the same slots)."""
        if self.prompt_logprobs is not None:
            self.prompt_logprobs[start + 1 : start + 1 + len(values)] = values

    @property
    def fair_session(self) -> str:
        """Its key among its tenant's requests for fair scheduling: the chat session, or itself without one."""
        return self.session if self.session is not None else self.request_id

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list (the decode hot path asks for one token)."""
        p = len(self.prompt_token_ids)
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        if end <= p:
            return self.prompt_token_ids[start:end]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens})"
        )
