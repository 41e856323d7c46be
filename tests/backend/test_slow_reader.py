"""A client that never reads (issue 20): it must not stall other sockets, nor grow the server's memory without bound.

The slow client shares a session with a normal client (so every frame of that session is published to both) while
a customer of another session chats too. The server bounds each socket's outbox (``ConnectionLimits.
max_queued_frames``, lowered here) and closes a socket whose outbox overflows with 1008 (policy); the other sockets'
replies keep arriving in normal time. NOTE: the kernel's send buffer (autotuned up to megabytes) absorbs frames
before the outbox fills, so whether this run's slow socket is cut off depends on the machine; the outbox bound itself
is tested deterministically in tests/backend/chat/test_outbox.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from websockets.asyncio.client import ClientConnection

from engine.llm_engine import LLMEngine
from support.server import CHAT_TOKEN, LiveServer, server_settings, serving

pytestmark = pytest.mark.anyio

TIMEOUT_S = 60.0
POLICY = 1008  # the server's close code for a client that stopped reading (backend/chat/connection.py)
ABNORMAL = 1006  # what the client library reports when the TCP connection ends without a close frame
REPLY_TOKENS = 400
# NOTE: the slow socket overflows after its kernel buffers (~30 KB with a 4 KB receive buffer), the transport's 64 KiB
# and an outbox of QUEUED_FRAMES (lowered from the default 1024, so kernel buffers that vary with the machine's load
# never decide the outcome): ~1400 frames of ~75 bytes, under 4 replies of 400 deltas; 7 leave three to spare.
SLOW_MESSAGES = 7
QUEUED_FRAMES = 128
# NOTE: "normal time" is generous on purpose (a loaded 2-core CI box): a stalled socket never finishes, so even ten
# times its unloaded turn time, with a 5 s floor, separates "slowed by a neighbour" from "stalled behind one".
STALL_FACTOR = 10.0
STALL_FLOOR_S = 5.0


@pytest.fixture
def live(sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    settings = server_settings(
        sqlite_url,
        tmp_path,
        reply_max_tokens=REPLY_TOKENS,
        ws_rate_per_second=100.0,
        ws_rate_burst=100,
        ws_max_queued_frames=QUEUED_FRAMES,
    )
    with serving(settings, tiny_engine) as server:
        yield server


async def _send(ws: ClientConnection, **frame: Any) -> None:
    await ws.send(json.dumps(frame))


async def _recv(ws: ClientConnection) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    return frame


async def _hello(ws: ClientConnection, **extra: Any) -> dict[str, Any]:
    await _send(ws, type="hello", token=CHAT_TOKEN, **extra)
    welcome = await _recv(ws)
    assert welcome["type"] == "welcome", welcome
    return welcome


async def _turn(ws: ClientConnection, client_msg_id: str) -> float:
    """One turn on a socket that only carries its own session's turns: seconds until its ``message.completed``."""
    start = time.perf_counter()
    await _send(ws, type="user.message", client_msg_id=client_msg_id, text="Where is my order?")
    while True:
        frame = await _recv(ws)
        assert frame["type"] != "error", frame
        if frame["type"] == "message.completed" and frame["client_msg_id"] == client_msg_id:
            assert frame["status"] == "complete", frame
            return time.perf_counter() - start


def _tiny_receive_buffer_socket(live: LiveServer) -> socket.socket:
    """A connected TCP socket whose kernel receive buffer is as small as Linux allows, so that a client that does
    not read backs up into the server within a few kilobytes instead of megabytes."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", live.settings.port))
    sock.setblocking(False)
    return sock


async def _drain(ws: ClientConnection) -> tuple[int, int | None]:
    """Read everything the server sent: (frames, the close code, or None when the server never closed the socket)."""
    frames = 0
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 5.0)
            frames += 1
    except websockets.ConnectionClosed as closed:
        return frames, closed.rcvd.code if closed.rcvd is not None else ABNORMAL
    except TimeoutError:
        return frames, None


async def test_a_client_that_never_reads_is_cut_off_and_stalls_nobody(live: LiveServer) -> None:
    limit = QUEUED_FRAMES
    async with (
        websockets.connect(live.ws, open_timeout=TIMEOUT_S) as same,
        websockets.connect(live.ws, open_timeout=TIMEOUT_S) as other,
    ):
        session_id = (await _hello(same))["session_id"]
        await _hello(other)
        baseline = statistics.median([await _turn(other, f"warm-{i}") for i in range(2)])
        # NOTE: max_queue=1 makes the client library stop reading the transport at once, compression=None keeps the
        # frames as large on the wire as in the server's outbox, and no keepalive pings: this client only writes.
        async with websockets.connect(
            live.ws,
            sock=_tiny_receive_buffer_socket(live),
            max_queue=1,
            compression=None,
            ping_interval=None,
            open_timeout=TIMEOUT_S,
        ) as slow:
            await _send(slow, type="hello", token=CHAT_TOKEN, session_id=session_id)
            for i in range(SLOW_MESSAGES):
                with contextlib.suppress(websockets.ConnectionClosed):
                    await _send(slow, type="user.message", client_msg_id=f"slow-{i}", text="Tell me everything.")
            # NOTE: the same-session socket's own message is answered after the slow client's (a session's turns run
            # in order), so for it "normal time" is the gap between the session's frames, not its own turn's length.
            await _send(same, type="user.message", client_msg_id="same-0", text="And my other order?")
            same_task = asyncio.create_task(_session_replies(same, SLOW_MESSAGES + 1))
            during = [await _turn(other, f"during-{i}") for i in range(3)]
            same_gaps = await asyncio.wait_for(same_task, (SLOW_MESSAGES + 1) * 60)
            # every reply of the session is done and the slow client has not read a byte: the server must have let go
            subscribers_left = live.state.chat.hub.subscriber_count(session_id)
            frames, code = await _drain(slow)
    budget = max(STALL_FLOOR_S, STALL_FACTOR * baseline)
    published = (SLOW_MESSAGES + 1) * (REPLY_TOKENS + 1) + SLOW_MESSAGES + 1  # replies, acks, welcome
    print(
        f"\nother session: unloaded turn {baseline:.3f} s, beside the slow reader {[round(d, 3) for d in during]} s;"
        f" same session: longest gap between frames {max(same_gaps):.3f} s;"
        f" slow socket: {frames} of ~{published} frames delivered, close code {code};"
        f" subscribers left {subscribers_left}"
    )
    assert max(during) <= budget, during
    assert max(same_gaps) <= budget, same_gaps
    if subscribers_left == 2:  # the kernel absorbed what the outbox did not: nothing was cut off, nothing stalled
        assert code is None
        return
    assert subscribers_left == 1  # only the reading socket still hears the session
    # NOTE: the server's 1008 close frame queues behind the frames the client left unread, so a client that reads
    # only now sees it if it started reading within the server's close timeout; otherwise the TCP connection was
    # dropped (1006). Either way the server closed it, and not after keeping every frame of the session for it.
    assert code in (POLICY, ABNORMAL), code
    assert frames < published - limit


async def _session_replies(ws: ClientConnection, expected: int) -> list[float]:
    """Read the session's frames until ``expected`` replies completed; the gaps between consecutive frames (s)."""
    gaps: list[float] = []
    last = time.perf_counter()
    completed = 0
    while completed < expected:
        frame = await _recv(ws)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        if frame["type"] == "message.completed":
            assert frame["status"] == "complete", frame
            completed += 1
    return gaps
