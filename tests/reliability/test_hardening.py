"""Issue 28's defects, each through a real ``kvchat serve`` process on Postgres (figures: ``bench/hardening.py``).

- A tenant rule that backtracks exponentially (``(a+)+$``) plus a 10,000-character message of a's: another tenant's
  message is acknowledged as fast as without it, and both get their replies (before: 29 a's stalled every tenant).
- A burst of hellos past the tenant's cap is refused with 1013, fast, and the server's memory returns.
- A burst of ``/v1`` streams past the engine's capacity is refused with 503, fast.
- A text frame of invalid UTF-8 is closed with 1007 and logged in one line, without a traceback, rate limited.
- ``/livez`` stays responsive while huge bracket prompts are sent to ``/v1``.

The bounds are generous (a loaded 2-core CI box): each is ten times what ``bench/hardening.py`` measures, and well
under what the defect cost. The long versions (the issue's sizes: 300 hellos at cap 200, 400 streams) run in
``make soak``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability.soak import only_in_soak

from bench.hardening import (
    Config,
    Server,
    bracket_load,
    fairness,
    hello_burst,
    livez_latencies,
    running_server,
    stream_burst,
)

pytestmark = pytest.mark.postgres

ACK_DELAY_BOUND_S = 0.100  # the issue's bound: another tenant's turn is not delayed more than this
HOSTILE_ACK_BOUND_S = 1.0  # the issue's bound: the hostile message gets its answer within a second
REFUSAL_P99_BOUND_S = 1.0  # the bench measures ~30 ms; the defect took 7.1 s
RSS_BOUND_MIB = 20.0  # the issue's bound: memory returns within 20 MB of its start after the burst
LIVEZ_P99_BOUND_S = 0.250  # idle p99 ~10 ms; the defect pushed it to 360 ms
SHORT = Config("", hellos=30, cap=20, streams=40, seqs=2, waiting=2, fairness_rounds=3, livez_samples=150)
LONG = Config("", hellos=300, cap=200, streams=400, seqs=32, waiting=256, fairness_rounds=5, livez_samples=300)


@pytest.fixture(scope="module")
def short_server(pg_module_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Config]]:
    config = dataclasses.replace(SHORT, database_url=pg_module_url)
    with running_server(config, tmp_path_factory.mktemp("hardening")) as server:
        yield server, config


def _p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[98] if len(values) > 1 else values[0]


def test_a_redos_rule_and_a_long_message_do_not_hold_up_another_tenant(short_server: tuple[Server, Config]) -> None:
    server, config = short_server
    result = asyncio.run(fairness(server, config.database_url, config.fairness_rounds))
    alone, beside = result.alone.ack.values, result.beside_redos.ack.values
    print(f"\nB's ack alone {alone}, beside A's ReDoS message {beside}; A's ack {result.redos.ack.values}")
    assert statistics.median(beside) - statistics.median(alone) < ACK_DELAY_BOUND_S
    assert max(result.redos.ack.values) < HOSTILE_ACK_BOUND_S
    assert result.redos.outcomes == {"reply": config.fairness_rounds}  # A's message is answered too
    assert result.beside_redos.outcomes == {"reply": config.fairness_rounds}


def test_a_hello_burst_past_the_cap_is_refused_fast_and_memory_returns(short_server: tuple[Server, Config]) -> None:
    server, config = short_server
    _hello_burst(server, config)


def test_a_stream_burst_past_the_engine_capacity_is_refused_503_fast(short_server: tuple[Server, Config]) -> None:
    server, config = short_server
    _stream_burst(server, config)


def test_an_invalid_utf8_frame_is_closed_1007_and_logged_once_without_a_traceback(
    short_server: tuple[Server, Config],
) -> None:
    server, _ = short_server
    codes = asyncio.run(_invalid_utf8_frames(server.port, 5))
    assert codes == [1007] * 5
    log = server.log_path.read_text(errors="replace")
    assert "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "not UTF-8" in line]
    assert len(lines) == 1, lines  # five frames within the 10 s window: one line


def test_livez_stays_responsive_while_huge_bracket_prompts_arrive(short_server: tuple[Server, Config]) -> None:
    server, config = short_server
    with bracket_load(server.http) as statuses:
        loaded = livez_latencies(server.http, config.livez_samples)
    print(f"\n/livez under bracket prompts: p99 {_p99(loaded.values) * 1000:.1f} ms; answers {statuses}")
    assert _p99(loaded.values) < LIVEZ_P99_BOUND_S
    assert set(statuses) == {"400"}  # each one refused as too long for the context, none failed


@pytest.mark.soak
@only_in_soak
def test_the_issue_sized_bursts_are_refused_fast_and_memory_returns(pg_url: str, tmp_path: Path) -> None:
    config = dataclasses.replace(LONG, database_url=pg_url)
    with running_server(config, tmp_path) as server:
        # NOTE: the first burst of this size grows RSS once, by ~27 MiB (the database pool fills, the allocator keeps
        # its arenas: docs/reliability.md); what must not happen is growth with every burst.
        asyncio.run(hello_burst(server.ws, config.hellos))
        for _ in range(3):
            _hello_burst(server, config)
        _stream_burst(server, config)


def _hello_burst(server: Server, config: Config) -> None:
    start = server.rss_mib()
    result = asyncio.run(hello_burst(server.ws, config.hellos))
    assert (len(result.welcomed.values), len(result.refused.values), result.other) == (
        config.cap,
        config.hellos - config.cap,
        [],
    )
    assert result.reasons == {f"too many connections for this tenant (limit {config.cap})": config.hellos - config.cap}
    assert _p99(result.refused.values) < REFUSAL_P99_BOUND_S
    asyncio.run(asyncio.sleep(3.0))  # (the server closes its side of the held sockets)
    assert server.rss_mib() - start < RSS_BOUND_MIB


def _stream_burst(server: Server, config: Config) -> None:
    result = asyncio.run(stream_burst(server.http, config.streams))
    assert result.other == {}
    assert len(result.streamed.values) + len(result.refused.values) == config.streams
    assert len(result.refused.values) >= config.streams - 2 * (config.seqs + config.waiting)
    assert _p99(result.refused.values) < REFUSAL_P99_BOUND_S


async def _invalid_utf8_frames(port: int, count: int) -> list[int]:
    return list(await asyncio.gather(*(_invalid_utf8_frame(port) for _ in range(count))))


async def _invalid_utf8_frame(port: int) -> int:
    """A websocket handshake by hand, then one masked text frame that is not UTF-8; returns the close code."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    writer.write(
        f"GET /ws/chat HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode()
    )
    await reader.readuntil(b"\r\n\r\n")
    payload, mask = b'\xff\xfe{"type": "hello"}', os.urandom(4)
    writer.write(bytes([0x81, 0x80 | len(payload)]) + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))
    await writer.drain()
    frame = await asyncio.wait_for(reader.readexactly(4), 30)  # a close frame: opcode, length, 2-byte code
    writer.close()
    assert frame[0] == 0x88, frame
    return int.from_bytes(frame[2:4], "big")
