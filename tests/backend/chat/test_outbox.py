"""A socket's outbox is bounded in frames and in bytes: a client that stops reading is marked too slow, and what the
server holds for it never passes the bounds (deterministic: a websocket whose sends never complete)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from backend.chat.connection import ChatConnection, ConnectionLimits
from backend.chat.protocol import ErrorFrame, MessageDelta
from backend.core.metrics import Metrics

pytestmark = pytest.mark.anyio


class _StalledSocket:
    """A websocket whose client never reads: every send waits forever."""

    async def send_text(self, _text: str) -> None:
        await asyncio.Event().wait()


def _connection(**limits: Any) -> ChatConnection:
    return ChatConnection(_StalledSocket(), None, ConnectionLimits(**limits), Metrics())  # type: ignore[arg-type]


async def test_frames_past_the_frame_bound_mark_the_client_too_slow() -> None:
    conn = _connection(max_queued_frames=16)
    for i in range(16):
        conn.send(MessageDelta(client_msg_id="m", text=f"t{i}"))
    assert not conn.too_slow.is_set() and conn.outbox.qsize() == 16
    conn.send(MessageDelta(client_msg_id="m", text="one too many"))
    assert conn.too_slow.is_set()
    for _ in range(1000):  # later frames are dropped, never queued
        conn.send(MessageDelta(client_msg_id="m", text="x"))
    assert conn.outbox.qsize() == 16


async def test_bytes_past_the_byte_bound_mark_the_client_too_slow() -> None:
    conn = _connection(max_queued_frames=1024, max_queued_bytes=64 * 1024)
    big = "x" * 10_000
    sent = 0
    while not conn.too_slow.is_set():
        conn.send(MessageDelta(client_msg_id="m", text=big))
        sent += 1
    assert sent == 7  # six frames of ~10 KB fit in 64 KiB, the seventh does not
    assert conn.queued_bytes <= 64 * 1024
    assert conn.outbox.qsize() == 6


async def test_the_writer_frees_bytes_as_it_sends() -> None:
    class Recorder:
        def __init__(self) -> None:
            self.sent: list[str] = []

        async def send_text(self, text: str) -> None:
            self.sent.append(text)

    ws = Recorder()
    conn = ChatConnection(ws, None, ConnectionLimits(), Metrics())  # type: ignore[arg-type]
    conn.send(ErrorFrame(code="bad_json", message="no"))
    writer = asyncio.create_task(conn._write_loop())
    await asyncio.sleep(0.01)
    writer.cancel()
    assert conn.queued_bytes == 0
    assert ws.sent == [ErrorFrame(code="bad_json", message="no").model_dump_json()]
