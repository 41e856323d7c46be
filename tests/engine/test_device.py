"""The CPU kind every benchmark figure names (engine.device.cpu_kind / cpu_description)."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.device import cpu_description, cpu_kind


@pytest.mark.parametrize(
    ("flags", "kind"),
    [
        ({"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile"}, "AMX"),
        ({"avx2", "fma", "avx512f", "avx512_bf16"}, "AVX-512 + AVX512-BF16"),
        ({"avx2", "fma", "avx512f"}, "AVX-512"),
        ({"avx2", "fma"}, "AVX2 + FMA"),
        ({"sse4_2"}, "no vector kernels"),
    ],
)
def test_the_kind_is_the_most_capable_set_of_flags_present(flags: set[str], kind: str) -> None:
    assert cpu_kind(frozenset(flags)) == kind


def test_the_description_names_kind_model_family(tmp_path: Path) -> None:
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
        "model name\t: AMD EPYC\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n\nprocessor\t: 1\n"
    )
    assert cpu_description(str(cpuinfo)) == "AVX-512 + AVX512-BF16: AMD EPYC (family 26, model 2)"


def test_an_unreadable_cpuinfo_is_an_unknown_cpu(tmp_path: Path) -> None:
    assert cpu_description(str(tmp_path / "absent")) == "no vector kernels: unknown CPU"
