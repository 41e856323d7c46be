"""What one chat turn costs the backend: the prompt is tokenized once, the context is read from the database once
(issue 30), in the one transaction that stores the message, before the prompt goes to the engine (issue 43), through
a real server on SQLite and on Postgres.

The counts are of one turn after the session's first (so the session has history, blocks and a topic), from the
``user.message`` to its ``message.completed``, and of what ran of it before the prompt reached the engine. SQL
statements and commits are counted on the server's database engine, except the SQLite revocation poll's
(``api_keys``: ``backend/services/revocation.py``) and the fair-share poll's (``tenant_fair_share``: ``main.py``),
which run on their own clocks.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from sqlalchemy import event
from test_ws_chat import TIMEOUT, Chat

from backend.chat import agent_desk
from backend.chat.reply_stream import ReplyStreamer
from engine.llm_engine import LLMEngine
from engine.tokenizer import Tokenizer
from support.server import LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio


@pytest.fixture
def live(db_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    with serving(server_settings(db_url, tmp_path), tiny_engine) as server:
        yield server


_POLLS = ("api_keys", "FROM tenant_fair_share")


class Statements:
    """The SQL statements (and commits) the server runs, by kind (the first word), while ``counting``; and how many
    of each had run when the turn's prompt went to the engine (``ReplyStreamer.stream``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counting = False
        self.seen: list[str] = []
        self.commits = 0
        self.before_engine: tuple[list[str], int] | None = None
        self._lock = threading.Lock()
        stream = ReplyStreamer.stream

        async def streamed(streamer: ReplyStreamer, *args: Any, **kwargs: Any) -> Any:
            if self.counting:
                with self._lock:
                    self.before_engine = (list(self.seen), self.commits)
            return await stream(streamer, *args, **kwargs)

        monkeypatch.setattr(ReplyStreamer, "stream", streamed)

    def __call__(self, conn: Any, cursor: Any, statement: str, *_: Any) -> None:
        if self.counting and not any(poll in statement for poll in _POLLS):
            with self._lock:
                self.seen.append(statement)

    def commit(self, conn: Any) -> None:
        if self.counting:
            with self._lock:
                self.commits += 1

    def by_kind(self) -> Counter[str]:
        return Counter(s.split(None, 1)[0].upper() for s in self.seen)

    def matching(self, text: str) -> int:
        return sum(text in " ".join(s.split()) for s in self.seen)


class TokenizerCalls:
    """Calls of the engine tokenizer's chat-template renders (a whole prompt each) while ``counting``."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.counting = False
        self.calls: Counter[str] = Counter()
        for name in ("apply_chat_template", "apply_chat_template_segments"):
            monkeypatch.setattr(Tokenizer, name, self._counted(name, getattr(Tokenizer, name)))

    def _counted(self, name: str, method: Any) -> Any:
        def counted(tokenizer: Tokenizer, *args: Any, **kwargs: Any) -> Any:
            if self.counting:
                self.calls[name] += 1
            return method(tokenizer, *args, **kwargs)

        return counted


async def _second_turn(live: LiveServer, statements: Statements, tokenizer: TokenizerCalls) -> dict[str, Any]:
    async with websockets.connect(live.ws, open_timeout=TIMEOUT) as ws:
        chat = Chat(ws)
        await chat.hello()
        await chat.turn("first", "My parcel is late. Order #4061234567 was due on Monday, where is it?")
        statements.counting = tokenizer.counting = True
        _, done = await chat.turn("second", "It still has not arrived. Can you check the tracking for me?")
        statements.counting = tokenizer.counting = False
    return done


async def test_a_turn_reads_its_context_once_and_tokenizes_its_prompt_once(
    live: LiveServer, db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    statements = Statements(monkeypatch)
    tokenizer = TokenizerCalls(monkeypatch)
    # NOTE: the hand-off settings are read at most every SETTINGS_TTL_S, not per turn: a slow first turn must not
    # put that read into the second's count
    monkeypatch.setattr(agent_desk, "SETTINGS_TTL_S", 3600.0)
    event.listen(live.state.db_engine.sync_engine, "before_cursor_execute", statements)
    event.listen(live.state.db_engine.sync_engine, "commit", statements.commit)
    done = await _second_turn(live, statements, tokenizer)
    assert done["status"] == "complete"
    # the turn's reads (the session with its tenant and settings, messages, topic history, blocks, the rules'
    # version, the tenant's reply settings and tools), once: on Postgres in one statement (backend/services/
    # turn_read.py), on SQLite one statement each; before issue 30 the turn read them three times (45 statements)
    postgres = db_url.startswith("postgresql")
    reads = 1 if postgres else 7
    assert statements.matching("FROM splitter_rules") == 1
    assert statements.matching("FROM topic_history") == 1
    assert statements.matching("FROM tenant_tools") == 1
    assert statements.matching("array_agg(m ORDER BY m.seq) FROM messages") == (1 if postgres else 0)
    assert statements.by_kind() == {
        # the message's transaction: the reads, then the session locked and read (update … returning) and the
        # message inserted (its seq and a retried client_msg_id: from the messages read). The hand-off settings:
        # from memory (read at turn 1).
        # bookkeeping, beside the prefill, 4: 2 blocks in one insert, the one's parent (the other) set, the topic
        # row, the session's topic.
        # reply 5: its existing reply; the next seq; the session lock; insert; the message settled.
        # reply blocks 1: 1 block.
        # (22 statements before issue 43: the client_msg_id lookup and the next seq were their own queries)
        # NOTE: + 1 insert: the tiny model's first reply is noise, which the retrained topic classifier (issue 40)
        # reads as the agent leaving the topic, so the second message opens an epoch and the dropped one's
        # invalidation is recorded (with a real reply it stays on topic: tests/backend/context/).
        "SELECT": reads + 2,
        "INSERT": 6,
        "UPDATE": 5,
    }
    assert statements.commits == 5  # the message; the invalidation; the bookkeeping; the reply; the reply's blocks
    # before the prompt reached the engine: the message's transaction and, as an epoch was dropped, its invalidation
    # (which must come first: it would unpublish this turn's blocks); before issue 43, 15 statements and 2 commits
    # (and the invalidation's third)
    assert statements.before_engine is not None
    before, commits = statements.before_engine
    assert (Counter(s.split(None, 1)[0].upper() for s in before), commits) == (
        {"SELECT": reads, "INSERT": 2, "UPDATE": 1},
        2,
    )
    # the prompt is rendered once; the answerability check rendered the tenant's system prompt at turn 1 and bounds
    # this message by its length (before issue 43 it rendered the message with the system prompt every turn)
    assert tokenizer.calls == {"apply_chat_template_segments": 1}
