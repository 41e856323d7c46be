"""``kvchat chat`` as a user runs it: a real subprocess talking to a real server; ``/quit`` and Ctrl-D end it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import select

from backend.db.models import Message
from engine.llm_engine import LLMEngine
from support.server import CHAT_TOKEN, db_session, server_settings, serving
from support.server_process import REPO_ROOT

pytestmark = pytest.mark.anyio


def _chat(*args: str, typed: str = "") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVCHAT_")}
    return subprocess.run(
        [sys.executable, "-m", "backend.cli", "chat", *args],
        cwd=REPO_ROOT,
        env=env,
        input=typed,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_help_says_how_to_quit() -> None:
    done = _chat("--help")
    assert done.returncode == 0
    assert "/quit, Ctrl-D or Ctrl-C at the prompt quits." in " ".join(done.stdout.split())


@pytest.mark.parametrize("ending", ["/quit\nnever sent\n", ""], ids=["quit", "ctrl-d"])
async def test_quit_or_end_of_input_ends_the_chat(
    sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine, ending: str
) -> None:
    settings = server_settings(sqlite_url, tmp_path, reply_max_tokens=4)
    with serving(settings, tiny_engine) as live:
        typed = "Where is my order?\n" + ending  # "" ends stdin there: what Ctrl-D does at the prompt
        done = await asyncio.to_thread(_chat, "--url", live.ws, "--token", CHAT_TOKEN, typed=typed)
        async with db_session(live) as db:
            users = (await db.execute(select(Message.content).where(Message.role == "user"))).scalars().all()
    assert done.returncode == 0, done.stderr
    assert list(users) == ["Where is my order?"]  # nothing typed after /quit was sent
    assert "/quit or Ctrl-D quits" in done.stderr.splitlines()[0]
    assert "Traceback" not in done.stderr


async def test_asking_for_a_person_prints_the_queue_and_no_empty_bot_line(
    sqlite_url: str, tmp_path: Path, tiny_engine: LLMEngine
) -> None:
    settings = server_settings(sqlite_url, tmp_path, reply_max_tokens=4)
    with serving(settings, tiny_engine) as live:
        typed = "I want to talk to a real person\n/quit\n"
        done = await asyncio.to_thread(_chat, "--url", live.ws, "--token", CHAT_TOKEN, typed=typed)
    assert done.returncode == 0, done.stderr
    assert "bot>" not in done.stdout  # no bot reply is coming: no empty "bot>" line
    assert "(session is now agent requested)" in done.stderr.splitlines()
    assert "(you are number 1 in the queue)" in done.stderr.splitlines()
