"""Step 7 of a customer message's path (``turn_path.py``): the turn's one worker-thread step before the engine.

The message observed (its topic, its blocks, its handbook section), the prompt built and tokenized with room for the
tools' calls and results when tools are offered (``ContextService.plan``), and what the reply may take contact details
from (``grounding.py``).

``ahead`` starts it as soon as step 2 has read the context, while the session is locked and the message stored: the
plan needs the context and the message's text, not its row, so the worker computes it beside the database's last
two round trips instead of after them. Step 2 drops it when the message is not stored as read, or when another turn
of the session is in flight (that turn's reply changes the context: the turn reads it again and plans then).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from backend.chat.grounding import turn_grounding
from backend.chat.reply_setup import ReplySetup
from backend.context.grounding import Grounding
from backend.core.offload import run_cpu
from backend.db.models import Message
from backend.services.context_service import ContextService, Plan, SessionContext

Planned = tuple[Plan, Grounding]
RESULT_RESERVE_TOKENS = 512  # prompt room a turn that offers tools keeps for the calls' results


class TurnPlanner:
    """Plans a turn (``plan``, in a worker thread), or starts its plan on the tenant's CPU queue (``ahead``)."""

    def __init__(self, context: ContextService, budget: Callable[[], int], reply_tokens: int) -> None:
        self._context = context
        self._budget = budget  # prompt tokens a turn may use: the engine's limit minus the reply
        self._reply_tokens = reply_tokens

    def plan(self, ctx: SessionContext, message: Message, setup: ReplySetup, observe: bool) -> Planned:
        """The plan answering ``message`` with the context ``ctx`` (which holds it). Runs in a worker thread."""
        budget, tools = self._budget(), tuple(t.spec() for t in setup.tools)
        if tools:  # NOTE: room for the calls and their results, without leaving the history nothing
            budget = max(budget // 2, budget - self._reply_tokens - RESULT_RESERVE_TOKENS)
        plan = self._context.plan(ctx, message, budget, tools, observe=observe)
        return plan, turn_grounding(plan.context)

    def ahead(self, tenant_id: str, ctx: SessionContext, message: Message, setup: ReplySetup) -> asyncio.Task[Planned]:
        """Start planning a new message on the tenant's CPU queue; the turn awaits the task (or ``drop`` it)."""
        task = asyncio.ensure_future(run_cpu(tenant_id, self.plan, ctx, message, setup, True))
        task.add_done_callback(_retrieved)
        return task


def drop(planned: asyncio.Future[Planned] | None) -> None:
    """Give up a plan started ahead: a job not started yet is dropped, one running finishes unread."""
    if planned is not None:
        planned.cancel()


def _retrieved(task: asyncio.Future[Planned]) -> None:
    """A plan nobody awaits (dropped after it failed) must not log 'exception never retrieved'; the turn that awaits
    it raises it."""
    if not task.cancelled():
        task.exception()
