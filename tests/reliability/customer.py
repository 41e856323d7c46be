"""A customer's chat session as the reliability suites drive it: it survives its server, keeps what it was told,
resumes with ``last_seq`` and checks the replay.

What a customer holds is exactly what a real client can know: the seqs acknowledged for its messages, the stored
messages it saw (live or replayed), and the messages it sent but never saw acknowledged (it sends those again, with
the same ``client_msg_id``, after reconnecting).
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import websockets

from support.server import CHAT_TOKEN

TIMEOUT_S = 60.0


@dataclass(slots=True)
class ReplayCheck:
    """What resuming showed: seqs missing from the replay (gaps) and seqs replayed twice or below ``last_seq``."""

    gaps: list[int] = field(default_factory=list)
    duplicates: list[int] = field(default_factory=list)


@dataclass(slots=True)
class Customer:
    name: str
    rng: random.Random
    session_id: str | None = None
    acked: dict[str, int] = field(default_factory=dict)  # client_msg_id → seq the server acknowledged
    texts: dict[str, str] = field(default_factory=dict)  # every client_msg_id sent → its text
    seen: dict[int, dict[str, Any]] = field(default_factory=dict)  # seq → what the customer was shown
    replay: ReplayCheck = field(default_factory=ReplayCheck)
    _next: int = 0

    @property
    def last_seq(self) -> int:
        """The highest seq up to which this customer has seen every message (what it resumes from)."""
        seq = 0
        while seq + 1 in self.seen:
            seq += 1
        return seq

    @property
    def unacked(self) -> list[str]:
        return [cid for cid in self.texts if cid not in self.acked]

    async def chat(self, url: str, on_frame: Callable[[dict[str, Any]], None], turns: int | None = None) -> None:
        """Connect (resuming), send again what was never acknowledged, then talk until the server goes away (or
        ``turns`` new messages were answered). Every frame is passed to ``on_frame`` (the crash trigger)."""
        try:
            async with websockets.connect(url, max_queue=None, open_timeout=TIMEOUT_S) as ws:
                await self._resume(ws)
                for cid in self.unacked:
                    await self._turn(ws, cid, on_frame)
                done = 0
                while turns is None or done < turns:
                    await self._turn(ws, self._new_message(), on_frame)
                    done += 1
        except (websockets.WebSocketException, OSError):
            return  # the server died (mid-handshake too) or shut down: that is the point

    async def _resume(self, ws: Any) -> None:
        last_seq = self.last_seq
        hello: dict[str, Any] = {"type": "hello", "token": CHAT_TOKEN, "last_seq": last_seq}
        if self.session_id is not None:
            hello["session_id"] = self.session_id
        await ws.send(json.dumps(hello))
        welcome = await _recv(ws)
        assert welcome["type"] == "welcome", welcome
        self.session_id = welcome["session_id"]
        seqs = [m["seq"] for m in welcome["messages"]]
        self.replay.duplicates += [s for s in seqs if s <= last_seq or seqs.count(s) > 1]
        top = max(seqs, default=last_seq)
        self.replay.gaps += sorted(set(range(last_seq + 1, top + 1)) - set(seqs))
        for m in welcome["messages"]:
            self.seen[m["seq"]] = m
            if m["role"] == "user" and m["client_msg_id"] in self.texts:
                self.acked.setdefault(m["client_msg_id"], m["seq"])  # stored before the crash, never acked

    def _new_message(self) -> str:
        self._next += 1
        cid = f"{self.name}-{self._next}"
        self.texts[cid] = f"Question {self._next} from {self.name}: where is order {self.rng.randrange(10**6)}?"
        return cid

    async def _turn(self, ws: Any, cid: str, on_frame: Callable[[dict[str, Any]], None]) -> None:
        """Send one message and read until its reply is complete (or it gets an error)."""
        await ws.send(json.dumps({"type": "user.message", "client_msg_id": cid, "text": self.texts[cid]}))
        while True:
            frame = await _recv(ws)
            on_frame(frame)
            kind = frame["type"]
            if kind == "message.ack":
                # NOTE: a retry's ack must name the seq the first one did
                assert self.acked.setdefault(frame["client_msg_id"], frame["seq"]) == frame["seq"], frame
                self.seen[frame["seq"]] = {"seq": frame["seq"], "role": "user", "client_msg_id": frame["client_msg_id"]}
            elif kind == "message.completed":
                self.seen[frame["seq"]] = {"seq": frame["seq"], "role": "assistant", "status": frame["status"]}
                if frame["client_msg_id"] == cid:
                    return
            elif kind == "error" and frame.get("client_msg_id") == cid:
                await asyncio.sleep((frame.get("retry_after_ms") or 200) / 1000)
                return  # sent again on the next reconnect, or now by the caller's next turn


async def _recv(ws: Any) -> dict[str, Any]:
    frame: dict[str, Any] = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))
    return frame
