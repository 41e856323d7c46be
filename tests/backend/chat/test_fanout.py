"""The fan-out hears only the sessions a worker's sockets follow (issue 43), and a worker that begins to hear a session
mid-reply is caught up on the text so far. Three real fan-outs on a real Postgres database, in one process (the
server-level behaviour, real workers and a model, is ``test_two_workers.py``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack

import pytest

from backend.chat.fanout import Fanout
from backend.chat.hub import SessionHub
from backend.chat.protocol import MessageCompleted, MessageDelta, ServerFrame

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

TIMEOUT_S = 10.0
HEARTBEAT_S = 0.1


class Worker:
    """A worker's hub and fan-out; ``streaming`` is the text of the replies it runs (what its turns would answer)."""

    def __init__(self, url: str, name: str) -> None:
        self.hub = SessionHub()
        self.streaming: dict[str, dict[str, str]] = {}
        self.fanout = Fanout(
            url, name, self.hub, lambda: (), lambda s: self.streaming.get(s, {}).items(), heartbeat_s=HEARTBEAT_S
        )

    def delta(self, session_id: str, client_msg_id: str, text: str) -> None:
        replies = self.streaming.setdefault(session_id, {})
        replies[client_msg_id] = replies.get(client_msg_id, "") + text
        self.hub.publish(session_id, MessageDelta(client_msg_id=client_msg_id, text=text))

    def complete(self, session_id: str, client_msg_id: str) -> None:
        text = self.streaming[session_id].pop(client_msg_id)
        frame = MessageCompleted(client_msg_id=client_msg_id, seq=2, text=text, status="complete", finish_reason="stop")
        self.hub.publish(session_id, frame)


async def _until(check: Callable[[], bool]) -> None:
    for _ in range(int(TIMEOUT_S / 0.01)):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within the timeout")


@pytest.fixture
async def workers(pg_url: str) -> AsyncIterator[list[Worker]]:
    started = [Worker(pg_url, name) for name in ("a", "b", "c")]
    async with AsyncExitStack() as stack:
        for worker in started:
            worker.fanout.start()
            stack.push_async_callback(worker.fanout.stop)
        await _until(lambda: all(len(w.fanout.live_peers(1.0)) == 2 for w in started))
        yield started


async def _socket(worker: Worker, session_id: str) -> tuple[list[ServerFrame], int]:
    """A socket on ``worker`` following ``session_id``, welcomed as ``backend/chat/connection.py`` does."""
    frames: list[ServerFrame] = []
    async with worker.hub.following(session_id):
        token = worker.hub.subscribe(session_id, frames.append)
    return frames, token


async def test_a_worker_without_a_socket_of_a_session_hears_none_of_its_frames(workers: list[Worker]) -> None:
    a, b, c = workers
    on_b, _ = await _socket(b, "session-t")
    on_c, token_c = await _socket(c, "session-s")
    a.delta("session-s", "m1", "for c")
    a.complete("session-s", "m1")
    a.delta("session-t", "m2", "for b")  # (sent after s's frames: one ordered stream from a)
    a.complete("session-t", "m2")
    await _until(lambda: len(on_b) == 2 and len(on_c) == 2)
    assert [type(f) for f in on_b] == [MessageDelta, MessageCompleted]
    assert [f.text for f in on_b if isinstance(f, MessageDelta)] == ["for b"]
    assert [f.text for f in on_c if isinstance(f, MessageDelta)] == ["for c"]
    assert b.fanout.frames_heard == 2  # session-t's two frames; none of session-s's
    assert c.fanout.frames_heard == 2

    c.hub.unsubscribe("session-s", token_c)  # c's last socket of session-s leaves: c stops hearing it
    await asyncio.sleep(0.2)
    a.delta("session-s", "m3", "nobody on c")
    a.delta("session-t", "m4", "still b")
    await _until(lambda: len(on_b) == 3)
    await asyncio.sleep(0.2)  # (c would have heard session-s's delta by now: it was sent first)
    assert c.fanout.frames_heard == 2
    assert len(on_c) == 2


async def test_a_socket_that_moves_mid_reply_gets_the_text_so_far_and_the_rest(workers: list[Worker]) -> None:
    a, b, _ = workers
    on_a, _ = await _socket(a, "session-s")
    a.delta("session-s", "m1", "Hello")  # b does not hear session-s yet
    a.delta("session-s", "m1", ", wor")
    assert b.hub.remote_in_flight("session-s") is None
    async with b.hub.following("session-s"):
        in_flight = b.hub.remote_in_flight("session-s")  # what the welcome reads
        on_b: list[ServerFrame] = []
        b.hub.subscribe("session-s", on_b.append)
    a.delta("session-s", "m1", "ld")
    a.complete("session-s", "m1")
    await _until(lambda: len(on_b) == 2)
    assert in_flight is not None
    assert (in_flight.worker, in_flight.client_msg_id, in_flight.text) == ("a", "m1", "Hello, wor")
    assert [type(f) for f in on_b] == [MessageDelta, MessageCompleted]
    completed = on_b[1]
    assert isinstance(completed, MessageCompleted)
    assert in_flight.text + "".join(f.text for f in on_b if isinstance(f, MessageDelta)) == completed.text
    assert completed.text == "Hello, world"
    assert b.hub.remote_in_flight("session-s") is None  # (the completed reply is forgotten)
    assert len(on_a) == 4  # a's own socket saw every frame
