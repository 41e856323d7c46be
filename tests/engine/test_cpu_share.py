"""engine.cpu_share: the step's OpenMP width from what the rest of the machine uses, and that the width never changes a
bit of a forward pass where the engine lets it move."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.cpu_share import RAISE_AFTER, CpuShare, Window, decide, machine_busy_s
from engine.device import cpu_supports_bf16
from engine.llm_engine import LLMEngine
from engine.model import kernels
from engine.model_runner import BatchItem, ModelRunner
from engine.sampling_params import SamplingParams
from engine.testing import build_tiny_model


def test_others_are_the_busy_cores_the_engine_did_not_use() -> None:
    assert Window(wall_s=0.2, busy_s=0.4, own_s=0.2).others() == pytest.approx(1.0)
    assert Window(wall_s=0.2, busy_s=0.1, own_s=0.2).others() == 0.0  # (coarse ticks: never below 0)
    assert Window(wall_s=0.0, busy_s=0.1, own_s=0.0).others() == 0.0


@pytest.mark.parametrize(
    ("cores", "most", "others", "want"),
    [
        (2, 2, 0.0, 2),
        (2, 2, 0.49, 2),
        (2, 2, 0.51, 1),
        (2, 2, 1.0, 1),
        (2, 2, 3.0, 1),
        (16, 8, 4.2, 8),
        (16, 16, 4.2, 12),
    ],
)
def test_the_width_is_the_cores_the_others_leave(cores: int, most: int, others: float, want: int) -> None:
    assert decide(cores, most, most, others, 0)[0] == min(want, most)


def test_the_width_drops_at_once_and_grows_after_windows_in_a_row() -> None:
    assert decide(2, 2, 2, 1.0, 0) == (1, 0)
    width, votes = 1, 0
    for _ in range(RAISE_AFTER - 1):
        width, votes = decide(2, 2, width, 0.0, votes)
        assert width == 1
    assert decide(2, 2, width, 0.0, votes) == (2, 0)
    assert decide(2, 2, 1, 1.0, RAISE_AFTER - 1) == (1, 0)  # a busy window resets the count


class _Machine:
    """A fake machine: busy core-seconds and the step thread's CPU time, advanced by the test."""

    def __init__(self) -> None:
        self.now = self.busy = self.own = 0.0

    def run(self, seconds: float, others: float, width: int) -> None:
        self.now += seconds
        self.own += seconds
        self.busy += seconds * (others + width)


def _share(machine: _Machine) -> CpuShare:
    return CpuShare(2, 2, window_s=0.2, busy=lambda: machine.busy, own=lambda: machine.own, clock=lambda: machine.now)


@pytest.fixture
def torch_threads() -> Iterator[int]:
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_a_busy_neighbour_takes_a_thread_and_its_leaving_gives_it_back(torch_threads: int) -> None:
    machine = _Machine()
    share = _share(machine)
    widths = []
    for others in [0.0] * 3 + [1.0] * 4 + [0.0] * 5:
        widths.append(share.apply())
        machine.run(0.25, others, share.width)
    assert widths[:4] == [2, 2, 2, 2]  # (the first busy window closes at the next step)
    assert widths[4:8] == [1, 1, 1, 1]
    assert widths[-1] == 2 and widths[8] == 1  # back after RAISE_AFTER quiet windows, not at the first
    assert share.changes == 2
    assert torch.get_num_threads() == share.width


def test_the_busy_time_is_the_affinity_cpus_of_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    lines = ["cpu  300 0 0 900 0 0 0 0 0 0", "cpu0 100 10 50 900 40 5 5 20 0 0", "cpu1 7 0 0 1 0 0 0 0 0 0"]
    stat.write_text("\n".join([*lines, "cpu2 1000 0 0 0 0 0 0 0 0 0", "intr 5 5", "cpu3 9 9 9 9 9 9 9 9 9 9"]) + "\n")
    tick = os.sysconf("SC_CLK_TCK")
    assert machine_busy_s(str(stat), frozenset({0, 1})) == pytest.approx((190 + 7) / tick)
    assert machine_busy_s(str(stat), frozenset({2})) == pytest.approx(1000 / tick)
    assert machine_busy_s(str(stat), frozenset({3})) is None  # (past the CPU lines)
    stat.write_text("garbage\n")
    assert machine_busy_s(str(stat), frozenset({0})) is None
    assert machine_busy_s(str(tmp_path / "missing")) is None
    assert machine_busy_s() is not None  # this machine's


def test_the_width_stays_fixed_where_it_could_change_bits_or_there_is_one_thread() -> None:
    assert CpuShare.for_engine(2, same_bits=False) is None
    assert CpuShare.for_engine(1, same_bits=True) is None


DTYPES = ["float32"] + (["bfloat16"] if cpu_supports_bf16() else [])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_forward_pass_gives_the_same_bits_on_one_thread_and_on_two(
    tmp_path: Path, dtype: str, torch_threads: int
) -> None:
    """Where the engine moves the width (the C kernels), every kind of row: a prompt chunk over a cached prefix, decode
    rows of sequences of different lengths, a decode row with drafts."""
    dt = getattr(torch, dtype)
    if not kernels.same_bits_at_any_width(dt):
        pytest.skip(f"the width stays fixed for {dtype} on this CPU")
    model = build_tiny_model(tmp_path / "m", hidden_size=256, num_heads=4, num_kv_heads=2, seed=3)
    runner = ModelRunner(str(model), num_blocks=96, block_size=16, device="cpu", dtype=dtype)
    ids = [(i * 37) % 200 + 5 for i in range(600)]
    tables = [list(range(0, 40)), list(range(40, 60)), list(range(60, 96))]

    def passes() -> list[torch.Tensor]:
        runner.forward([BatchItem(ids[:500], 0, tables[0], False, prompt=True)])
        runner.forward([BatchItem(ids[:200], 0, tables[1], False, prompt=True)])
        return [
            runner.forward([BatchItem(ids[500:540], 500, tables[0], True, prompt=True)]),
            runner.forward(
                [BatchItem(ids[540:541], 540, tables[0], True), BatchItem(ids[200:201], 200, tables[1], True)]
            ),
            runner.forward([BatchItem(ids[541:551], 541, tables[0], True, verify=True)]),
            # a lone decode row over 2 parts of the decode kernel: its work items differ between 1 and 2 threads
            runner.forward([BatchItem(ids[200:201], 200, tables[1], True)]),
            runner.forward([BatchItem(ids[:300], 0, tables[2], True, prompt=True)]),
        ]

    torch.set_num_threads(2)
    two = passes()
    torch.set_num_threads(1)
    one = passes()
    for a, b in zip(two, one, strict=True):
        assert torch.equal(a, b)


def test_the_engine_steps_at_the_width_its_share_chose(tiny_model_dir: Path, torch_threads: int) -> None:
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", device="cpu", max_kv_memory_mb=8)
    engine = LLMEngine(config)
    engine.load()
    machine = _Machine()
    share = _share(machine)
    engine.core.cpu_share = share
    seen: list[int] = []

    def hook(items: list[BatchItem], logits: torch.Tensor) -> None:
        seen.append(torch.get_num_threads())
        machine.run(0.25, 1.5, share.width)  # a neighbour holds more than a core while the engine steps

    engine.core.runner.fault_hook = hook
    [out] = engine.generate_sync(["hello there"], SamplingParams(max_tokens=8, temperature=0.0))
    assert seen[0] == 2 and set(seen[2:]) == {1}
    engine.core.cpu_share = None
    engine.core.runner.fault_hook = None
    torch.set_num_threads(2)
    [again] = engine.generate_sync(["hello there"], SamplingParams(max_tokens=8, temperature=0.0))
    assert again.token_ids == out.token_ids  # (the tiny model's fp32 panels: the same bits at any width)
