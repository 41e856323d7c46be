"""The caps on a tenant's own splitter rules, through a real server on Postgres: their number
(``KVCHAT_MAX_RULES_PER_TENANT``) and their compiled size (``KVCHAT_MAX_RULES_PROGRAM_SIZE``); a refusal is a 422
``rule_limit`` naming the rule and the cap, and stores nothing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from backend.context.blocks import BlockType
from backend.context.rules import Rule, compile_rule
from engine.llm_engine import LLMEngine
from support.server import ADMIN_KEY, LiveServer, server_settings, serving

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

A = {"X-API-Key": ADMIN_KEY}
MAX_RULES = 3
MAX_SIZE = 200


def _size(pattern: str) -> int:
    return compile_rule(Rule("r", pattern, BlockType.CONTEXT, 0)).program_size


def _rule(name: str, pattern: str = "zx") -> dict[str, object]:
    return {"name": name, "pattern": pattern, "block_type": "identifier", "priority": 1}


@pytest.fixture
def live(pg_url: str, tmp_path: Path, tiny_engine: LLMEngine) -> Iterator[LiveServer]:
    settings = server_settings(pg_url, tmp_path, max_rules_per_tenant=MAX_RULES, max_rules_program_size=MAX_SIZE)
    with serving(settings, tiny_engine) as server:
        yield server


async def test_a_rule_past_the_count_cap_is_refused_and_edits_at_the_cap_still_work(live: LiveServer) -> None:
    async with httpx.AsyncClient(base_url=live.http) as http:
        made = [await http.post("/admin/rules", headers=A, json=_rule(f"r{i}")) for i in range(MAX_RULES)]
        refused = await http.post("/admin/rules", headers=A, json=_rule("one_more"))
        edited = await http.put(f"/admin/rules/{made[0].json()['id']}", headers=A, json=_rule("r0", "zy"))
        own = [r["name"] for r in (await http.get("/admin/rules", headers=A)).json() if r["scope"] == "tenant"]
    assert [r.status_code for r in made] == [201] * MAX_RULES
    assert (refused.status_code, refused.json()) == (
        422,
        {
            "detail": "rule 'one_more' refused: the tenant has 3 rules, the most it may have "
            "(KVCHAT_MAX_RULES_PER_TENANT)",
            "code": "rule_limit",
        },
    )
    assert edited.status_code == 200
    assert own == ["r0", "r1", "r2"]


async def test_a_rule_past_the_size_cap_is_refused_on_create_and_on_edit(live: LiveServer) -> None:
    big = ".{30}zx"  # a small pattern that compiles large: the cap counts RE2 instructions, not characters
    total = _size("zx") + _size(big)
    assert _size("zx") < MAX_SIZE < total  # (the premise: one small rule fits, the big one does not)
    detail = (
        f"rule 'big' refused: the tenant's rules would compile to {total} RE2 instructions; the limit is {MAX_SIZE} "
        "(KVCHAT_MAX_RULES_PROGRAM_SIZE)"
    )
    async with httpx.AsyncClient(base_url=live.http) as http:
        small = await http.post("/admin/rules", headers=A, json=_rule("small"))
        created = await http.post("/admin/rules", headers=A, json=_rule("big", big))
        other = await http.post("/admin/rules", headers=A, json=_rule("other", "zq"))
        edited = await http.put(f"/admin/rules/{other.json()['id']}", headers=A, json=_rule("big", big))
        patterns = {r["name"]: r["pattern"] for r in (await http.get("/admin/rules", headers=A)).json()}
    assert (small.status_code, other.status_code) == (201, 201)
    assert (created.status_code, created.json()) == (422, {"detail": detail, "code": "rule_limit"})
    # editing "other" into the big rule: the sizes of the tenant's other rules ("small") plus the new pattern
    assert (edited.status_code, edited.json()) == (422, {"detail": detail, "code": "rule_limit"})
    assert (patterns["small"], patterns["other"], "big" in patterns) == ("zx", "zq", False)
