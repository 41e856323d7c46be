"""Who listens to which session: every open socket subscribes to its session's frames; counts sockets per tenant.

A turn publishes its frames to the session, not to the socket that asked, so a customer who reconnects (or opens the
chat twice) sees the reply continue in every open window.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

from backend.chat.protocol import ServerFrame

Send = Callable[[ServerFrame], None]


class SessionHub:
    def __init__(self) -> None:
        self._subscribers: dict[str, dict[int, Send]] = defaultdict(dict)
        self._tenant_connections: dict[str, int] = defaultdict(int)
        self._next_token = 0

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

    def try_connect(self, tenant_id: str, cap: int) -> bool:
        if self._tenant_connections[tenant_id] >= cap:
            return False
        self._tenant_connections[tenant_id] += 1
        return True

    def disconnect(self, tenant_id: str) -> None:
        self._tenant_connections[tenant_id] = max(0, self._tenant_connections[tenant_id] - 1)

    def connections(self, tenant_id: str) -> int:
        return self._tenant_connections[tenant_id]
