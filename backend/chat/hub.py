"""Who listens to which session: every open socket subscribes to its session's frames; counts sockets per tenant
and per client (a customer ref, else an IP address), so one customer cannot take a whole tenant's sockets.

A turn publishes its frames to the session, not to the socket that asked, so a customer who reconnects (or opens the
chat twice) sees the reply continue in every open window. ``keys`` watches which key opened each socket, so revoking
that key closes it (``backend/services/revocation.py``).

With several server processes (``backend/chat/fanout.py``), ``relay`` carries this process's frames to the others,
and their frames come in through ``deliver_remote``: the hub keeps the text of their replies in flight (so a customer
who reconnects to this process mid-reply gets it in ``welcome.in_flight``) and their socket counts (so the caps hold
across processes). Each process hears only the sessions (hub keys) its own sockets follow: ``on_keys_changed`` tells
the fan-out when a key gains its first socket or loses its last, and ``following`` holds a key heard while a socket
is being welcomed (the fan-out catches up on the replies other processes have in flight).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass

from backend.chat.protocol import MessageCompleted, MessageDelta, ServerFrame
from backend.services.revocation import KeyWatch

Send = Callable[[ServerFrame], None]
# NOTE: hellos whose key and session are being looked up at once. A burst's database work then runs a few at a time,
# and the loop stays free to read the other hellos and refuse those over a cap from memory: 300 hellos against a cap
# of 200 took 168 ms (p50) to be refused without the bound, all of them after the 200 accepted ones' work.
MAX_WELCOMING = 8
Relay = Callable[[str, ServerFrame], None]
Follow = Callable[[str], AbstractAsyncContextManager[None]]


@dataclass(frozen=True, slots=True)
class ConnectionKey:
    """Whose socket this is: the tenant, and the client within it (customer ref or IP address)."""

    tenant_id: str
    client: str


@dataclass(frozen=True, slots=True)
class RemoteReply:
    """A reply another process is streaming: whose turn, and its text so far."""

    worker: str
    client_msg_id: str
    text: str


class SessionHub:
    def __init__(self) -> None:
        self._subscribers: dict[str, dict[int, Send]] = defaultdict(dict)
        self._tenant_connections: dict[str, int] = defaultdict(int)
        self._client_connections: dict[ConnectionKey, int] = defaultdict(int)
        self._next_token = 0
        self.welcoming = asyncio.Semaphore(MAX_WELCOMING)  # (held by a socket from its hello to its welcome)
        self.keys = KeyWatch()
        self.relay: Relay | None = None  # set by the fan-out: this process's frames, to the other processes
        self.on_counts_changed: Callable[[], None] | None = None  # the fan-out announces the new counts
        self.on_keys_changed: Callable[[], None] | None = None  # a key gained its first socket or lost its last
        self.follow: Follow | None = None  # set by the fan-out: hear a key, caught up on the others' replies
        # other processes: their replies in flight (session -> client_msg_id -> reply) and their socket counts
        self._remote_replies: dict[str, dict[str, RemoteReply]] = {}
        self._remote_tenants: dict[str, Counter[str]] = {}
        self._remote_clients: dict[str, Counter[ConnectionKey]] = {}

    def subscribe(self, session_id: str, send: Send) -> int:
        self._next_token += 1
        first = session_id not in self._subscribers
        self._subscribers[session_id][self._next_token] = send
        if first:
            self._keys_changed()
        return self._next_token

    def unsubscribe(self, session_id: str, token: int) -> None:
        subs = self._subscribers.get(session_id)
        if subs is not None:
            subs.pop(token, None)
            if not subs:
                del self._subscribers[session_id]
                self._keys_changed()

    def followed(self) -> set[str]:
        """The keys (sessions, inboxes) this process's sockets follow now."""
        return set(self._subscribers)

    @contextlib.asynccontextmanager
    async def following(self, session_id: str) -> AsyncIterator[None]:
        """Hold ``session_id`` heard from the other processes while a socket is welcomed: on entry, this process hears
        the session's frames and knows the text of its replies in flight elsewhere; subscribe before leaving. A new
        session (no id yet) has nothing to catch up on."""
        if self.follow is None or not session_id:
            yield
            return
        async with self.follow(session_id):
            yield

    def publish(self, session_id: str, frame: ServerFrame) -> None:
        """A frame of this process: to its sockets on the session, and (through the fan-out) to other processes'."""
        self.deliver(session_id, frame)
        if self.relay is not None:
            self.relay(session_id, frame)

    def deliver(self, session_id: str, frame: ServerFrame) -> None:
        """To this process's sockets on the session only."""
        for send in list(self._subscribers.get(session_id, {}).values()):
            send(frame)

    def deliver_remote(self, worker: str, session_id: str, frame: ServerFrame) -> None:
        """A frame another process published: note its reply's text so far, then deliver it here."""
        if isinstance(frame, MessageDelta):
            replies = self._remote_replies.setdefault(session_id, {})
            known = replies.get(frame.client_msg_id)
            text = frame.text if known is None else known.text + frame.text
            replies[frame.client_msg_id] = RemoteReply(worker, frame.client_msg_id, text)
        elif isinstance(frame, MessageCompleted):
            self._forget_reply(session_id, frame.client_msg_id)
        self.deliver(session_id, frame)

    def set_remote_reply(self, session_id: str, reply: RemoteReply) -> None:
        """Another process's reply in flight, as it answered when this process began to hear the session."""
        self._remote_replies.setdefault(session_id, {})[reply.client_msg_id] = reply

    def forget_remote(self, session_id: str) -> None:
        """This process no longer hears the session: what it knew of the others' replies there goes stale."""
        self._remote_replies.pop(session_id, None)

    def remote_in_flight(self, session_id: str) -> RemoteReply | None:
        """The session's reply another process is streaming now (the first, when several are), or None."""
        replies = self._remote_replies.get(session_id)
        return next(iter(replies.values()), None) if replies else None

    def subscriber_count(self, session_id: str) -> int:
        return len(self._subscribers.get(session_id, {}))

    # ------------------------------------------------------------------ connection counts

    def refusal(self, key: ConnectionKey, tenant_cap: int, client_cap: int) -> str | None:
        """Why a new socket of ``key`` would be refused now (closed with 1013), or None. Counts nothing.

        The counts are this process's plus the other processes' last announced ones."""
        tenant = self._tenant_connections.get(key.tenant_id, 0)
        tenant += sum(c[key.tenant_id] for c in self._remote_tenants.values())
        if tenant >= tenant_cap:
            return f"too many connections for this tenant (limit {tenant_cap})"
        client = self._client_connections.get(key, 0) + sum(c[key] for c in self._remote_clients.values())
        if client >= client_cap:
            return f"too many connections for this client (limit {client_cap})"
        return None

    def try_connect(self, key: ConnectionKey, tenant_cap: int, client_cap: int) -> str | None:
        """Count a new socket, or return why it is refused (the caller closes it with 1013)."""
        refused = self.refusal(key, tenant_cap, client_cap)
        if refused is None:
            self._tenant_connections[key.tenant_id] += 1
            self._client_connections[key] += 1
            self._counts_changed()
        return refused

    def disconnect(self, key: ConnectionKey) -> None:
        self._tenant_connections[key.tenant_id] = max(0, self._tenant_connections[key.tenant_id] - 1)
        left = self._client_connections.pop(key, 0) - 1
        if left > 0:
            self._client_connections[key] = left  # NOTE: zero counts are dropped, so the map holds live clients only
        self._counts_changed()

    def connections(self, tenant_id: str) -> int:
        return self._tenant_connections[tenant_id]

    def local_counts(self) -> tuple[dict[str, int], dict[ConnectionKey, int]]:
        """This process's sockets per tenant and per client (the ones with any)."""
        tenants = {t: n for t, n in self._tenant_connections.items() if n > 0}
        return tenants, dict(self._client_connections)

    def set_remote_counts(self, worker: str, tenants: dict[str, int], clients: dict[ConnectionKey, int]) -> None:
        """Another process's socket counts, as it last announced them."""
        self._remote_tenants[worker] = Counter(tenants)
        self._remote_clients[worker] = Counter(clients)

    def drop_worker(self, worker: str) -> None:
        """Another process is gone: forget its counts and its replies in flight (they were cut off)."""
        self._remote_tenants.pop(worker, None)
        self._remote_clients.pop(worker, None)
        for session_id, replies in list(self._remote_replies.items()):
            for client_msg_id, reply in list(replies.items()):
                if reply.worker == worker:
                    self._forget_reply(session_id, client_msg_id)

    def _forget_reply(self, session_id: str, client_msg_id: str) -> None:
        replies = self._remote_replies.get(session_id)
        if replies is not None:
            replies.pop(client_msg_id, None)
            if not replies:
                del self._remote_replies[session_id]

    def _keys_changed(self) -> None:
        if self.on_keys_changed is not None:
            self.on_keys_changed()

    def _counts_changed(self) -> None:
        if self.on_counts_changed is not None:
            self.on_counts_changed()
