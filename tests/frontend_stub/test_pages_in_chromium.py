"""The dashboard and the chat page in a real browser (system Chromium, headless) against a real server process.

Each test starts ``kvchat serve`` (tiny model, Postgres), drives the page with Playwright and saves a screenshot under
``test-artifacts/screenshots/``.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright
from playwright.sync_api import TimeoutError as PlaywrightTimeoutError
from prometheus_client.parser import text_string_to_metric_families
from websockets.sync.client import connect

from support.browser import LAUNCH_ARGS, chromium_path, screenshot_path
from support.server import ADMIN_KEY, CHAT_TOKEN
from support.server_process import ServerProcess, start_server_process, tiny_server_env

pytestmark = pytest.mark.postgres
TIMEOUT_MS = 30_000
ORDER = "My parcel is late. Order #4061234567 was due on Monday, where is it?"
# unrelated, and it names an account number the bot did not ask for: a topic shift (backend/context/topic.py)
PASSWORD = "I also cannot log in. How do I reset the password for account 77120934?"
WIDER_THAN_THE_SCREEN = """() => [...document.querySelectorAll("body *")]
    .filter((el) => el.getBoundingClientRect().right > window.innerWidth + 1)
    .map((el) => `${el.tagName}#${el.id}.${el.className} ${Math.round(el.getBoundingClientRect().right)}`)"""
SESSIONS_REFRESH_S = 5.0  # the dashboard's SESSIONS_MS


@pytest.fixture
def server(pg_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    env = tiny_server_env(pg_url, tiny_model_dir, tmp_path, reply_max_tokens=12, run_migrations_on_start="false")
    proc = start_server_process(env, tmp_path / "server.log")
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def page(server: ServerProcess) -> Iterator[Page]:
    # NOTE: after ``server`` (and so after the database fixtures): Playwright's sync API keeps an event loop running
    # in this thread until it stops, and the database fixtures use asyncio.run().
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=LAUNCH_ARGS)
        context = browser.new_context(viewport={"width": 1366, "height": 768})  # a laptop screen
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        yield page
        browser.close()
    assert errors == [], "the page's scripts threw (or left a promise rejected)"


def _chat_turn(server: ServerProcess, *texts: str) -> str:
    """One session, one websocket turn to completion per text; returns the session id."""
    with connect(server.ws, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN}))
        session_id: str = json.loads(ws.recv(timeout=30))["session_id"]
        for i, text in enumerate(texts):
            ws.send(json.dumps({"type": "user.message", "client_msg_id": f"m{i}", "text": text}))
            while json.loads(ws.recv(timeout=30))["type"] != "message.completed":
                pass
    return session_id


def _admin_get(server: ServerProcess, path: str) -> Any:
    resp = httpx.get(f"{server.http}{path}", headers={"X-API-Key": ADMIN_KEY})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _cached_kv_bytes(server: ServerProcess) -> float:
    """The engine's published (reusable) KV bytes, from ``/metrics`` (the test is a local client: no token)."""
    families = text_string_to_metric_families(httpx.get(f"{server.http}/metrics").text)
    family = next(f for f in families if f.name == "kvchat:kv_cache_bytes")
    return next(s.value for s in family.samples if s.labels == {"tier": "memory", "state": "cached"})


def _screenshot(page: Page, name: str) -> None:
    """A full-page screenshot from the top (scrolled, the sticky header would land mid-page)."""
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=screenshot_path(name), full_page=True)


def _connect_dashboard(page: Page, server: ServerProcess) -> None:
    page.goto(f"{server.http}/dashboard")
    page.fill("#key", ADMIN_KEY)
    page.click("#connect")
    expect(page.locator("#state")).to_have_class("ok", timeout=TIMEOUT_MS)


def test_dashboard_shows_live_figures_after_a_scripted_chat(server: ServerProcess, page: Page) -> None:
    session_id = _chat_turn(server, "Where is my order #123-4567?")
    _chat_turn(server, "Where is my order #123-4567?")  # the same prompt again: its system prompt is a cache hit
    _connect_dashboard(page, server)
    expect(page.locator("#f-hit")).to_contain_text("%", timeout=TIMEOUT_MS)
    hit = float(page.inner_text("#f-hit").split()[0])
    assert hit > 0, "the second turn reused the first one's cached prompt"
    assert float(page.inner_text("#f-tps")) > 0
    expect(page.locator("#f-ttft")).to_contain_text("ms")
    expect(page.locator("#f-sessions")).to_have_text("2")
    expect(page.locator(f'tr[data-session="{session_id}"]')).to_contain_text("bot_active")
    assert page.evaluate("document.querySelectorAll('.chart canvas').length") == 8  # every chart drew
    expect(page.locator("#f-context")).to_contain_text("0 shifts")  # two one-turn sessions: no shift
    # the charts: each scaled to its own data (the KV chart not to the pool's size), with the newest values in the
    # legends (never uPlot's "--"), and the topic-shift line drawn apart from the invalidations line
    page.wait_for_function("charts.kv.plot.data[0].length >= 2", timeout=TIMEOUT_MS)
    kv_top, kv_data_top, capacity_mib = page.evaluate(
        """() => [charts.kv.plot.scales.y.max,
                  Math.max(...charts.kv.plot.data.slice(1).flat().filter((v) => v != null)),
                  Number(document.querySelector("#f-kv").textContent.match(/of ([0-9.]+)/)[1])]"""
    )
    assert 0 < kv_top <= max(kv_data_top * 1.15, 1) + 1e-9 and kv_top < capacity_mib
    legends = page.evaluate("[...document.querySelectorAll('.u-legend .u-series .u-value')].map((e) => e.textContent)")
    assert legends and "--" not in legends
    memory_legend = page.evaluate("charts.kv.plot.root.querySelectorAll('.u-legend .u-series')[1].textContent")
    assert re.fullmatch(r"memory MiB\d+\.\d\d", memory_legend.strip()), memory_legend
    lines = page.evaluate(
        """() => charts.context.plot.series.slice(1).map(({ label, dash, points }, i) =>
            ({ label, dash: dash ?? null, points: Boolean(points.show(charts.context.plot, i + 1)) }))"""
    )
    assert lines == [
        {"label": "invalidations", "dash": None, "points": False},
        {"label": "topic shifts", "dash": [6, 3], "points": True},
    ]
    # the key stays in the page's memory: nothing stored, nothing in the page
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0
    assert page.evaluate("document.cookie") == ""
    assert ADMIN_KEY not in page.content()
    _screenshot(page, "dashboard")


def test_the_close_button_closes_that_session(server: ServerProcess, page: Page) -> None:
    session_id = _chat_turn(server, "Can I return a jacket?")
    _connect_dashboard(page, server)
    row = page.locator(f'tr[data-session="{session_id}"]')
    row.locator('button[data-action="close"]').click()
    expect(row).to_contain_text("closed", timeout=TIMEOUT_MS)
    resp = httpx.get(f"{server.http}/admin/sessions/{session_id}", headers={"X-API-Key": ADMIN_KEY})
    assert resp.json()["status"] == "closed"
    row.locator("td.id").click()
    expect(page.locator("#transcript")).to_contain_text("Can I return a jacket?")
    _screenshot(page, "dashboard-session")


def test_the_drill_down_colours_blocks_and_draws_the_temperature_curve(server: ServerProcess, page: Page) -> None:
    handbook = "# Shipping and delivery\nLate parcels: give the tracking number.\n# Account and password\nReset it."
    loaded = httpx.put(
        f"{server.http}/admin/tenant/handbook",
        headers={"X-API-Key": ADMIN_KEY},
        json={"format": "markdown", "content": handbook},
        timeout=60,
    )
    assert loaded.status_code == 200, loaded.text
    session_id = _chat_turn(server, ORDER, PASSWORD)
    history = _admin_get(server, f"/admin/sessions/{session_id}/detail")["temperature_history"]
    assert [(h["seq"], h["shift"], h["epoch"]) for h in history] == [(1, False, 0), (3, True, 1)]
    _connect_dashboard(page, server)
    row = page.locator(f'tr[data-session="{session_id}"]')
    expect(row.locator("td.temp")).to_have_text("0.30", timeout=TIMEOUT_MS)  # the shift's temperature
    expect(row.locator("td.epoch")).to_have_text("1")
    expect(row.locator("td.footprint")).to_contain_text("block", timeout=TIMEOUT_MS)
    expect(page.locator("#f-context")).to_contain_text("1 shift · 1 invalidation", timeout=TIMEOUT_MS)
    row.locator("td.id").click()

    order = page.locator('#transcript .msg[data-seq="1"] [data-block-type="identifier"]')
    expect(order).to_contain_text("#4061234567", timeout=TIMEOUT_MS)
    colour = order.evaluate("el => getComputedStyle(el).backgroundColor")
    plain = page.locator('#transcript .msg[data-seq="1"] [data-block-type="context"]')
    expect(plain).to_have_text("My parcel is late.")
    assert colour != plain.evaluate("el => getComputedStyle(el).backgroundColor")  # coloured by type
    expect(page.locator('#transcript .msg[data-seq="3"] [data-block-type="identifier"]')).to_contain_text("77120934")
    expect(page.locator('#legend [data-legend-type="identifier"]')).to_be_visible()
    expect(page.locator("#temp-chart canvas")).to_be_visible()
    expect(page.locator("#temp-chart")).to_contain_text("shift")  # the shift series in the curve's legend
    expect(page.locator('#invalidations tr[data-reason="epoch_dropped"]')).to_have_count(1)
    expect(page.locator("#detail-summary")).to_contain_text("epoch 1")
    expect(page.locator("#detail-summary")).to_contain_text("handbook Account and password")  # the topic's section
    _screenshot(page, "dashboard-drill-down")

    page.set_viewport_size({"width": 390, "height": 844})  # a phone: one column, nothing wider than the screen
    expect(page.locator("#temp-chart canvas")).to_be_visible()
    with contextlib.suppress(PlaywrightTimeoutError):  # the charts follow the new width on their next resize
        page.wait_for_function(f"({WIDER_THAN_THE_SCREEN})().length === 0", timeout=5_000)
    wide = page.evaluate(WIDER_THAN_THE_SCREEN)
    assert wide == [], "\n".join(wide)
    _screenshot(page, "dashboard-narrow")


def test_the_flush_button_flushes_that_session(server: ServerProcess, page: Page) -> None:
    session_id = _chat_turn(server, ORDER, PASSWORD)
    detail_path = f"/admin/sessions/{session_id}/detail"
    before = _admin_get(server, detail_path)["cache_footprint"]
    assert before["blocks"] > 0
    cached_before = _cached_kv_bytes(server)
    _connect_dashboard(page, server)
    row = page.locator(f'tr[data-session="{session_id}"]')
    expect(row.locator("td.footprint")).to_have_text(f"{before['blocks']} blocks", timeout=TIMEOUT_MS)
    row.locator('button[data-action="flush"]').click()
    expect(row.locator(".flush-result")).to_contain_text("freed", timeout=TIMEOUT_MS)
    found = re.search(r"freed (\d+) blocks? \((\d+) tokens\)", row.locator(".flush-result").inner_text())
    assert found, row.inner_text()
    blocks_freed, tokens_freed = int(found[1]), int(found[2])
    assert blocks_freed == before["blocks"] > 0

    # through the admin API: the session stays, its footprint is gone, the flush is recorded
    after = _admin_get(server, detail_path)
    assert after["session"]["status"] == "bot_active"
    assert after["cache_footprint"] == {"blocks": 0, "tokens": 0}
    flushes = [e for e in after["invalidation_events"] if e["reason"] == "admin_flush"]
    assert [(e["blocks_freed"], e["tokens_freed"]) for e in flushes] == [(blocks_freed, tokens_freed)]
    # through the engine's stats: its published KV shrank
    assert _cached_kv_bytes(server) < cached_before
    expect(row.locator("td.footprint")).to_have_text("0 blocks", timeout=TIMEOUT_MS)
    _screenshot(page, "dashboard-flush")


def test_each_refresh_reads_every_sessions_footprint_in_one_call(server: ServerProcess, page: Page) -> None:
    sessions = [_chat_turn(server, ORDER) for _ in range(3)]
    paths: list[str] = []
    page.on("request", lambda request: paths.append(urlsplit(request.url).path))
    _connect_dashboard(page, server)
    for session_id in sessions:
        expect(page.locator(f'tr[data-session="{session_id}"] td.footprint')).to_contain_text("block")
    deadline = time.monotonic() + 6 * SESSIONS_REFRESH_S  # (a liveness bound, not a timing claim)
    while paths.count("/admin/sessions/summary") < 2:  # the first refresh and the next one
        assert time.monotonic() < deadline, paths
        page.wait_for_timeout(200)
    # one sessions call a refresh, whatever the number of sessions; the stats and inbox polls beside it; nothing per
    # session
    assert {p for p in paths if p.startswith("/admin/")} == {"/admin/sessions/summary", "/admin/stats", "/admin/inbox"}


def test_dashboard_says_clearly_when_the_server_is_down(server: ServerProcess, page: Page) -> None:
    _connect_dashboard(page, server)
    server.kill()
    expect(page.locator("#banner")).to_be_visible(timeout=TIMEOUT_MS)
    expect(page.locator("#banner")).to_contain_text("not answering")
    expect(page.locator("#state")).to_have_text("server unreachable")
    _screenshot(page, "dashboard-down")


def test_a_wrong_admin_key_is_refused_on_the_page(server: ServerProcess, page: Page) -> None:
    page.goto(f"{server.http}/dashboard")
    page.fill("#key", "not-a-key")
    page.click("#connect")
    expect(page.locator("#state")).to_have_text("the admin key was refused", timeout=TIMEOUT_MS)
    assert ADMIN_KEY not in page.content()  # the page never carries a key of its own


def test_chat_page_completes_a_turn(server: ServerProcess, page: Page) -> None:
    page.goto(f"{server.http}/chat")
    page.fill("#token", CHAT_TOKEN)
    page.click("#connect")
    expect(page.locator("#text")).to_be_enabled(timeout=TIMEOUT_MS)
    page.fill("#text", "Hello, is my parcel on its way?")
    page.click("#send")
    expect(page.locator(".msg.assistant")).to_have_count(1, timeout=TIMEOUT_MS)
    expect(page.locator(".meta").last).to_contain_text("cached", timeout=TIMEOUT_MS)
    _screenshot(page, "chat")


def test_chat_page_keeps_the_token_out_of_sight_and_logs_no_error(server: ServerProcess, page: Page) -> None:
    console_errors: list[str] = []
    page.on("console", lambda msg: console_errors.append(msg.text) if msg.type == "error" else None)
    page.goto(f"{server.http}/chat")
    assert page.get_attribute("#token", "type") == "password"
    page.fill("#token", CHAT_TOKEN)
    page.click("#connect")
    expect(page.locator("#text")).to_be_enabled(timeout=TIMEOUT_MS)
    # the token is the tenant's OpenAI API key: this tab's sessionStorage only, never localStorage or the page's text
    assert page.evaluate("sessionStorage.getItem('kvchat.token')") == CHAT_TOKEN
    assert page.evaluate("localStorage.getItem('kvchat.token')") is None
    assert CHAT_TOKEN not in page.inner_text("body")
    page.reload()
    assert page.input_value("#token") == CHAT_TOKEN  # a reload of the tab keeps it
    icon = httpx.get(f"{server.http}/favicon.ico")
    assert (icon.status_code, icon.headers["content-type"]) == (200, "image/svg+xml")
    assert console_errors == []
