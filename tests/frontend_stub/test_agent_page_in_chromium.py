"""``/agent`` and ``/chat`` side by side in a real browser (system Chromium, headless) against a real ``kvchat serve``
(issue 41): hand-off, claim, two messages each way, typing both ways, hand back, resolve; no console errors and no
request leaving 127.0.0.1. The chat page reconnects after a server restart (1012), resuming with ``last_seq``. The
dashboard shows the waiting queue.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect, sync_playwright
from websockets.sync.client import connect

from support.browser import LAUNCH_ARGS, chromium_path, screenshot_path
from support.server import ADMIN_KEY, CHAT_TOKEN
from support.server_process import ServerProcess, start_server_process, tiny_server_env

pytestmark = pytest.mark.postgres
TIMEOUT_MS = 30_000


@pytest.fixture
def server_env(pg_url: str, tiny_model_dir: Path, tmp_path: Path) -> dict[str, str]:
    return tiny_server_env(pg_url, tiny_model_dir, tmp_path, reply_max_tokens=8, run_migrations_on_start="false")


@pytest.fixture
def server(server_env: dict[str, str], tmp_path: Path) -> Iterator[ServerProcess]:
    proc = start_server_process(server_env, tmp_path / "server.log")
    try:
        yield proc
    finally:
        proc.kill()


class Watched:
    """The browser's pages, with what they logged as errors and every host they asked."""

    def __init__(self, browser: Browser) -> None:
        self.browser = browser
        self.errors: list[str] = []
        self.hosts: set[str] = set()

    def page(self, width: int = 900, height: int = 800) -> Page:
        page = self.browser.new_context(viewport={"width": width, "height": height}).new_page()
        page.on("pageerror", lambda err: self.errors.append(str(err)))
        page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)
        page.on("request", lambda request: self.hosts.add(urlsplit(request.url).hostname or request.url))
        return page


@pytest.fixture
def watched(server: ServerProcess) -> Iterator[Watched]:
    # NOTE: after ``server`` (and so after the database fixtures): Playwright's sync API keeps an event loop running
    # in this thread until it stops, and the database fixtures use asyncio.run().
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=LAUNCH_ARGS)
        seen = Watched(browser)
        yield seen
        browser.close()


def _agent_key(server: ServerProcess, name: str) -> str:
    created = httpx.post(f"{server.http}/admin/tenant/agents", headers={"X-API-Key": ADMIN_KEY}, json={"name": name})
    assert created.status_code == 201, created.text
    key: str = created.json()["key"]
    return key


def _say(chat: Page, text: str) -> None:
    chat.fill("#text", text)
    chat.press("#text", "Enter")


def _reply(agent: Page, text: str) -> None:
    agent.fill("#reply #text", text)
    agent.press("#reply #text", "Enter")


def test_an_agent_and_a_customer_talk_side_by_side(server: ServerProcess, watched: Watched) -> None:
    key = _agent_key(server, "Dana")
    agent, chat = watched.page(), watched.page(width=390, height=800)  # the customer is on a phone
    agent.goto(f"{server.http}/agent")
    agent.fill("#key", key)
    agent.keyboard.press("Enter")  # keyboard only
    expect(agent.locator("#state")).to_have_text("connected as Dana", timeout=TIMEOUT_MS)

    chat.goto(f"{server.http}/chat")
    chat.fill("#token", CHAT_TOKEN)
    chat.click("#connect")
    expect(chat.locator("#text")).to_be_enabled(timeout=TIMEOUT_MS)
    _say(chat, "I want to talk to a real person")
    expect(chat.locator("#log")).to_contain_text("You are number 1 in the queue", timeout=TIMEOUT_MS)
    expect(chat.locator("#cancel")).to_be_disabled()  # no bot reply is coming: nothing to stop

    entry = agent.locator(".entry").first
    expect(entry).to_contain_text("I want to talk to a real person", timeout=TIMEOUT_MS)
    entry.focus()
    agent.keyboard.press("Enter")
    agent.click("#claim")
    expect(chat.locator("#log")).to_contain_text("Dana joined the chat.", timeout=TIMEOUT_MS)
    expect(agent.locator("#title")).to_contain_text("you hold it", timeout=TIMEOUT_MS)

    agent.fill("#reply #text", "Hi, Dana")  # typing reaches the customer
    expect(chat.locator("#typing")).to_have_text("Dana is typing…", timeout=TIMEOUT_MS)
    _reply(agent, "Hi, this is Dana. How can I help?")
    _reply(agent, "<b>Your order</b> is on its way.")
    expect(chat.locator(".msg.agent")).to_have_count(2, timeout=TIMEOUT_MS)
    expect(chat.locator(".msg.agent").last).to_contain_text("<b>Your order</b> is on its way.")  # text, not HTML

    chat.fill("#text", "Thanks")  # and the customer's typing reaches the agent
    expect(agent.locator("#typing")).to_have_text("The customer is typing…", timeout=TIMEOUT_MS)
    chat.press("#text", "Enter")
    _say(chat, "When will it arrive?")
    expect(agent.locator("#log .msg.user")).to_have_count(3, timeout=TIMEOUT_MS)
    expect(agent.locator("#log .msg.user").last).to_have_text("When will it arrive?")
    expect(chat.locator(".msg.assistant")).to_have_count(0)  # while Dana holds it, the bot sends nothing

    agent.click("#handback")
    expect(chat.locator("#log")).to_contain_text("Dana handed you back to the assistant.", timeout=TIMEOUT_MS)
    _say(chat, "Can I change the address?")
    expect(chat.locator(".msg.assistant")).to_have_count(1, timeout=TIMEOUT_MS)  # the bot answers again
    expect(chat.locator(".meta").last).to_contain_text("cached", timeout=TIMEOUT_MS)

    _say(chat, "I want to talk to a real person again")
    expect(agent.locator(".entry").first).to_contain_text("again", timeout=TIMEOUT_MS)
    agent.locator(".entry").first.click()
    agent.click("#claim")
    expect(agent.locator("#resolve")).to_be_enabled(timeout=TIMEOUT_MS)
    agent.click("#resolve")
    expect(chat.locator("#log")).to_contain_text("Dana marked this resolved.", timeout=TIMEOUT_MS)
    expect(agent.locator(".entry")).to_have_count(0, timeout=TIMEOUT_MS)
    agent.screenshot(path=screenshot_path("agent"), full_page=True)
    chat.screenshot(path=screenshot_path("chat-with-agent"), full_page=True)
    assert watched.errors == []
    assert watched.hosts == {"127.0.0.1"}  # nothing from a CDN, nothing anywhere else
    assert key not in agent.content()  # the key stays in the page's memory


def test_the_agent_page_fits_a_phone(server: ServerProcess, watched: Watched) -> None:
    page = watched.page(width=390, height=800)
    page.goto(f"{server.http}/agent")
    wider = page.evaluate(
        """() => [...document.querySelectorAll("body *")]
        .filter((el) => el.getBoundingClientRect().right > window.innerWidth + 1).map((el) => el.id || el.tagName)"""
    )
    assert wider == []
    assert watched.errors == []


def test_the_chat_page_reconnects_after_a_restart_and_resumes(
    server: ServerProcess, watched: Watched, server_env: dict[str, str], tmp_path: Path
) -> None:
    chat = watched.page()
    chat.goto(f"{server.http}/chat")
    chat.fill("#token", CHAT_TOKEN)
    chat.click("#connect")
    expect(chat.locator("#text")).to_be_enabled(timeout=TIMEOUT_MS)
    _say(chat, "Where is my parcel?")
    expect(chat.locator(".msg.assistant")).to_have_count(1, timeout=TIMEOUT_MS)
    assert server.terminate() in (0, -signal.SIGTERM)  # SIGTERM: the server closes the socket with 1012
    expect(chat.locator("#log")).to_contain_text("The server is restarting; reconnecting…", timeout=TIMEOUT_MS)
    expect(chat.locator("#text")).to_be_disabled()
    again = start_server_process(server_env, tmp_path / "server-again.log", port=server.port)
    try:
        expect(chat.locator("#log")).to_contain_text("Reconnected.", timeout=TIMEOUT_MS)
        expect(chat.locator("#text")).to_be_enabled()
        expect(chat.locator(".msg")).to_have_count(2)  # resumed from last_seq: nothing shown twice
        _say(chat, "Thanks, and can I change the address?")
        expect(chat.locator(".msg.assistant")).to_have_count(2, timeout=TIMEOUT_MS)
    finally:
        again.kill()
    assert [e for e in watched.errors if "WebSocket" not in e] == []  # (Chromium logs the refused reconnects)


def test_the_dashboard_shows_the_waiting_queue(server: ServerProcess, watched: Watched) -> None:
    with connect(server.ws, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id = json.loads(ws.recv(timeout=30))["session_id"]
        ws.send(json.dumps({"type": "user.message", "client_msg_id": "h", "text": "I want to talk to a real person"}))
        while json.loads(ws.recv(timeout=30))["type"] != "session.queue":
            pass
    page = watched.page(width=1366, height=768)
    page.goto(f"{server.http}/dashboard")
    page.fill("#key", ADMIN_KEY)
    page.click("#connect")
    expect(page.locator("#f-inbox")).to_contain_text("1 waiting · 0 with a person", timeout=TIMEOUT_MS)
    expect(page.locator("#f-first-reply")).to_contain_text("first human reply p50 – · p95 –")
    expect(page.locator("#inbox-queue li")).to_have_count(1)
    expect(page.locator(f'#inbox-queue li[data-session="{session_id}"]')).to_contain_text("real person")
    assert page.evaluate("document.querySelectorAll('.chart canvas').length") == 8
    assert watched.errors == []
