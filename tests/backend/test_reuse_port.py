"""``KVCHAT_REUSE_PORT``: several ``kvchat serve`` workers listen on one port, and the kernel spreads connections
over them; a port held by a process without the option is refused with one clear error."""

from __future__ import annotations

import socket

import pytest

from backend.cli import StartupError, shared_port_socket
from support.server import free_port


def test_two_workers_bind_one_port_and_both_take_connections() -> None:
    port = free_port()
    first, second = shared_port_socket("127.0.0.1", port), shared_port_socket("127.0.0.1", port)
    try:
        for sock in (first, second):
            sock.listen(64)
            sock.settimeout(0)
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(64)]
        accepted = {id(first): 0, id(second): 0}
        for sock in (first, second):
            while True:
                try:
                    conn, _ = sock.accept()
                except BlockingIOError:
                    break
                conn.close()
                accepted[id(sock)] += 1
        for client in clients:
            client.close()
    finally:
        first.close()
        second.close()
    assert sum(accepted.values()) == 64
    assert min(accepted.values()) > 0  # (64 connections all hashed onto one socket: odds of 2 in 2^64)


def test_a_port_held_without_the_option_is_refused_in_one_line() -> None:
    with socket.socket() as plain:
        plain.bind(("127.0.0.1", 0))
        plain.listen(1)
        port = plain.getsockname()[1]
        with pytest.raises(StartupError, match=f"cannot listen on 127.0.0.1:{port}: held by a process"):
            shared_port_socket("127.0.0.1", port)
