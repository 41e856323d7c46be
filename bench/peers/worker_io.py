"""The JSON-lines I/O both peer workers speak (stdlib only: imported from the peers' own venvs, next to the script)."""

from __future__ import annotations

import json
import queue
import sys
from typing import Any


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def read_stdin(inbox: queue.Queue[dict[str, Any] | None]) -> None:
    for line in sys.stdin:
        if line.strip():
            inbox.put(json.loads(line))
    inbox.put(None)
