"""The package metadata as setuptools reads it: no deprecation warning (a fresh ``make install`` printed three, one
per build step, for ``project.license`` written as a TOML table)."""

from __future__ import annotations

import warnings
from pathlib import Path

from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_pyproject_reads_without_a_deprecation_warning() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (the suite runs with warnings as errors anyway; this test says so itself)
        dist = apply_configuration(Distribution(), str(PYPROJECT))
    assert dist.metadata.license_expression == "Apache-2.0"
    assert dist.metadata.name == "kvchat"
