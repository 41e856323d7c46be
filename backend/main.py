"""FastAPI app factory. The lifespan owns the database engine, the inference engine and the chat service."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from backend.api import boundary, docs
from backend.api.routes import (
    admin_agents,
    admin_audit,
    admin_cache,
    admin_fair_share,
    admin_handbook,
    admin_handoff,
    admin_inbox,
    admin_reply,
    admin_rules,
    admin_sessions,
    admin_stats,
    admin_tenant,
    admin_tools,
    agent_inbox,
    agent_ws,
    chat_ws,
    health,
    openai_api,
)
from backend.api.routes import metrics as metrics_route
from backend.api.state import AppState
from backend.chat.fanout import Fanout
from backend.chat.hub import SessionHub
from backend.chat.recovery import CutOffSweeper
from backend.chat.service import ChatService
from backend.chat.turn import ReplyConfig
from backend.core.admission import Admission
from backend.core.config import Settings
from backend.core.errors import one_line_reason
from backend.core.heap import FreedMemoryReleaser, long_lived_heap_frozen
from backend.core.logs import RequestIdMiddleware
from backend.core.metrics import Metrics, instrument_database
from backend.core.namespaces import Namespaces, check_shared_secret, load_secret, secret_tag
from backend.core.startup import STARTUP_ERRORS, Phase, Startup
from backend.core.tenant_quota import GatedEngine, QuotaGate
from backend.db import migrate
from backend.db.engine import (
    create_db_engine,
    create_sessionmaker,
    live_workers,
    peer_secret_tags,
    peer_workers,
    worker_name,
)
from backend.db.models import utcnow
from backend.engine_client.engine_process import EngineProcess
from backend.engine_client.model_id import served_model_id
from backend.engine_client.protocol import EngineClient
from backend.engine_client.remote import RemoteEngine
from backend.openai import body_bound
from backend.openai.request_plan import DEFAULT_MAX_N
from backend.openai.service import ChatCompletions
from backend.services import cache_admin, fair_share
from backend.services.context_service import ContextService
from backend.services.reply_settings import defaults_of
from backend.services.revocation import RevocationFeed
from backend.services.tenants import BootstrapResult, bootstrap_default_tenant, default_handbook

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine

log = logging.getLogger("kvchat")
FRONTEND_DIR = Path(__file__).resolve().parents[1] / "frontend_stub"


def create_app(
    settings: Settings | None = None, engine: LLMEngine | None = None, *, serve_while_starting: bool = False
) -> FastAPI:
    """Build the app. Pass ``engine`` to share an already-built engine (the caller then owns its lifetime).

    ``serve_while_starting`` (``kvchat serve``): the lifespan returns at once and the start runs beside the server, so
    HTTP answers during a model conversion or load (``/livez`` names the phase; everything that needs the start done
    answers 503 ``starting``). Otherwise the lifespan returns when the app is ready, or raises why it cannot be.
    """
    settings = settings or Settings()
    startup = Startup()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with contextlib.AsyncExitStack() as owned:
            start = asyncio.create_task(_start(app, settings, engine, startup, owned, raises=not serve_while_starting))
            if not serve_while_starting:
                await start
            try:
                yield
            finally:
                if not start.done():
                    start.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await start
        # NOTE: leaving ``owned`` undid what the start did, in reverse: the heap freeze, the sweeper, the chat
        # (drained), the engine (when this app built it), the database engine.

    app = FastAPI(title="kvchat", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.startup = startup
    boundary.install(app, settings.max_request_bytes)
    app.add_middleware(RequestIdMiddleware)
    docs.install(app)
    app.include_router(health.router)
    app.include_router(chat_ws.router)
    app.include_router(admin_sessions.router)
    app.include_router(openai_api.router)
    app.include_router(metrics_route.router)
    app.include_router(admin_stats.router)
    app.include_router(admin_tenant.router)
    app.include_router(admin_handbook.router)
    app.include_router(admin_reply.router)
    app.include_router(admin_tools.router)
    app.include_router(admin_rules.router)
    app.include_router(admin_audit.router)
    app.include_router(admin_cache.router)
    app.include_router(admin_fair_share.router)
    app.include_router(admin_agents.router)
    app.include_router(admin_handoff.router)
    app.include_router(admin_inbox.router)
    app.include_router(agent_inbox.router)
    app.include_router(agent_ws.router)

    @app.get("/", include_in_schema=False)
    async def root() -> RedirectResponse:
        return RedirectResponse("/chat")

    @app.get("/chat", include_in_schema=False)
    async def chat_page() -> FileResponse:
        return FileResponse(FRONTEND_DIR / "chat.html", media_type="text/html")

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page() -> FileResponse:
        return FileResponse(FRONTEND_DIR / "dashboard.html", media_type="text/html")

    @app.get("/agent", include_in_schema=False)
    async def agent_page() -> FileResponse:
        return FileResponse(FRONTEND_DIR / "agent.html", media_type="text/html")

    @app.get("/settings", include_in_schema=False)
    async def settings_page() -> FileResponse:
        return FileResponse(FRONTEND_DIR / "settings.html", media_type="text/html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        # NOTE: an SVG at the path browsers ask for unprompted; every modern browser reads it by its media type.
        return FileResponse(FRONTEND_DIR / "favicon.svg", media_type="image/svg+xml")

    app.mount("/static", StaticFiles(directory=FRONTEND_DIR), name="static")

    return app


async def _start(
    app: FastAPI,
    settings: Settings,
    engine: LLMEngine | None,
    startup: Startup,
    owned: contextlib.AsyncExitStack,
    *,
    raises: bool,
) -> None:
    """Migrate, load the model (converting it on a first start), recover, then publish ``app.state.kvchat``. What it
    opens goes on ``owned``, which the lifespan closes. A failure is recorded on ``startup`` (``kvchat serve`` then
    exits with that one line), and raised when ``raises``."""
    try:
        await _start_phases(app, settings, engine, startup, owned)
    except asyncio.CancelledError:
        raise
    except STARTUP_ERRORS as exc:
        startup.fail(f"while {startup.phase}: {one_line_reason(exc)}")
        if raises:
            raise
    except Exception as exc:
        log.exception("the start failed while %s", startup.phase)
        startup.fail(f"while {startup.phase}: {type(exc).__name__} (the traceback is in the log)")
        if raises:
            raise


async def _start_phases(
    app: FastAPI, settings: Settings, engine: LLMEngine | None, startup: Startup, owned: contextlib.AsyncExitStack
) -> None:
    url = settings.resolved_database_url
    if settings.run_migrations_on_start:
        startup.enter(Phase.MIGRATING, "migrating the database")
        # NOTE: Alembic's env.py runs its own event loop, so it must not run on this one.
        await asyncio.to_thread(migrate.upgrade, url)
    namespaces = Namespaces(load_secret(settings.secret_key, settings.data_dir))
    tag = secret_tag(namespaces.secret)
    name = worker_name(tag)
    db_engine = create_db_engine(url, application_name=name)
    owned.push_async_callback(db_engine.dispose)
    # NOTE: before anything is served: a worker with another secret would split every tenant's cache namespace.
    check_shared_secret(tag, await peer_secret_tags(db_engine, name))
    sessionmaker = create_sessionmaker(db_engine)
    metrics = Metrics()
    boot = await bootstrap_default_tenant(
        sessionmaker,
        settings.bootstrap_chat_token,
        settings.bootstrap_admin_key,
        default_handbook(settings.default_handbook),
    )
    if boot.created:
        log.info("created the default tenant %s", boot.tenant_id)
    llm, model, capacity = await _open_engine(settings, engine, startup, owned)
    reply = ReplyConfig(settings.reply_max_tokens, defaults_of(settings), settings.tools_allow_private_networks)
    snapshot = metrics.watch_engine(llm)  # (a remote engine's stats: refreshed in the background)
    if snapshot is not None:
        snapshot.start()
        owned.push_async_callback(snapshot.stop)
    instrument_database(db_engine, metrics)
    quotas = await _start_quotas(sessionmaker, metrics, owned)
    gated = GatedEngine(llm, quotas)  # chat turns and /v1 completions go through the tenants' quotas
    context = ContextService(sessionmaker, llm, namespaces)
    chat = ChatService(
        sessionmaker,
        gated,
        SessionHub(),
        context,
        reply,
        settings.test_commit_delay_seconds,
        metrics,
        submit_concurrency=settings.turn_submit_concurrency,
    )
    fanout = _start_fanout(url, name, chat, metrics, owned)  # (stopped after the drain: its last frames still go out)
    owned.push_async_callback(_drain, chat, settings.shutdown_grace_seconds)
    revocations = RevocationFeed(url, sessionmaker, chat.hub.keys)  # revoked keys close their sockets, any process
    revocations.start()
    owned.push_async_callback(revocations.stop)
    startup.enter(Phase.RECOVERING, "marking replies a crash cut off, pinning prefixes")
    started_at = utcnow()
    await _recover_interrupted_turns(chat, db_engine, name)
    if fanout is not None:
        cut_offs = CutOffSweeper(sessionmaker, chat.hub, fanout, chat.claimed_turns, lambda: live_workers(db_engine))
        owned.push_async_callback(_cancel, asyncio.create_task(cut_offs.run(started_at), name="kvchat-cut-offs"))
    pinned = await cache_admin.pin_at_start(sessionmaker, llm, namespaces)
    if pinned:
        log.info("pinned the system + policy prefix of %d tenant(s)", pinned)
    sweeper = asyncio.create_task(_sweep_idle_sessions(chat, settings.session_timeout_seconds))
    owned.push_async_callback(_cancel, sweeper)
    if settings.gc_freeze:
        owned.enter_context(long_lived_heap_frozen())  # (full GC passes would otherwise stall every request: heap.py)
    heap = FreedMemoryReleaser()
    owned.push_async_callback(heap.stop)
    app.state.kvchat = AppState(
        settings=settings,
        db_engine=db_engine,
        sessionmaker=sessionmaker,
        engine=llm,
        chat=chat,
        completions=ChatCompletions(gated, served_model_id(model), metrics, max_n=min(DEFAULT_MAX_N, capacity)),
        metrics=metrics,
        namespaces=namespaces,
        admission=Admission(capacity, max_body_bytes=await asyncio.to_thread(body_bound.for_engine, llm)),
        quotas=quotas,
        heap=heap,
    )
    base = f"http://{settings.host}:{settings.port}"
    startup.enter(
        Phase.READY,
        f"kvchat ready: chat page {base}/chat (websocket /ws/chat), dashboard {base}/dashboard, API docs {base}/docs",
    )
    # NOTE: last, so the keys a first start generates are the console's last lines, not scrolled away by the start.
    print_generated_keys(boot)


async def _open_engine(
    settings: Settings, engine: LLMEngine | None, startup: Startup, owned: contextlib.AsyncExitStack
) -> tuple[EngineClient, str, int]:
    """The engine, its model's name and how many requests it admits: the in-process one (``inproc``, or ``engine``
    when given), a client of this machine's engine process (``process``), or of remote replicas (``remote``;
    docs/scale-out.md)."""
    mode = settings.resolved_engine_mode
    if engine is None and mode != "inproc":
        url, replicas, uds, alive = settings.engine_url or "http://engine", settings.engine_replica_urls, None, None
        if mode == "process":
            startup.enter(Phase.LOADING_MODEL, "starting (or joining) this machine's engine process")
            process = EngineProcess(settings.resolved_engine_process_dir)
            owned.push_async_callback(process.stop)
            await process.start()
            url, replicas, uds, alive = "http://engine", [], str(process.socket_path), lambda: process.up
        else:
            startup.enter(Phase.LOADING_MODEL, f"connecting to the engine replicas behind {url}")
        remote = RemoteEngine(
            url,
            replicas,
            model=settings.model,
            cache_dir=settings.resolved_cache_dir,
            secret=settings.engine_secret,
            timeout_s=settings.engine_timeout_s,
            retries=settings.engine_retries,
            uds=uds,
            alive=alive,
        )
        owned.push_async_callback(remote.stop)
        await remote.start()
        return remote, settings.model, settings.max_num_seqs + settings.max_waiting
    from engine.llm_engine import LLMEngine  # NOTE: here, so a backend of a remote engine never loads torch

    llm = engine or LLMEngine(settings.engine_config())
    if engine is None:
        owned.push_async_callback(llm.stop)
    if not llm.is_running:
        await _load_model(llm, startup)
    return llm, llm.config.model, llm.config.max_num_seqs + llm.config.max_waiting


async def _load_model(llm: LLMEngine, startup: Startup) -> None:
    from engine.model.loader import locate_model, resolve_model

    model, cache_dir = llm.config.model, llm.config.cache_dir
    startup.enter(Phase.LOADING_MODEL, f"loading the model {model}")
    if locate_model(model, cache_dir).needs_conversion:
        startup.enter(Phase.CONVERTING_MODEL, "converting it to a safetensors cache, once (30 s or more on 2 cores)")
        await _in_daemon_thread(resolve_model, model, cache_dir)
        startup.enter(Phase.LOADING_MODEL, "loading the converted model")
    await llm.start()


async def _in_daemon_thread(fn: Callable[..., object], *args: object) -> None:
    """Run ``fn`` on a thread of its own that does not hold the process at exit.

    NOTE: not ``asyncio.to_thread``: the loop's executor is joined when ``asyncio.run`` ends, so a Ctrl-C during a
    conversion would wait for the whole conversion. A conversion writes to a temporary folder and renames it into
    place, so abandoning one leaves no half-written cache.
    """
    done: concurrent.futures.Future[object] = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting task, which raises it
            done.set_exception(exc)

    threading.Thread(target=run, name="kvchat-start", daemon=True).start()
    await asyncio.wrap_future(done)


async def _drain(chat: ChatService, grace_s: float) -> None:
    cut = await chat.drain(grace_s)  # a no-op after kvchat serve's own drain
    if cut.cut_off:
        log.warning("shutdown cut off %d repl(ies); stored as incomplete", cut.cut_off)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def _start_fanout(
    url: str, name: str, chat: ChatService, metrics: Metrics, owned: contextlib.AsyncExitStack
) -> Fanout | None:
    """On Postgres, the fan-out to the other workers on the database (``backend/chat/fanout.py``): their frames, socket
    counts and turns. SQLite serves one process: none."""
    if not url.startswith("postgresql"):
        return None
    fanout = Fanout(url, name, chat.hub, chat.claimed_turns, chat.replies_in_flight, on_frame=metrics.fanout_frames.inc)
    fanout.start()
    owned.push_async_callback(fanout.stop)
    return fanout


async def _recover_interrupted_turns(chat: ChatService, db_engine: AsyncEngine, name: str) -> None:
    # NOTE: another live process's awaiting messages are its turns in flight, so this marks them all only when this
    # process is alone on the database. With other workers, the cut-off sweeper marks those no live worker claims
    # (backend/chat/recovery.py), once their heartbeats are in.
    peers = await peer_workers(db_engine, name)
    if peers:
        log.info("%d other kvchat process(es) on this database: their heartbeats decide the cut-off turns", peers)
        return
    marked = await chat.recover_interrupted()
    if marked:
        log.warning("marked %d repl(ies) cut off by a crash as incomplete", marked)


async def _start_quotas(
    sessionmaker: async_sessionmaker[AsyncSession], metrics: Metrics, owned: contextlib.AsyncExitStack
) -> QuotaGate:
    """The tenants' weights and quotas, loaded now and then every ``fair_share.REFRESH_S`` (an operator's change made
    through another worker reaches this one)."""
    gate = QuotaGate(on_refused=metrics.tenant_refused, on_served=metrics.tenant_served_request)
    async with sessionmaker() as db:
        gate.load(await fair_share.load_all(db))

    async def refresh() -> None:
        while True:
            await asyncio.sleep(fair_share.REFRESH_S)
            try:
                async with sessionmaker() as db:
                    gate.load(await fair_share.load_all(db))
            except Exception:  # NOTE: a database blip keeps the quotas last loaded; the next period tries again
                log.warning("reloading the tenants' fair-share settings failed", exc_info=True)

    owned.push_async_callback(_cancel, asyncio.create_task(refresh(), name="kvchat-quotas"))
    return gate


async def _sweep_idle_sessions(chat: ChatService, timeout_s: int) -> None:
    interval = max(1.0, min(60.0, timeout_s / 4))
    while True:
        await asyncio.sleep(interval)
        try:
            closed = await chat.close_idle(timedelta(seconds=timeout_s))
        except Exception:
            log.exception("closing idle sessions failed; retrying in %.0fs", interval)
            continue
        if closed:
            log.info("closed %d idle session(s)", len(closed))


def print_generated_keys(boot: BootstrapResult) -> None:
    """The keys a first start generated, framed, on stdout: shown this once (only their hashes are stored)."""
    lines = [("chat token (also its OpenAI API key)", boot.generated_chat_token)]
    lines.append(("admin API key", boot.generated_admin_key))
    shown = [(label, key) for label, key in lines if key]
    if not shown:
        return
    width = max(len(label) for label, _ in shown)
    body = [f"  {label.ljust(width)}  {key}" for label, key in shown]
    rule = "=" * max(72, *(len(line) for line in body))
    text = [
        rule,
        "  First start: the default tenant's keys. They are shown only this once (only their hashes are stored):",
        *body,
        "  /dashboard and /settings take the admin key; /chat and `kvchat chat --token` the chat token.",
        rule,
    ]
    print("\n".join(text), flush=True)
