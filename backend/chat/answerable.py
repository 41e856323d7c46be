"""Whether a customer message can ever be answered: with the tenant's system prompt and a reply it must fit the
model's budget. Checked before anything is stored, so a message refused here leaves no trace.

NOTE: cheap for almost every message. A bound from the message's length alone settles it both ways without
tokenizing it: below, the token floor (``EngineClient.prompt_token_floor``) already exceeds the budget; above, the
system prompt's own count (tokenized once per system prompt and process, with an empty message) plus one token per
byte of the message, plus ``EDGE_SLACK``, still fits. Byte-level BPE and byte-fallback tokenizers spend at most one
token per byte of text; where the message meets the template, merges move the template's own count by a token or
two, hence the slack. Only a message between the two bounds (thousands of bytes) is tokenized, in a worker thread,
and compared exactly.
"""

from __future__ import annotations

from backend.chat.prompt import ChatMessage
from backend.core.errors import MessageTooLongError
from backend.core.offload import run_cpu
from backend.domain import MessageRole
from backend.engine_client.protocol import EngineClient

EDGE_SLACK = 16
_KEPT = 256  # system prompts whose count is kept (a few per tenant; cleared when full)


class Answerable:
    """The check, with the token counts of the system prompts it has seen."""

    def __init__(self, engine: EngineClient) -> None:
        self._engine = engine
        self._base: dict[str, int] = {}  # system prompt -> tokens with an empty customer message

    async def check(self, tenant_id: str, system_prompt: str, text: str, budget: int) -> None:
        """Raise ``MessageTooLongError`` when ``text`` with ``system_prompt`` and a reply exceeds ``budget`` tokens."""
        floor = self._engine.prompt_token_floor([system_prompt, text] if system_prompt else [text])
        if floor > budget:  # NOTE: too long by its length alone: no need to spend the CPU on tokenizing it
            raise MessageTooLongError(floor, budget, at_least=True)
        base = self._base.get(system_prompt)
        if base is None:
            base = len(await run_cpu(tenant_id, self._engine.tokenize, _messages(system_prompt, "")))
            if len(self._base) >= _KEPT:
                self._base.clear()
            self._base[system_prompt] = base
        if base + len(text.encode()) + EDGE_SLACK <= budget:
            return
        tokens = len(await run_cpu(tenant_id, self._engine.tokenize, _messages(system_prompt, text)))
        if tokens > budget:
            raise MessageTooLongError(tokens, budget)


def _messages(system_prompt: str, text: str) -> list[ChatMessage]:
    system: list[ChatMessage] = [{"role": MessageRole.SYSTEM.value, "content": system_prompt}] if system_prompt else []
    return [*system, {"role": MessageRole.USER.value, "content": text}]
