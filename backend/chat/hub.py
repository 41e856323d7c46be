"""Who listens to which session: every open socket subscribes to its session's frames; counts sockets per tenant
and per client (a customer ref, else an IP address), so one customer cannot take a whole tenant's sockets.

A turn publishes its frames to the session, not to the socket that asked, so a customer who reconnects (or opens the
chat twice) sees the reply continue in every open window. ``keys`` watches which key opened each socket, so revoking
that key closes it (``backend/services/revocation.py``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from backend.chat.protocol import ServerFrame
from backend.services.revocation import KeyWatch

Send = Callable[[ServerFrame], None]


@dataclass(frozen=True, slots=True)
class ConnectionKey:
    """Whose socket this is: the tenant, and the client within it (customer ref or IP address)."""

    tenant_id: str
    client: str


class SessionHub:
    def __init__(self) -> None:
        self._subscribers: dict[str, dict[int, Send]] = defaultdict(dict)
        self._tenant_connections: dict[str, int] = defaultdict(int)
        self._client_connections: dict[ConnectionKey, int] = defaultdict(int)
        self._next_token = 0
        self.keys = KeyWatch()

    def subscribe(self, session_id: str, send: Send) -> int:
        self._next_token += 1
        self._subscribers[session_id][self._next_token] = send
        return self._next_token

    def unsubscribe(self, session_id: str, token: int) -> None:
        subs = self._subscribers.get(session_id)
        if subs is not None:
            subs.pop(token, None)
            if not subs:
                del self._subscribers[session_id]

    def publish(self, session_id: str, frame: ServerFrame) -> None:
        for send in list(self._subscribers.get(session_id, {}).values()):
            send(frame)

    def subscriber_count(self, session_id: str) -> int:
        return len(self._subscribers.get(session_id, {}))

    def refusal(self, key: ConnectionKey, tenant_cap: int, client_cap: int) -> str | None:
        """Why a new socket of ``key`` would be refused now (closed with 1013), or None. Counts nothing."""
        if self._tenant_connections.get(key.tenant_id, 0) >= tenant_cap:
            return f"too many connections for this tenant (limit {tenant_cap})"
        if self._client_connections.get(key, 0) >= client_cap:
            return f"too many connections for this client (limit {client_cap})"
        return None

    def try_connect(self, key: ConnectionKey, tenant_cap: int, client_cap: int) -> str | None:
        """Count a new socket, or return why it is refused (the caller closes it with 1013)."""
        refused = self.refusal(key, tenant_cap, client_cap)
        if refused is None:
            self._tenant_connections[key.tenant_id] += 1
            self._client_connections[key] += 1
        return refused

    def disconnect(self, key: ConnectionKey) -> None:
        self._tenant_connections[key.tenant_id] = max(0, self._tenant_connections[key.tenant_id] - 1)
        left = self._client_connections.pop(key, 0) - 1
        if left > 0:
            self._client_connections[key] = left  # NOTE: zero counts are dropped, so the map holds live clients only

    def connections(self, tenant_id: str) -> int:
        return self._tenant_connections[tenant_id]
