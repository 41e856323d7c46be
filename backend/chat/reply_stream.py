"""One engine request of a turn, streamed to the session's sockets as ``message.delta`` frames, with what may be a
tool call held back.

``shown`` says how much of the request's text so far may be published: all of it for a plain reply; in a turn that
offers tools, all but what is, or may still become, a tool call (``backend/tools/parsers.shown_length``: from a
``<tool_call>`` tag, or the start of one at the end of the text; for Llama 3, the whole reply while it starts with
``{``). What is published is appended to the turn's parts, so the stored reply is exactly what the customer saw.

Everything published passes the turn's contact guard first (``backend/context/contact_guard.py``): a URL, e-mail
address or phone number its grounding does not hold is replaced before any socket sees it, and the guard holds back
the few characters that may still become one until ``settle`` (the end of the reply, or of the text before a call).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass

from backend.chat.hub import SessionHub
from backend.chat.protocol import MessageDelta
from backend.chat.turn_state import Turn
from backend.core.metrics import Metrics
from backend.engine_client.protocol import EngineClient
from backend.engine_client.values import FairShare, RequestFinished, SamplingParams, TokenDelta, TokenizedPrompt

ShownLength = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class Streamed:
    finished: RequestFinished | None  # None: the stream ended without one (aborted before it ran)
    text: str  # everything the model wrote in this request
    shown: int  # how much of ``text`` was published


class ReplyStreamer:
    def __init__(self, engine: EngineClient, hub: SessionHub, metrics: Metrics | None = None) -> None:
        self._engine = engine
        self._hub = hub
        self._metrics = metrics

    async def stream(
        self, turn: Turn, prompt: TokenizedPrompt, params: SamplingParams, shown: ShownLength | None = None
    ) -> Streamed:
        """Run ``turn.request_id`` on ``prompt``; publish its text as it comes, save what ``shown`` holds back.

        NOTE: no await before the first step of the stream, which registers the request (its prompt is tokenized:
        nothing to offload): an abort after the caller's check of ``turn.cancelled`` finds it.
        """
        text, published, finished = "", 0, None
        timer = self._metrics.reply_timer(turn.tenant_id) if self._metrics is not None else None
        share = FairShare(turn.tenant_id)  # (the engine's quotas gate sets the tenant's weight: core/tenant_quota.py)
        stream = self._engine.generate(prompt, params, turn.namespace, turn.request_id, turn.session_id, share)
        turn.marks.mark("submitted")
        async with aclosing(stream):
            async for event in stream:
                if isinstance(event, TokenDelta):
                    if not text:
                        turn.marks.mark("first_token")
                    if timer is not None:
                        timer.delta()
                    # NOTE: a model can emit NUL, which Postgres text cannot store; what is streamed is what is stored.
                    text += event.text.replace("\x00", "")
                    upto = len(text) if shown is None else shown(text)
                    if upto > published:
                        self.publish(turn, text[published:upto])
                        published = upto
                else:
                    if timer is not None:
                        timer.finished(event.stats)
                    finished = event
        return Streamed(finished, text, published)

    def publish(self, turn: Turn, text: str) -> None:
        """Show ``text`` (what the contact guard lets through of it, now) to the session and make it part of the
        stored reply."""
        self._show(turn, turn.guard.feed(text) if turn.guard is not None else text)

    def settle(self, turn: Turn) -> None:
        """The text so far is final (the reply ended, or a call follows it): show what the guard held back."""
        if turn.guard is not None:
            self._show(turn, turn.guard.flush())

    def _show(self, turn: Turn, text: str) -> None:
        if text:
            turn.marks.mark("first_shown")
            turn.parts.append(text)
            self._hub.publish(turn.session_id, MessageDelta(client_msg_id=turn.client_msg_id, text=text))
