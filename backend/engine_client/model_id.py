"""The id an OpenAI-compatible server (``/v1`` of the backend, ``kvchat engine-serve``) serves a model under."""

from __future__ import annotations

from pathlib import Path


def served_model_id(model: str) -> str:
    """The id ``/v1`` serves the configured ``model`` under (``KVCHAT_MODEL``: a name or a path)."""
    return "kvchat/" + Path(model).name.removesuffix(".gguf")
