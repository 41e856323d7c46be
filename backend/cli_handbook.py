"""``kvchat handbook load FILE`` and ``kvchat handbook show``: a tenant's handbook from the terminal.

A client of the running server's admin API (``PUT`` / ``GET /admin/tenant/handbook``), not of the database: an edit
must also free the cached blocks that hold the old text, and only the server holds the engine. The format follows
the file's suffix (``.md``: Markdown, ``.json``: ABCD-style JSON) unless ``--format`` says. Failures print one
``error:`` line and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import httpx

from backend.chat.client import default_url


def add_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``handbook load|show`` on the ``kvchat`` parser."""
    h = sub.add_parser("handbook", help="load or show a tenant's handbook (through the running server)")
    actions = h.add_subparsers(dest="action", required=True)
    load = actions.add_parser("load", help="replace the tenant's handbook with a Markdown or ABCD-style JSON file")
    load.add_argument("file", type=Path)
    load.add_argument("--format", choices=["markdown", "abcd"], default=None, help="default: from the file's suffix")
    _common(load)
    load.set_defaults(func=_load)
    show = actions.add_parser("show", help="list the handbook's sections")
    _common(show)
    show.set_defaults(func=_show)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=os.environ.get("KVCHAT_HTTP_URL") or _http_url(), help="the server")
    parser.add_argument(
        "--admin-key", default=os.environ.get("KVCHAT_ADMIN_KEY"), help="the tenant's admin key ($KVCHAT_ADMIN_KEY)"
    )


def _http_url() -> str:
    return default_url().replace("ws://", "http://", 1).removesuffix("/ws/chat")


def _load(args: argparse.Namespace) -> int:
    try:
        content = args.file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return _error(f"cannot read {args.file}: {exc}")
    fmt = args.format or ("abcd" if args.file.suffix.lower() == ".json" else "markdown")
    body = _call(args, "PUT", {"format": fmt, "content": content})
    if body is None:
        return 1
    print(
        f"handbook v{body['version']}: {body['sections']} sections ({len(body['added'])} added, "
        f"{len(body['changed'])} changed, {len(body['removed'])} removed, {body['kept']} kept); "
        f"{body['blocks_freed']} cached blocks freed"
    )
    return 0


def _show(args: argparse.Namespace) -> int:
    body = _call(args, "GET", None)
    if body is None:
        return 1
    print(f"handbook v{body['version']}: {len(body['sections'])} sections")
    for s in body["sections"]:
        print(f"  {s['title']}  ({len(s['text'])} characters, {len(s['examples'])} examples, v{s['version']})")
    return 0


def _call(args: argparse.Namespace, method: str, body: dict[str, Any] | None) -> dict[str, Any] | None:
    if not args.admin_key:
        _error("an admin key is required (--admin-key or KVCHAT_ADMIN_KEY)")
        return None
    logging.getLogger("httpx").setLevel(logging.WARNING)  # NOTE: its INFO line per request is noise here
    try:
        resp = httpx.request(
            method,
            f"{args.url}/admin/tenant/handbook",
            json=body,
            headers={"X-API-Key": args.admin_key},
            timeout=120,
        )
    except httpx.HTTPError as exc:
        _error(f"cannot reach {args.url}: {exc} (is `kvchat serve` running?)")
        return None
    if resp.status_code != 200:
        try:
            detail = resp.json().get("detail", resp.text)
        except ValueError:
            detail = resp.text
        _error(f"{resp.status_code}: {detail}")
        return None
    answer: dict[str, Any] = resp.json()
    return answer


def _error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 1
