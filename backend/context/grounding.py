"""What a reply is grounded in: the texts a turn's reply may take contact details from (``ContactGuard``).

For a chat turn (``backend/chat/grounding.py`` builds it): the tenant's system prompt and policy text, the session's
pinned context, its customer messages and the tool results of the session (this turn's are added as they come).
For ``/v1`` (with the tenant's ``v1_contact_guard`` on): the tenant's system prompt and policy text and every message
of the request.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Grounding:
    texts: tuple[str, ...] = ()

    def with_texts(self, *texts: str) -> Grounding:
        return Grounding((*self.texts, *texts))
