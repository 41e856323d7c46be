"""Short versions of the reliability suites run in every ``make test``; long ones (marked ``soak``) only with
``KVCHAT_SOAK=1`` (``make soak``). ``KVCHAT_RELIABILITY_ROUNDS`` overrides how many crashes/restarts either runs."""

from __future__ import annotations

import os

import pytest

only_in_soak = pytest.mark.skipif(os.environ.get("KVCHAT_SOAK") != "1", reason="soak run: KVCHAT_SOAK=1 (make soak)")


def rounds(default: int) -> int:
    """How many crashes/restarts to run: ``KVCHAT_RELIABILITY_ROUNDS`` when set, else ``default``."""
    return int(os.environ.get("KVCHAT_RELIABILITY_ROUNDS", default))
