"""Shared helpers for the benchmark programs: summaries, targets, a printed table, JSON with machine info, a PNG.

Every benchmark here is a program (STYLE.md, habit 13): it prints a table, writes JSON (with the machine it ran on)
and a plot, and names the exact command that reproduces it. Nothing here asserts performance.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True, slots=True)
class Summary:
    """Repeated samples of one measurement (seconds, tokens/s, ...)."""

    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Iterable[float]) -> Summary:
        values = tuple(float(s) for s in samples)
        if not values:
            raise ValueError("a summary needs at least one sample")
        return cls(values)

    @property
    def n(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "median": self.median,
            "mean": self.mean,
            "min": self.min,
            "max": self.max,
            "n": self.n,
            "samples": list(self.samples),
        }


@dataclass(frozen=True, slots=True)
class TargetResult:
    """One target: ``ratio`` compared with ``threshold`` by ``op`` ("<=" or ">=")."""

    key: str  # stable id, e.g. "followup_ttft_vs_hf"
    title: str  # what is compared, for the table
    ratio: float
    op: str
    threshold: float
    ours: str  # the measured value on our side, formatted with its unit
    peer: str  # the peer's value, formatted with its unit
    note: str = ""

    @property
    def met(self) -> bool:
        return self.ratio <= self.threshold if self.op == "<=" else self.ratio >= self.threshold

    @property
    def margin(self) -> float:
        """> 1 when met (how far past the threshold), < 1 when not; for the plot."""
        if self.ratio <= 0:
            return 0.0
        return self.threshold / self.ratio if self.op == "<=" else self.ratio / self.threshold

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"met": self.met, "margin": self.margin}


@dataclass(slots=True)
class BenchReport:
    """What a benchmark program returns: its targets, raw sections and the command that reproduces it."""

    name: str
    command: str
    targets: list[TargetResult] = field(default_factory=list)
    sections: dict[str, Any] = field(default_factory=dict)
    machine: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # section -> why it produced no result

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "command": self.command,
            "machine": self.machine,
            "targets": [t.to_json() for t in self.targets],
            "sections": self.sections,
            "errors": self.errors,
        }


def reproduce_command(module: str, argv: Sequence[str]) -> str:
    """The exact shell command that reruns ``python -m module argv`` from the repository root."""
    return " ".join([".venv/bin/python", "-m", module, *(shlex.quote(a) for a in argv)])


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(dtype: str | None = None, threads: int | None = None) -> dict[str, Any]:
    """Where and on what the numbers were measured (read-only git queries; nothing is changed)."""
    import torch

    try:
        import transformers

        transformers_version: str | None = transformers.__version__
    except ImportError:  # pragma: no cover - a dependency of the project
        transformers_version = None
    commit = _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    from engine.device import cpu_description, cpu_kind

    return {
        "cpu": cpu_model(),
        "cpu_kind": cpu_kind(),
        "cpu_description": cpu_description(),
        "cpu_count": os.cpu_count(),
        "torch_threads": threads if threads is not None else torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers_version,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "dtype": dtype,
        "git_commit": commit or None,
        "git_dirty": dirty,
        "load_average_1_5_15": [round(x, 2) for x in load],
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain fixed-width table (numbers right-aligned)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    numeric = [all(_is_number(row[i]) for row in rows) if rows else False for i in range(len(headers))]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    out = [line(list(headers)), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(s.rstrip() for s in out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out.extend("| " + " | ".join(_cell(v).replace("|", "\\|") for v in row) + " |" for row in rows)
    return "\n".join(out)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


TARGET_HEADERS = ("target", "ours", "peer", "ratio", "goal", "met")


def target_rows(targets: Sequence[TargetResult]) -> list[list[object]]:
    return [
        [t.title, t.ours, t.peer, f"{t.ratio:.3f}", f"{t.op} {t.threshold:g}", "met" if t.met else "NOT met"]
        for t in targets
    ]


def print_targets(targets: Sequence[TargetResult], file: Any = None) -> None:
    print(format_table(TARGET_HEADERS, target_rows(targets)), file=file or sys.stdout)


def write_json(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` as indented JSON (creating the folder); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=False, default=_json_default) + "\n")
    return path


def _json_default(value: object) -> object:
    if isinstance(value, Summary | TargetResult | BenchReport):
        return value.to_json()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def plot_targets(path: str | Path, targets: Sequence[TargetResult], title: str, subtitle: str = "") -> Path:
    """A horizontal bar per target: its margin (>= 1 means met), labelled with the ratio and the goal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(10, 0.6 * max(len(targets), 1) + 1.6))
    labels = [t.title for t in targets][::-1]
    margins = [t.margin for t in targets][::-1]
    colors = ["#2e7d32" if t.met else "#c62828" for t in targets][::-1]
    bars = ax.barh(range(len(targets)), margins, color=colors)
    ax.axvline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_yticks(range(len(targets)), labels, fontsize=8)
    ax.set_xlabel("margin over the goal (>= 1: met)  —  goal/ratio for '<=' targets, ratio/goal for '>='")
    for bar, t in zip(bars, list(targets)[::-1], strict=True):
        ax.text(
            bar.get_width(),
            bar.get_y() + bar.get_height() / 2,
            f"  {t.ratio:.2f} ({t.op} {t.threshold:g})",
            va="center",
            fontsize=8,
        )
    ax.set_xlim(0, max([*margins, 1.0]) * 1.35)
    ax.set_title(title + (f"\n{subtitle}" if subtitle else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class Progress:
    """A one-line text progress bar on stderr (plain lines when stderr is not a terminal)."""

    def __init__(self, total: int, width: int = 28, stream: Any = None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.width = width
        self.stream = stream or sys.stderr
        self.started = time.monotonic()
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, label: str, advance: int = 1) -> None:
        self.done = min(self.done + advance, self.total)
        filled = self.width * self.done // self.total
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = time.monotonic() - self.started
        text = f"[{bar}] {self.done}/{self.total} {elapsed:6.0f}s  {label}"
        if self._tty:
            self.stream.write("\r" + text.ljust(100)[:100])
            if self.done >= self.total:
                self.stream.write("\n")
        else:
            self.stream.write(text + "\n")
        self.stream.flush()
