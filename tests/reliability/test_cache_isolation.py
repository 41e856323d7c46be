"""Cache-timing isolation between tenants (issue 20): another tenant's cached prompt gives no timing signal.

Tenant A (the default tenant) sends a long prompt, warming its cache. Then, interleaved in random order per sample:
tenant B sends the same prompt (must look cold), B sends an equally long prompt nobody sent (the cold baseline), and
A re-sends its prompt (the control, must look hot). Every sample uses a new prompt, so B's own cache never helps it.
Time to first token is taken on the client, as an attacker would: a non-streaming ``/v1`` request for one token.
The distributions are compared with a Mann-Whitney U test: B vs cold shows no signal (p > 0.01), A vs cold does
(p < 0.001). Besides timing, no ``/v1`` or admin route answers B with A's cached-token counts or A's sessions.

NOTE: the engine is a wider tiny model (hidden 256, 4 layers, fp32) than the ``tiny_engine`` fixture's, so that a cold
~1500-token prefill costs tens of milliseconds more than a hit: a clear signal on a loaded CI box, in ~a minute.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import websockets
from scipy.stats import mannwhitneyu

from backend.domain import KeyKind
from backend.services.tenants import add_key, create_tenant
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.testing import build_tiny_model
from support.server import ADMIN_KEY, CHAT_TOKEN, LiveServer, db_session, server_settings, serving

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]

B_CHAT_TOKEN = "tenant-b-chat-token"
B_ADMIN_KEY = "tenant-b-admin-key"
SAMPLES = 20
PROMPT_TOKENS = 1500
NO_SIGNAL_P = 0.01  # B vs cold must not be distinguishable at this level
SIGNAL_P = 0.001  # the same-tenant control must be
TIMEOUT_S = 60.0
A_TEXTS = ("I need a refund for my blue jacket please.", "It arrived damaged.")
_WORDS: tuple[str, ...] = (
    "order",
    "refund",
    "jacket",
    "return",
    "policy",
    "receipt",
    "shipping",
    "delivery",
    "account",
    "email",
)
_WORDS += ("password", "screen", "damaged", "support", "thank", "please", "status", "number", "week", "today")


@pytest.fixture(scope="module")
def wide_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLMEngine]:
    folder = build_tiny_model(tmp_path_factory.mktemp("wide-tiny"), hidden_size=256, num_layers=4, suppress_eos=True)
    engine = LLMEngine(
        EngineConfig(model=str(folder), dtype="float32", device="cpu", max_kv_memory_mb=64, max_num_seqs=4)
    )
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.stop())


OPERATOR_TOKEN = "operator-metrics-token"


@pytest.fixture
def live(pg_url: str, tmp_path: Path, wide_engine: LLMEngine) -> Iterator[LiveServer]:
    # NOTE: /metrics adds up every tenant's traffic: a deployment where tenants reach the server sets an operator
    # token for it (without one, only loopback clients are answered, and every client of this test is loopback).
    with serving(server_settings(pg_url, tmp_path, metrics_token=OPERATOR_TOKEN), wide_engine) as server:
        yield server


async def _add_tenant_b(live: LiveServer) -> None:
    async with db_session(live) as db:
        tenant = await create_tenant(db, "tenant-b")
        await add_key(db, tenant.id, KeyKind.CHAT, B_CHAT_TOKEN)
        await add_key(db, tenant.id, KeyKind.ADMIN, B_ADMIN_KEY)
        await db.commit()


def _body(rng: random.Random, engine: LLMEngine) -> str:
    """Random support-chat words, about ``PROMPT_TOKENS`` tokens long."""
    words: list[str] = []
    while len(engine.tokenize([{"role": "user", "content": " ".join(words)}])) < PROMPT_TOKENS:
        words.extend(rng.choice(_WORDS) for _ in range(50))
    return " ".join(words)


def _prompt(ticket: int, body: str) -> str:
    # NOTE: the ticket number comes first, so two prompts with the same body share no cache block.
    return f"Ticket {ticket:06d}: {body}"


@dataclass(frozen=True, slots=True)
class Probe:
    seconds: float
    prompt_tokens: int
    cached_tokens: int


async def _probe(http: httpx.AsyncClient, token: str, text: str) -> Probe:
    start = time.perf_counter()
    response = await http.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {token}"},
        json={"model": "default", "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0},
    )
    seconds = time.perf_counter() - start
    assert response.status_code == 200, response.text
    usage = response.json()["usage"]
    return Probe(seconds, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


async def test_another_tenants_cached_prompt_gives_no_timing_signal(live: LiveServer, wide_engine: LLMEngine) -> None:
    await _add_tenant_b(live)
    rng = random.Random(20)
    tickets = rng.sample(range(1_000_000), 2 * SAMPLES)
    probes: dict[str, list[Probe]] = {"warm": [], "other": [], "cold": [], "control": []}
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT_S) as http:
        for i in range(SAMPLES):
            body = _body(rng, wide_engine)
            shared, fresh = _prompt(tickets[2 * i], body), _prompt(tickets[2 * i + 1], body)
            probes["warm"].append(await _probe(http, CHAT_TOKEN, shared))
            # NOTE: a random order per sample, so a drift in the machine's load falls on every group alike.
            order = [("other", B_CHAT_TOKEN, shared), ("cold", B_CHAT_TOKEN, fresh), ("control", CHAT_TOKEN, shared)]
            rng.shuffle(order)
            for group, token, text in order:
                probes[group].append(await _probe(http, token, text))
    seconds = {group: [p.seconds for p in values] for group, values in probes.items()}
    p_other = float(mannwhitneyu(seconds["other"], seconds["cold"], alternative="two-sided").pvalue)
    p_control = float(mannwhitneyu(seconds["control"], seconds["cold"], alternative="two-sided").pvalue)
    print(
        "\n"
        + " ".join(f"{g}: median {sorted(v)[len(v) // 2] * 1000:.1f} ms" for g, v in seconds.items())
        + f"\nMann-Whitney U, n={SAMPLES}: other tenant vs cold p={p_other:.3g}; same tenant vs cold p={p_control:.3g}"
    )
    assert all(p.prompt_tokens >= PROMPT_TOKENS for p in probes["warm"])
    assert [p.cached_tokens for p in probes["warm"]] == [0] * SAMPLES
    assert [p.cached_tokens for p in probes["other"]] == [0] * SAMPLES  # B never sees A's cached tokens
    assert [p.cached_tokens for p in probes["cold"]] == [0] * SAMPLES
    # the control re-uses every full block but the one holding the last prompt token (always recomputed)
    block = wide_engine.info.block_size
    assert all(p.cached_tokens >= p.prompt_tokens - block for p in probes["control"])
    assert p_other > NO_SIGNAL_P
    assert p_control < SIGNAL_P


def _concrete(path: str, session_id: str) -> str:
    return path.replace("{session_id}", session_id).replace("{model_id}", "default")


def _cache_figures(body: str) -> dict[str, object]:
    """Every figure in an answer that could count cached tokens: JSON fields named ``*cached*`` or ``*hit*`` (by
    their path), and Prometheus series whose name says ``cache``."""
    try:
        data = json.loads(body)
    except ValueError:
        lines = [line for line in body.splitlines() if line and not line.startswith("#")]
        return {name: value for name, _, value in (line.rpartition(" ") for line in lines) if "cache" in name}
    found: dict[str, object] = {}

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")
        elif "cached" in path.rpartition(".")[2] or "hit" in path.rpartition(".")[2]:
            found[path] = node

    walk(data, "")
    return found


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: str


async def _everything_b_can_get(http: httpx.AsyncClient, paths: list[str], session_id: str) -> dict[str, Answer]:
    """Every GET route, asked with each of B's keys (a Bearer header would win over X-API-Key, so one at a time)."""
    keys = {"admin": {"X-API-Key": B_ADMIN_KEY}, "chat": {"Authorization": f"Bearer {B_CHAT_TOKEN}"}}
    answers = {}
    for path in paths:
        for name, headers in keys.items():
            try:
                response = await http.get(_concrete(path, session_id), headers=headers)
            except httpx.TransportError as exc:  # a route that crashes shows nothing (its own tests catch the crash)
                answers[f"{name} {path}"] = Answer(0, f"{type(exc).__name__}")
                continue
            answers[f"{name} {path}"] = Answer(response.status_code, response.text)
    return answers


async def _tenant_a_chats_with_cache_hits(live: LiveServer, http: httpx.AsyncClient) -> str:
    """Two websocket turns and a repeated /v1 request of tenant A, each after the first hitting A's cache; A's
    session id."""
    async with websockets.connect(live.ws, open_timeout=TIMEOUT_S) as ws:
        await ws.send(json.dumps({"type": "hello", "token": CHAT_TOKEN, "external_ref": "a-customer"}))
        session_id: str = json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S))["session_id"]
        cached = []
        for i, text in enumerate(A_TEXTS):
            await ws.send(json.dumps({"type": "user.message", "client_msg_id": f"a{i}", "text": text}))
            while (frame := json.loads(await asyncio.wait_for(ws.recv(), TIMEOUT_S)))["type"] != "message.completed":
                pass
            cached.append(frame["usage"]["cached_tokens"])
    v1 = [await _probe(http, CHAT_TOKEN, " ".join(A_TEXTS) * 20) for _ in range(2)]
    assert cached[1] > 0 and v1[1].cached_tokens > 0  # A hit its cache: there is something to leak
    return session_id


async def test_no_route_shows_tenant_b_the_cached_tokens_or_sessions_of_tenant_a(live: LiveServer) -> None:
    await _add_tenant_b(live)
    async with httpx.AsyncClient(base_url=live.http, timeout=TIMEOUT_S) as http:
        spec = (await http.get("/openapi.json")).json()
        paths = [path for path, ops in spec["paths"].items() if "get" in ops]
        assert "/admin/sessions/{session_id}/transcript" in paths
        before = await _everything_b_can_get(http, paths, "no-such-session")
        session_id = await _tenant_a_chats_with_cache_hits(live, http)
        own = await http.get(f"/admin/sessions/{session_id}", headers={"X-API-Key": ADMIN_KEY})
        assert own.status_code == 200  # the route does show A's session to A
        after = await _everything_b_can_get(http, paths, session_id)
    leaks = []
    for route, answer in after.items():
        # a 404 may echo the id B asked for; an answer may not show A's session or what A said
        if (answer.status < 400 and session_id in answer.body) or any(text in answer.body for text in A_TEXTS):
            leaks.append(f"{route}: shows A's session")
        earlier, now = _cache_figures(before[route].body), _cache_figures(answer.body)
        changed = {name: (v, earlier.get(name)) for name, v in now.items() if earlier.get(name) != v}
        if changed:
            leaks.append(f"{route}: cache figures moved with A's traffic (after, before): {changed}")
    broken = [route for route, answer in after.items() if answer.status in (0, 500)]
    print("\n" + "\n".join(leaks or ["no leak"]) + f"\nroutes that failed (not judged): {broken}")
    assert after["admin /admin/sessions/{session_id}"].status == 404
    assert after["admin /admin/sessions/{session_id}/transcript"].status == 404
    assert after["admin /admin/sessions"] == Answer(200, "[]")
    assert after["admin /metrics"].status == after["chat /metrics"].status == 401  # the operator's view only
    assert broken == []
    assert leaks == []
