"""Dialogue acts that a pattern can see in one sentence: a greeting, and a request for a human agent.

English and Chinese. The patterns are plain strings in the RE2 subset (no lookarounds, no backreferences) because
they are also splitter rules (``rules.DEFAULT_RULES``: block types ``greeting`` and ``handoff``), and the chat
service stops the bot on a hand-off request (``backend/chat/prompt.py``).

- ``GREETING``: a sentence that is only a greeting ("Hi!", "Good morning, team.", "您好！", "在吗？"); a greeting
  that opens a longer sentence does not make the sentence a greeting.
- ``HANDOFF``: the customer asks for a person ("talk to a human", "live agent", "转人工", "人工客服").
"""

from __future__ import annotations

import re

GREETING = (
    r"(?i)^\s*(?:(?:hi|hello|hey|hiya|hallo|greetings|namaste|good\s+(?:morning|afternoon|evening|day))"
    r"(?:\s*,?\s*(?:there|all|everyone|team|guys|sir|madam|support))?"
    r"|dear\s+(?:sir|madam|team|support|customer\s+(?:service|support|care))"
    r"|你好|您好|哈喽|嗨|在吗|在不在|早上好|下午好|晚上好)"
    r"\s*[.!,。！，~？?]*\s*$"
)
HANDOFF = (
    r"(?i)\b(?:human|real\s+person|live\s+(?:agent|person|chat)|representative|human\s+agent"
    r"|(?:speak|talk|chat)\s+(?:to|with)\s+(?:an?\s+)?(?:agent|person|someone|manager|supervisor))\b"
    r"|转人工|转接人工|人工客服|人工服务|真人客服|找人工|要人工|接人工"
)

_HANDOFF = re.compile(HANDOFF)


def asks_for_human(text: str) -> bool:
    """Whether the customer asks for a human agent (the bot then stops answering)."""
    return _HANDOFF.search(text) is not None
