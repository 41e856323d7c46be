"""``kvchat chat``: talk to a running kvchat server from the terminal over the chat websocket.

Each line you type is sent as a ``user.message``; the reply streams in. Ctrl-C while a reply streams cancels it;
``/quit``, Ctrl-D or Ctrl-C at the prompt quits. ``--session`` resumes a conversation (missed messages are replayed).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
import uuid
from typing import Any

import websockets
from websockets.asyncio.client import ClientConnection


def default_url() -> str:
    """Where ``kvchat serve`` listens with this environment's settings (a wildcard bind is reached on loopback)."""
    host = os.environ.get("KVCHAT_HOST", "127.0.0.1")
    host = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(host, host)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"ws://{host}:{os.environ.get('KVCHAT_PORT', '8000')}/ws/chat"


QUIT = "/quit"
DESCRIPTION = (
    "Talk to a running kvchat server from the terminal: each line you type is sent, and the reply streams in. "
    f"Ctrl-C while a reply streams cancels it; {QUIT}, Ctrl-D or Ctrl-C at the prompt quits."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = DESCRIPTION
    parser.add_argument(
        "--url",
        default=os.environ.get("KVCHAT_URL") or default_url(),
        help="the server's chat websocket (default: KVCHAT_URL, else ws://KVCHAT_HOST:KVCHAT_PORT/ws/chat, the address "
        "`kvchat serve` listens on)",
    )
    parser.add_argument(
        "--token", default=os.environ.get("KVCHAT_CHAT_TOKEN"), help="chat token (default $KVCHAT_CHAT_TOKEN)"
    )
    parser.add_argument("--session", default=None, help="resume this session id")
    parser.add_argument("--last-seq", type=int, default=0, help="replay messages after this seq when resuming")
    parser.add_argument("--quiet-usage", action="store_true", help="do not print token usage after replies")


def main(args: argparse.Namespace) -> int:
    if not args.token:
        print("error: a chat token is required (--token or KVCHAT_CHAT_TOKEN)", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_run(args))
    except (OSError, websockets.InvalidURI, websockets.InvalidHandshake) as exc:
        print(f"error: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1


async def _run(args: argparse.Namespace) -> int:
    async with websockets.connect(args.url, max_size=2**22) as ws:
        hello: dict[str, Any] = {"type": "hello", "token": args.token, "last_seq": args.last_seq}
        if args.session:
            hello["session_id"] = args.session
        await ws.send(json.dumps(hello))
        try:
            welcome = json.loads(await ws.recv())
        except websockets.ConnectionClosed as closed:
            reason = closed.rcvd.reason if closed.rcvd else "connection closed"
            print(f"error: the server refused the session: {reason}", file=sys.stderr)
            return 1
        if welcome["type"] == "error":  # e.g. "starting": the server is still loading its model
            print(f"error: the server refused the session: {welcome['message']}", file=sys.stderr)
            return 1
        print(f"session {welcome['session_id']} ({welcome['status']}); {QUIT} or Ctrl-D quits", file=sys.stderr)
        for m in welcome["messages"]:
            print(f"[{m['seq']}] {m['role']}: {m['content']}")
        while True:
            line = await asyncio.to_thread(_read_line)
            if line is None or line.strip() == QUIT:
                return 0
            if line.strip():
                await _turn(ws, line, args.quiet_usage)


def _read_line() -> str | None:
    try:
        return input("you> ")
    except (EOFError, KeyboardInterrupt):
        return None


async def _turn(ws: ClientConnection, text: str, quiet: bool) -> None:
    client_msg_id = uuid.uuid4().hex
    await ws.send(json.dumps({"type": "user.message", "client_msg_id": client_msg_id, "text": text}))
    try:
        await _print_reply(ws, client_msg_id, quiet)
    except (KeyboardInterrupt, asyncio.CancelledError):
        await ws.send(json.dumps({"type": "cancel", "client_msg_id": client_msg_id}))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(_print_reply(ws, client_msg_id, quiet), 5)


async def _print_reply(ws: ClientConnection, client_msg_id: str, quiet: bool) -> None:
    """The frames up to the bot's reply to ``client_msg_id`` (or the news that none is coming: a person has or will
    have the session). NOTE: ``bot> `` is written with the reply's first text, so a message no bot answers leaves no
    empty line; a person's messages that came while the customer typed are printed before it (``Dana> ...``)."""
    started = False
    while True:
        frame = json.loads(await ws.recv())
        kind = frame["type"]
        if kind == "message.delta" and frame["client_msg_id"] == client_msg_id:
            if not started:
                sys.stdout.write("bot> ")
                started = True
            sys.stdout.write(frame["text"])
            sys.stdout.flush()
        elif kind == "message.completed" and frame["client_msg_id"] == client_msg_id:
            if not started:
                sys.stdout.write("bot> " + frame["text"])
            usage = frame.get("usage")
            suffix = "" if frame["status"] == "complete" else f" [{frame['status']}]"
            print(suffix)
            if usage and not quiet:
                print(
                    f"  ({usage['prompt_tokens']} prompt tokens, {usage['cached_tokens']} cached, "
                    f"{usage['completion_tokens']} generated, TTFT {usage['ttft_ms']:.0f} ms)",
                    file=sys.stderr,
                )
            return
        elif kind == "agent.message":
            print(f"{frame['agent_name']}> {frame['text']}")
        elif kind == "session.agent":
            print(f"({frame.get('agent_name') or 'the agent'}: {frame['event'].replace('_', ' ')})", file=sys.stderr)
        elif kind == "session.queue":
            wait = frame.get("expected_wait_s")
            about = f", expected wait about {wait / 60:.0f} min" if wait is not None else ""
            print(f"(you are number {frame['position']} in the queue{about})", file=sys.stderr)
            return  # (it follows the status of a session waiting for a person)
        elif kind == "session.status":
            print(f"(session is now {frame['status'].replace('_', ' ')})", file=sys.stderr)
            if frame["status"] not in ("bot_active", "agent_requested"):
                return
        elif kind == "error":
            print(f"\n(error {frame['code']}: {frame['message']})", file=sys.stderr)
            if frame.get("client_msg_id") == client_msg_id:
                return
