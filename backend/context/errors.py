"""Errors of the context layer, each with a stable ``code`` that the boundary (admin API) maps to a status.

ContextError                 code
├── InvalidRuleError         invalid_rule      a splitter rule does not compile or can match the empty string
│   └── RuleLimitError       rule_limit        the tenant's rules would pass a cap (their number, their size)
├── UnknownBackendError      unknown_backend   a topic scorer (or similarity backend) name that is not registered
├── BackendUnavailableError  backend_unavailable  the backend's package (the embedding model) is not installed
├── InvalidSettingsError     invalid_settings  topic thresholds out of range, or a shift model that does not fit
└── HandbookError            invalid_handbook  a handbook that does not parse (Markdown, ABCD-style JSON)
    └── HandbookLimitError   handbook_limit    a handbook past a cap (sections, a section's size, the total)
"""

from __future__ import annotations


class ContextError(Exception):
    code = "context_error"


class InvalidRuleError(ContextError):
    """A rule was refused; ``rule`` names it and ``reason`` says why (shown to the admin who wrote it)."""

    code = "invalid_rule"

    def __init__(self, rule: str, reason: str) -> None:
        super().__init__(f"rule {rule!r} refused: {reason}")
        self.rule = rule
        self.reason = reason


class RuleLimitError(InvalidRuleError):
    """A rule that compiles, refused because the tenant's rules would pass a cap."""

    code = "rule_limit"


class UnknownBackendError(ContextError):
    code = "unknown_backend"


class BackendUnavailableError(ContextError):
    code = "backend_unavailable"


class InvalidSettingsError(ContextError):
    code = "invalid_settings"


class HandbookError(ContextError):
    """A handbook was refused; the message says where (the section, the line or the JSON key) and why."""

    code = "invalid_handbook"


class HandbookLimitError(HandbookError):
    code = "handbook_limit"
