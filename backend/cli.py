"""The ``kvchat`` command: ``serve``, ``migrate`` (and the engine's ``generate`` and benchmarks once they land)."""

from __future__ import annotations

import argparse
import logging
import sys

from backend.core.config import Settings


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from backend.main import create_app

    settings = Settings()
    host = args.host or settings.host
    port = args.port or settings.port
    settings = settings.model_copy(update={"host": host, "port": port})
    uvicorn.run(create_app(settings), host=host, port=port, log_level=settings.log_level, ws="websockets-sansio")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from backend.db import migrate

    url = Settings().resolved_database_url
    print(f"migrating {_redact(url)} to {args.revision}", flush=True)
    try:
        migrate.upgrade(url, args.revision)
    except (SQLAlchemyError, OSError) as exc:
        # NOTE: a wrong URL, a database that is down or a read-only data dir: one clear line, not a traceback.
        print(f"error: cannot migrate {_redact(url)}: {getattr(exc, 'orig', None) or exc}", file=sys.stderr)
        return 1
    print("migrations done", flush=True)
    return 0


def _generate(args: argparse.Namespace) -> int:
    from engine.cli import generate_command

    return generate_command(args)


def _chat(args: argparse.Namespace) -> int:
    from backend.chat import client

    return client.main(args)


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvchat", description="kvchat: customer-service chat on a KV-reusing engine")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run the HTTP/websocket server")
    serve.add_argument("--host", default=None, help="bind address (default KVCHAT_HOST or 127.0.0.1)")
    serve.add_argument("--port", type=int, default=None, help="port (default KVCHAT_PORT or 8000)")
    serve.set_defaults(func=_serve)
    mig = sub.add_parser("migrate", help="upgrade the database schema (Alembic)")
    mig.add_argument("revision", nargs="?", default="head")
    mig.set_defaults(func=_migrate)
    from engine.cli import add_generate_arguments

    gen = sub.add_parser("generate", help="stream one completion from the engine to the terminal")
    add_generate_arguments(gen)
    gen.set_defaults(func=_generate)
    from backend.chat.client import add_arguments as add_chat_arguments

    chat = sub.add_parser("chat", help="talk to a running kvchat server from the terminal")
    add_chat_arguments(chat)
    chat.set_defaults(func=_chat)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # NOTE: alembic announces each of its plugins at INFO on every run; only the migrations themselves matter.
    logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        from engine.errors import EngineError

        if not isinstance(exc, EngineError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return code


if __name__ == "__main__":
    sys.exit(main())
