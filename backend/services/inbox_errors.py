"""The human-agent layer's errors (agents, the inbox, agents' replies), mapped by the HTTP boundary like every
``BackendError`` (its status and code; ``detail`` is the message):

    BackendError (backend/core/errors.py)
    ├── AgentNotFoundError       agent_not_found      404
    ├── AgentExistsError         agent_exists         409
    ├── AgentKeyKindError        agent_key_kind       422  (an agent's key is rotated per agent, not per kind)
    ├── NotWaitingError          not_waiting          409  (claim / transfer of a session no person is asked for)
    ├── ClaimedByOtherError      claimed_by_other     409  (names the holder)
    └── NotClaimedError          not_claimed          409  (a reply, release, hand-back or resolve without the claim)

A reply to a closed session is ``SessionClosedError`` (409), to another tenant's ``SessionNotFoundError`` (404).

NOTE: its own module, so the agent layer's errors stay next to it and the shared ``errors.py`` is not edited by every
branch.
"""

from __future__ import annotations

from backend.core.errors import BackendError


class AgentNotFoundError(BackendError):
    code = "agent_not_found"
    status = 404


class AgentExistsError(BackendError):
    code = "agent_exists"
    status = 409


class AgentKeyKindError(BackendError):
    code = "agent_key_kind"
    status = 422


class NotWaitingError(BackendError):
    code = "not_waiting"
    status = 409


class ClaimedByOtherError(BackendError):
    code = "claimed_by_other"
    status = 409

    def __init__(self, holder_name: str) -> None:
        self.holder_name = holder_name
        super().__init__(f"this session is claimed by {holder_name}")


class NotClaimedError(BackendError):
    code = "not_claimed"
    status = 409
