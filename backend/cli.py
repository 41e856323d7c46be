"""The ``kvchat`` command: ``serve``, ``engine-serve``, ``migrate``, ``generate``, ``doctor``, ``chat``, the tenant and
key commands (``backend/cli_tenants.py``) and ``handbook`` (``backend/cli_handbook.py``).

A start-up problem (a database that is down or not supported, a model that is not there, a bad setting) is one line,
``error: ...``, on stderr and a non-zero exit — never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

from backend.core import logs
from backend.core.config import Settings
from backend.core.errors import one_line_reason
from backend.core.logs import LogFormat
from backend.core.startup import Phase, Startup

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI


class StartupError(Exception):
    """A problem the operator must fix before kvchat can start; printed as one ``error:`` line."""


def _serve(args: argparse.Namespace) -> int:
    settings = Settings()
    host = args.host or settings.host
    port = args.port or settings.port
    settings = settings.model_copy(update={"host": host, "port": port})
    # NOTE: first: a busy port must not cost a model load (or a first conversion)
    sockets = [shared_port_socket(host, port)] if settings.reuse_port else None
    if sockets is None:
        _check_port(host, port)
    _check_database(settings.resolved_database_url)
    _warn_deprecated(settings)
    _check_model(settings.model, settings.resolved_cache_dir)
    import uvicorn

    from backend.main import create_app

    # NOTE: the slow part of the start (a first start converts the model) runs while the server listens: /livez
    # names the phase, /readyz stays 503, and the chat and API answer "starting" until it is done.
    app = create_app(settings, serve_while_starting=True)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers go through ours (backend/core/logs.py): one format, JSON when asked
        ws="websockets-sansio",
        ws_per_message_deflate=settings.ws_compression,
        # NOTE: bounds what is left after the chat drain: SSE streams still running, sockets closing.
        timeout_graceful_shutdown=max(1, round(settings.shutdown_grace_seconds)),
    )
    _draining_server(config, app).run(sockets=sockets)
    startup: Startup = app.state.startup
    if startup.error is not None:
        raise StartupError(f"kvchat could not start: {startup.error}")
    return 0


def _engine_serve(args: argparse.Namespace) -> int:
    """The engine alone behind HTTP (``backend/engine_server``): a replica for backends that set KVCHAT_ENGINE_URL."""
    from backend.engine_server.auth import is_loopback

    settings = Settings()
    host, port, secret = args.host, args.port, settings.engine_secret
    if not secret and not is_loopback(host) and args.uds is None:
        # NOTE: the namespace header is trusted: an open replica would let anyone read any tenant's cache.
        raise StartupError(f"refusing to serve the engine on {host} without a secret: set KVCHAT_ENGINE_SECRET")
    if args.uds is None:
        _check_port(host, port)
    _warn_deprecated(settings)
    _check_model(settings.model, settings.resolved_cache_dir)
    import uvicorn

    from backend.engine_server.app import create_engine_app
    from engine.llm_engine import LLMEngine

    # NOTE: the model loads before the server listens, so a replica is in the router's ring only once it can answer,
    # and a load failure is one ``error:`` line (uvicorn would print a lifespan traceback).
    engine = LLMEngine(settings.engine_config())
    asyncio.run(engine.start())
    try:
        app = create_engine_app(engine, secret, owns_engine=False)
        # NOTE: a unix socket (KVCHAT_ENGINE_MODE=process) is guarded by its folder's mode (0700), not by a secret
        where: dict[str, Any] = {"uds": args.uds} if args.uds else {"host": host, "port": port}
        uvicorn.run(app, **where, log_level=settings.log_level, log_config=None)
    finally:
        asyncio.run(engine.stop())
    return 0


def _draining_server(config: uvicorn.Config, app: FastAPI) -> uvicorn.Server:
    import uvicorn

    class DrainingServer(uvicorn.Server):
        """uvicorn closes every websocket with 1012 as soon as it starts to shut down; first, drain the chat: no new
        connections or turns, and replies in flight get the grace period to finish while they still stream. A start
        that failed (it runs while the server listens) stops the server."""

        async def on_tick(self, counter: int) -> bool:
            if app.state.startup.phase is Phase.FAILED:
                return True
            return await super().on_tick(counter)

        async def shutdown(self, sockets: list[object] | None = None) -> None:  # type: ignore[override]
            for server in self.servers:
                server.close()  # stop accepting connections while we drain
            state = getattr(app.state, "kvchat", None)
            if state is not None and not self.force_exit:
                drain = asyncio.create_task(state.chat.drain(state.settings.shutdown_grace_seconds))
                while not drain.done() and not self.force_exit:  # NOTE: a second Ctrl-C quits at once
                    await asyncio.wait({drain}, timeout=0.1)
                if not drain.done():
                    drain.cancel()
            await super().shutdown(sockets)  # type: ignore[arg-type]

    return DrainingServer(config)


def _check_port(host: str, port: int) -> None:
    """Refuse at once when the port is taken (another kvchat, most likely) instead of failing after a model load."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                reason = "the port is already in use (another kvchat server?); set KVCHAT_PORT"
            else:
                reason = f"{exc.strerror or exc}; check KVCHAT_HOST / KVCHAT_PORT"
            raise StartupError(f"cannot listen on {host}:{port}: {reason}") from exc


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` that other ``kvchat serve`` workers may bind too (``KVCHAT_REUSE_PORT``: Linux
    spreads the new connections over them); refused when a process without the option holds the port."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        reason = "held by a process that does not share it (KVCHAT_REUSE_PORT unset there?)"
        raise StartupError(
            f"cannot listen on {host}:{port}: {reason if exc.errno == errno.EADDRINUSE else exc}"
        ) from exc
    return sock


def _check_database(url: str) -> None:
    from sqlalchemy.exc import SQLAlchemyError

    from backend.db.engine import UnsupportedDatabaseError, check_database_url, ping

    try:
        check_database_url(url)
        asyncio.run(ping(url))
    except UnsupportedDatabaseError as exc:
        raise StartupError(str(exc)) from exc
    except (SQLAlchemyError, OSError, TimeoutError) as exc:
        raise StartupError(f"cannot reach the database {_redact(url)}: {one_line_reason(exc)}") from exc


def _warn_deprecated(settings: Settings) -> None:
    for line in settings.deprecated_settings():
        logging.getLogger("kvchat").warning("%s", line)


def _check_model(model: str, cache_dir: str | None) -> None:
    """That the model is there and readable, in milliseconds; converting it is part of the start (``Phase``)."""
    from engine.errors import ModelLoadError
    from engine.model.loader import locate_model

    try:
        locate_model(model, cache_dir)
    except (ModelLoadError, OSError, ValueError) as exc:
        raise StartupError(f"cannot load the model {model!r}: {exc}") from exc


def _migrate(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from backend.db import migrate
    from backend.db.engine import UnsupportedDatabaseError

    url = Settings().resolved_database_url
    try:
        print(f"migrating {_redact(url)} to {args.revision}", flush=True)
        migrate.upgrade(url, args.revision)
    except UnsupportedDatabaseError as exc:
        raise StartupError(str(exc)) from exc
    except (SQLAlchemyError, OSError) as exc:
        # NOTE: a wrong URL, a database that is down or a read-only data dir: one clear line, not a traceback.
        raise StartupError(f"cannot migrate {_redact(url)}: {one_line_reason(exc)}") from exc
    print("migrations done", flush=True)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.cli import generate_command

    return generate_command(args)


def _doctor(args: argparse.Namespace) -> int:
    from engine.cli import doctor_command

    return doctor_command(args)


def _chat(args: argparse.Namespace) -> int:
    from backend.chat import client

    return client.main(args)


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        return make_url(url).render_as_string(hide_password=True)
    except ArgumentError:
        return repr(url)  # not a URL: nothing to hide


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvchat", description="kvchat: customer-service chat on a KV-reusing engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP/websocket server")
    serve.add_argument("--host", default=None, help="bind address (default KVCHAT_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default KVCHAT_PORT or 8000)")
    serve.set_defaults(func=_serve)
    eserve = sub.add_parser("engine-serve", help="serve the engine alone over HTTP (a replica: docs/scale-out.md)")
    eserve.add_argument("--host", default="127.0.0.1", help="bind address (another than loopback needs a secret)")
    eserve.add_argument("--port", type=int, default=8100, help="port (default 8100)")
    eserve.add_argument("--uds", default=None, help="listen on this unix socket instead (KVCHAT_ENGINE_MODE=process)")
    eserve.set_defaults(func=_engine_serve)
    mig = sub.add_parser("migrate", help="upgrade the database schema (Alembic)")
    mig.add_argument("revision", nargs="?", default="head")
    mig.set_defaults(func=_migrate)
    from engine.cli import add_doctor_arguments, add_generate_arguments

    gen = sub.add_parser("generate", help="stream one completion from the engine to the terminal")
    add_generate_arguments(gen)
    gen.set_defaults(func=_generate)
    doctor = sub.add_parser("doctor", help="which kernel runs each operation on this machine, and why")
    add_doctor_arguments(doctor)
    doctor.set_defaults(func=_doctor)
    from backend.chat.client import add_arguments as add_chat_arguments

    chat = sub.add_parser("chat", help="talk to a running kvchat server from the terminal")
    add_chat_arguments(chat)
    chat.set_defaults(func=_chat)
    from backend.cli_tenants import add_commands as add_tenant_commands

    add_tenant_commands(sub)
    from backend.cli_handbook import add_commands as add_handbook_commands

    add_handbook_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    fmt: LogFormat = "json" if os.environ.get("KVCHAT_LOG_FORMAT", "").lower() == "json" else "text"
    logs.configure("info", fmt)
    # NOTE: alembic announces each of its plugins at INFO on every run; only the migrations themselves matter.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    from pydantic import ValidationError

    from engine.errors import EngineError

    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except StartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except ValidationError as exc:
        detail = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in detail["loc"])
        print(f"error: invalid setting {where or 'KVCHAT_*'}: {detail['msg']}", file=sys.stderr)
        return 1
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
