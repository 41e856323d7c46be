"""API keys: generation and hashing. Only the sha256 of a key is ever stored."""

from __future__ import annotations

import hashlib
import secrets

from backend.domain import KeyKind

_PREFIX = {KeyKind.CHAT: "kvc_chat_", KeyKind.ADMIN: "kvc_admin_", KeyKind.AGENT: "kvc_agent_"}


def generate_key(kind: KeyKind) -> str:
    return _PREFIX[kind] + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def display_prefix(key: str) -> str:
    """What an operator sees of a key in listings: enough to tell keys apart, useless to an attacker."""
    return key[:12]
