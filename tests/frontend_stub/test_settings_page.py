"""The settings page (``/settings``) in a real browser (system Chromium) against a real ``kvchat serve`` (tiny model,
Postgres) and a real tool endpoint on loopback: every setting is changed on the page, the page is reloaded and shows
each one kept, and the audit trail on the page names every change and who made it (issue 45)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Page, expect, sync_playwright

from support.browser import LAUNCH_ARGS, chromium_path, screenshot_path
from support.server import ADMIN_KEY
from support.server_process import ServerProcess, start_server_process, tiny_server_env
from support.tool_endpoint import ORDER, ToolServer, tool_server

pytestmark = pytest.mark.postgres
TIMEOUT_MS = 30_000
HANDBOOK = (
    "## Returns\n\nReturn within 30 days.\n\nExamples:\n- can I send it back\n\n## Shipping\n\nWe ship in 2 days."
)


@pytest.fixture
def endpoint() -> Iterator[ToolServer]:
    with tool_server(slow_s=1.0) as server:
        yield server


@pytest.fixture
def server(pg_url: str, tiny_model_dir: Path, tmp_path: Path) -> Iterator[ServerProcess]:
    env = tiny_server_env(pg_url, tiny_model_dir, tmp_path, tools_allow_private_networks="true")
    proc = start_server_process(env, tmp_path / "server.log")
    try:
        yield proc
    finally:
        proc.kill()


@pytest.fixture
def page(server: ServerProcess) -> Iterator[Page]:
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium_path(), args=LAUNCH_ARGS)
        page = browser.new_context(viewport={"width": 1366, "height": 768}).new_page()
        errors: list[str] = []
        page.on("pageerror", lambda err: errors.append(str(err)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        yield page
        browser.close()
    assert errors == [], "the page's scripts threw, or the console has an error"


def _connect(page: Page, server: ServerProcess) -> None:
    page.goto(f"{server.http}/settings")
    page.fill("#key", ADMIN_KEY)
    page.click("#connect")
    expect(page.locator("#state")).to_have_text("connected", timeout=TIMEOUT_MS)


def _save(page: Page, button: str, result: str, says: str = "saved") -> None:
    page.click(button)
    expect(page.locator(result)).to_contain_text(says, timeout=TIMEOUT_MS)
    expect(page.locator(result)).not_to_have_class("result failed")


def test_every_setting_changed_on_the_page_is_kept_and_audited(
    server: ServerProcess, page: Page, endpoint: ToolServer
) -> None:
    _connect(page, server)
    page.fill("#system_prompt", "You are the Acme shop's helpful assistant.")
    _save(page, '[data-save="system_prompt"]', "#r-system_prompt")
    page.fill("#policy_text", "Refunds within 30 days.")
    _save(page, '[data-save="policy_text"]', "#r-policy_text")
    page.fill("#handbook", HANDBOOK)
    _save(page, "#save-handbook", "#r-handbook", "2 sections")
    for field, value in {"temperature": "0.7", "top_k": "40", "repetition_penalty": "1.1"}.items():
        page.fill(f"#{field}", value)
    page.fill("#stop", "END")
    page.select_option("#tool_use", "none")
    page.select_option("#repetition_penalty_scope", "reply")
    _save(page, "#save-reply", "#r-reply")
    page.select_option("#history_policy", "full")
    page.fill("#min_block_length", "3")
    page.fill("#shift_threshold", "0.4")
    _save(page, "#save-context", "#r-context")
    page.select_option("#cache_scope", "public")
    page.select_option("#replica_erase", "reset_cache")
    _save(page, "#save-cache", "#r-cache")
    expect(page.locator("#memory_ttl_s")).not_to_have_value("", timeout=TIMEOUT_MS)  # (this machine: no token needed)
    page.fill("#memory_ttl_s", "90")
    page.select_option("#eviction_policy", "weighted")
    _save(page, "#save-operator", "#r-operator")
    # a tool: added, tested (one real call, its answer shown), then disabled
    page.fill("#tool-name", "lookup_order")
    page.fill("#tool-url", endpoint.url("/order"))
    page.fill("#tool-secret-header", "X-Shop-Key")
    page.fill("#tool-secret", "s3cret")
    _save(page, "#add-tool", "#r-tools", "lookup_order added")
    row = page.locator('tr[data-tool="lookup_order"]')
    row.locator('[data-role="arguments"]').fill('{"order_id": "A1234"}')
    row.locator('[data-action="test"]').click()
    expect(row.locator('[data-role="answer"]')).to_have_text(f"ok: {json.dumps(ORDER)}", timeout=TIMEOUT_MS)
    assert [(r.path, r.body, r.headers["X-Shop-Key"]) for r in endpoint.received] == [
        ("/order", {"order_id": "A1234"}, "s3cret")
    ]
    row.locator('[data-action="enabled"]').uncheck()
    expect(page.locator("#r-tools")).to_have_text("lookup_order disabled", timeout=TIMEOUT_MS)
    # a splitter rule: added, then disabled
    page.fill("#rule-name", "order_no")
    page.fill("#rule-pattern", "#[0-9]{6,}")
    _save(page, "#add-rule", "#r-rules", "order_no added")
    page.locator('tr[data-rule="order_no"] [data-action="enabled"]').uncheck()
    expect(page.locator("#r-rules")).to_have_text("order_no disabled", timeout=TIMEOUT_MS)
    # a new chat token, shown once
    page.click('[data-rotate="chat"]')
    new_key = page.locator('[data-role="new-key"]')
    expect(new_key).to_contain_text("kvc_chat_", timeout=TIMEOUT_MS)
    chat_token = new_key.inner_text()
    new_row = page.locator("#key-rows tr").filter(has_text=chat_token[:12])
    expect(new_row).to_contain_text("active")
    new_row.locator('[data-action="revoke"]').click()  # and revoked again
    expect(page.locator("#r-keys")).to_contain_text("revoked", timeout=TIMEOUT_MS)
    page.screenshot(path=screenshot_path("settings"), full_page=True)

    page.reload()  # the key lived in the page's memory only: typed again
    assert page.evaluate("localStorage.length + sessionStorage.length") == 0
    _connect(page, server)
    assert page.input_value("#system_prompt") == "You are the Acme shop's helpful assistant."
    assert page.input_value("#policy_text") == "Refunds within 30 days."
    assert page.input_value("#handbook") == HANDBOOK
    assert [page.input_value(f"#{f}") for f in ("temperature", "top_k", "repetition_penalty", "stop")] == [
        "0.7",
        "40",
        "1.1",
        "END",
    ]
    assert page.input_value("#tool_use") == "none"
    assert page.input_value("#repetition_penalty_scope") == "reply"
    assert [page.input_value(f"#{f}") for f in ("history_policy", "min_block_length", "shift_threshold")] == [
        "full",
        "3",
        "0.4",
    ]
    assert [page.input_value("#cache_scope"), page.input_value("#replica_erase")] == ["public", "reset_cache"]
    expect(page.locator("#memory_ttl_s")).to_have_value("90", timeout=TIMEOUT_MS)
    assert page.input_value("#eviction_policy") == "weighted"
    assert not page.locator('tr[data-tool="lookup_order"] [data-action="enabled"]').is_checked()
    assert not page.locator('tr[data-rule="order_no"] [data-action="enabled"]').is_checked()
    revoked = page.locator("#key-rows tr").filter(has_text=chat_token[:12])
    assert revoked.count() == 1 and "active" not in revoked.inner_text()
    # the audit trail on the page: every change, by this admin key, ok
    audit = page.eval_on_selector_all(
        "#audit-rows tr", "(rows) => rows.map((r) => [...r.children].slice(1, 5).map((td) => td.textContent))"
    )
    actions = [
        (action, target) for actor, action, target, result in audit if actor == ADMIN_KEY[:12] and result == "ok"
    ]
    assert actions[0][1] and actions[2][1].isdigit()  # the key's id, the rule's id
    assert actions[::-1] == [
        ("tenant.system_prompt", ""),
        ("tenant.policy_text", ""),
        ("tenant.handbook", ""),
        ("tenant.reply_settings", ""),
        ("tenant.context_settings", ""),
        ("tenant.cache", ""),
        ("tool.create", ""),
        ("tool.call", "lookup_order"),
        ("tool.replace", "lookup_order"),
        ("rule.create", ""),
        ("rule.update", actions[2][1]),
        ("key.rotate", ""),
        ("key.revoke", actions[0][1]),
    ]
    operator = httpx.get(f"{server.http}/admin/cache/audit").json()
    assert [(a["actor"], a["action"], a["result"]) for a in operator] == [("operator", "cache.settings", "ok")]
