"""``kvchat chat`` goes where ``kvchat serve`` listens: it follows KVCHAT_HOST / KVCHAT_PORT."""

from __future__ import annotations

import argparse

import pytest

from backend.chat.client import add_arguments


@pytest.mark.parametrize(
    ("env", "url"),
    [
        ({}, "ws://127.0.0.1:8000/ws/chat"),
        ({"KVCHAT_PORT": "9123"}, "ws://127.0.0.1:9123/ws/chat"),
        ({"KVCHAT_HOST": "10.1.2.3", "KVCHAT_PORT": "8080"}, "ws://10.1.2.3:8080/ws/chat"),
        ({"KVCHAT_HOST": "0.0.0.0"}, "ws://127.0.0.1:8000/ws/chat"),
        ({"KVCHAT_HOST": "::1"}, "ws://[::1]:8000/ws/chat"),
        ({"KVCHAT_URL": "wss://chat.example/ws/chat", "KVCHAT_PORT": "1"}, "wss://chat.example/ws/chat"),
    ],
)
def test_default_url_follows_the_server_settings(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], url: str
) -> None:
    for name in ("KVCHAT_URL", "KVCHAT_HOST", "KVCHAT_PORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args([]).url == url
    assert "KVCHAT_PORT" in parser.format_help()
