"""The realistic customer-service workload: datasets → sessions → the exact chat messages of every turn.

A session is one tenant's system prompt (a short instruction plus a policy excerpt rendered from the ABCD agent
handbook, ≈ 1,000 tokens, identical for every session of that tenant) followed by CuCom e-commerce conversations
replayed turn by turn: the user turns are what is sent; after each turn the *recorded* agent turn is appended to the
history as the assistant's message, so every system sees exactly the same prompts whatever it generated.
Conversations are spliced back to back when a session needs more turns than one conversation has (a topic shift).

Everything is deterministic for a given seed. Arrival pattern (``burst``, ``ramp``, ``poisson``) and think time
(``fixed`` or ``exp`` with a mean) are part of the workload, drawn from the same seed.

Data (read from ``--data-dir``, default ``bench/data/``, vendored xz-compressed: ``bench/datasets.py``):

* ``cucom_ecommerce_dev.jsonl`` — a subset of the CuCom v0.1 e-commerce conversations (vakyansh/cucom), Apache-2.0.
* ``abcd_guidelines.json`` — the agent handbook of the ABCD dataset (asappresearch/abcd), MIT.

The benchmark program that replays it is ``bench.run`` (``make bench`` runs ``bench.run --standard`` through
``bench.run_all``); this module imports no other benchmark module but ``bench.datasets``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from bench.datasets import CONVERSATIONS_FILE, DATA_DIR, GUIDELINES_FILE, read_text

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DATA_DIR = DATA_DIR
# NOTE: ≈ 4 characters per token for this English text with SmolLM2's tokenizer; the run reports the exact count.
DEFAULT_POLICY_CHARS = 4300
_USER_ROLES = frozenset({"user", "customer", "client"})
_AGENT_ROLES = frozenset({"agent", "assistant", "bot", "support"})

ChatMessage = dict[str, str]


class Arrival(StrEnum):
    BURST = "burst"  # every session starts at once
    RAMP = "ramp"  # starts evenly spread over the arrival window
    POISSON = "poisson"  # exponential gaps, on average window / sessions


class ThinkTime(StrEnum):
    FIXED = "fixed"
    EXP = "exp"  # exponential with the given mean


@dataclass(frozen=True, slots=True)
class WorkloadConfig:
    data_dir: Path = DEFAULT_DATA_DIR
    turns: int = 12
    seed: int = 0
    tenants: int = 1
    policy_chars: int = DEFAULT_POLICY_CHARS
    think_time_s: float = 0.0
    think: ThinkTime = ThinkTime.FIXED
    arrival: Arrival = Arrival.BURST
    arrival_window_s: float = 0.0

    def __post_init__(self) -> None:
        if self.turns < 1 or self.tenants < 1 or self.policy_chars < 0:
            raise ValueError(f"invalid workload config: {self}")
        if self.think_time_s < 0 or self.arrival_window_s < 0:
            raise ValueError("think time and arrival window must be >= 0")


@dataclass(frozen=True, slots=True)
class Turn:
    index: int  # 1-based position in the session
    user: str
    reference_reply: str  # the recorded agent turn, appended to the history after this turn
    conversation_id: str


@dataclass(frozen=True, slots=True)
class Session:
    session_id: str
    tenant: str
    system_prompt: str
    turns: tuple[Turn, ...]
    start_s: float  # arrival offset from the start of the run
    think_s: tuple[float, ...]  # pause before each turn (0 before the first)

    def messages(self, turn_index: int) -> list[ChatMessage]:
        """System prompt, earlier turns (user + recorded agent reply), then this turn's user message."""
        if not 1 <= turn_index <= len(self.turns):
            raise ValueError(f"turn {turn_index} outside 1..{len(self.turns)}")
        out: list[ChatMessage] = [{"role": "system", "content": self.system_prompt}]
        for turn in self.turns[: turn_index - 1]:
            out.append({"role": "user", "content": turn.user})
            out.append({"role": "assistant", "content": turn.reference_reply})
        out.append({"role": "user", "content": self.turns[turn_index - 1].user})
        return out


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    pairs: tuple[tuple[str, str], ...]  # (user, agent)


# ---------------------------------------------------------------------------------------------------- datasets


def load_conversations(path: Path) -> list[Conversation]:
    """CuCom JSON lines → conversations of (user, agent) pairs (roles in any case; same-role runs merged)."""
    out: list[Conversation] = []
    for line_no, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        record = json.loads(line)
        pairs = _pairs(record.get("turns", []))
        if pairs:
            out.append(Conversation(str(record.get("id", f"line{line_no}")), pairs))
    if not out:
        raise ValueError(f"no usable conversations in {path}")
    return out


def _pairs(turns: Iterable[dict[str, Any]]) -> tuple[tuple[str, str], ...]:
    merged: list[tuple[str, str]] = []  # (speaker, text) with same-speaker runs joined
    for turn in turns:
        role = str(turn.get("role", "")).strip().lower()
        text = str(turn.get("content", "")).strip()
        speaker = "user" if role in _USER_ROLES else "agent" if role in _AGENT_ROLES else None
        if speaker is None or not text:
            continue
        if merged and merged[-1][0] == speaker:
            merged[-1] = (speaker, merged[-1][1] + "\n" + text)
        else:
            merged.append((speaker, text))
    if merged and merged[0][0] == "agent":
        merged = merged[1:]  # NOTE: a chat template expects the first non-system turn to be the user's
    return tuple((merged[i][1], merged[i + 1][1]) for i in range(0, len(merged) - 1, 2))


def load_guidelines(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(read_text(path))
    return data


def render_policy(guidelines: dict[str, Any], tenant_index: int, seed: int, max_chars: int) -> str:
    """A handbook excerpt: flows in a tenant-specific order, rendered as text and cut at a line near ``max_chars``."""
    flows = sorted(guidelines)
    random.Random(f"policy:{seed}:{tenant_index}").shuffle(flows)
    lines: list[str] = []
    size = 0
    for line in (ln for flow in flows for ln in _flow_lines(flow, guidelines[flow])):
        if size + len(line) + 1 > max_chars:
            break
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)


def _flow_lines(flow: str, body: dict[str, Any]) -> list[str]:
    lines = [f"## {flow}: {body.get('description', '')}".rstrip(": ")]
    for name, sub in body.get("subflows", {}).items():
        lines.append(f"### {name}")
        lines.extend(f"- {text}" for text in sub.get("instructions", []))
        for n, action in enumerate(sub.get("actions", []), 1):
            button = action.get("button")
            lines.append(f"{n}. {'[' + button + '] ' if button else ''}{action.get('text', '')}".rstrip())
            lines.extend(f"   - {text}" for text in action.get("subtext", []))
    return lines


def system_prompt(tenant_index: int, policy: str) -> str:
    store = f"Store {tenant_index + 1}"
    head = (
        f"You are the customer-service assistant of {store}, an online shop. Be brief, polite and accurate. "
        "Follow the agent handbook below; never invent order details; ask for the information a flow needs."
    )
    return f"{head}\n\n# Agent handbook\n{policy}" if policy else head


# ---------------------------------------------------------------------------------------------------- sessions


def build_sessions(config: WorkloadConfig, count: int, start: int = 0) -> list[Session]:
    """Sessions ``start .. start+count-1`` of the workload (each draws its own conversations, never shared)."""
    data = Path(config.data_dir)
    conversations = load_conversations(data / CONVERSATIONS_FILE)
    guidelines = load_guidelines(data / GUIDELINES_FILE)
    return sessions_from(conversations, guidelines, config, count, start)


def sessions_from(
    conversations: Sequence[Conversation],
    guidelines: dict[str, Any],
    config: WorkloadConfig,
    count: int,
    start: int = 0,
) -> list[Session]:
    order = list(conversations)
    random.Random(f"conversations:{config.seed}").shuffle(order)
    prompts = [
        system_prompt(t, render_policy(guidelines, t, config.seed, config.policy_chars)) for t in range(config.tenants)
    ]
    starts = arrival_offsets(config, start + count)
    cursor = 0
    sessions: list[Session] = []
    for k in range(start + count):
        turns: list[Turn] = []
        while len(turns) < config.turns:
            conv = order[cursor % len(order)]
            cursor += 1
            for user, agent in conv.pairs[: config.turns - len(turns)]:
                turns.append(Turn(len(turns) + 1, user, agent, conv.conversation_id))
        if k < start:
            continue
        tenant = k % config.tenants
        sessions.append(
            Session(
                session_id=f"s{config.seed}-{k:04d}",
                tenant=f"tenant{tenant}",
                system_prompt=prompts[tenant],
                turns=tuple(turns),
                start_s=starts[k] - (starts[start] if start < len(starts) else 0.0),
                think_s=think_times(config, k),
            )
        )
    return sessions


def arrival_offsets(config: WorkloadConfig, count: int) -> list[float]:
    if config.arrival == Arrival.BURST or count == 0 or config.arrival_window_s == 0:
        return [0.0] * count
    if config.arrival == Arrival.RAMP:
        return [config.arrival_window_s * i / count for i in range(count)]
    rng = random.Random(f"arrival:{config.seed}")
    rate = count / config.arrival_window_s
    t, out = 0.0, []
    for _ in range(count):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def think_times(config: WorkloadConfig, session_index: int) -> tuple[float, ...]:
    mean = config.think_time_s
    if config.think == ThinkTime.FIXED or mean == 0:
        return (0.0, *(mean,) * (config.turns - 1))
    rng = random.Random(f"think:{config.seed}:{session_index}")
    return (0.0, *(rng.expovariate(1 / mean) for _ in range(config.turns - 1)))
