"""Which tool format a model writes, read from its chat template (the template is the model's own contract)."""

from __future__ import annotations

from backend.tools.types import ToolFamily


def detect_family(chat_template: str | None) -> ToolFamily:
    """Llama 3.1+ templates render tool results as ``ipython`` turns and know ``<|python_tag|>``; Qwen2.5/Qwen3 (and
    Hermes) templates write ``<tool_call>``. A template without tools (SmolLM2's, Llama 2's, Mistral v0.1's) gets
    the Hermes format as kvchat's fallback: its instructions are rendered into the system message and, when a call
    is required, the grammar holds the model to it."""
    template = chat_template or ""
    if "<|python_tag|>" in template or "ipython" in template:
        return ToolFamily.LLAMA3_JSON
    return ToolFamily.HERMES
