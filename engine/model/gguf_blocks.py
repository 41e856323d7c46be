"""The quantized blocks of a GGUF's linear weights, kept beside its dense safetensors conversion.

``extract(gguf, folder)`` runs once per converted model (``loader.convert_gguf``) and writes
``<folder>/packed/gguf_blocks.safetensors``: one uint8 tensor ``[out, in // 32 * bytes per block]`` per HF weight
name, in a format ``engine.model.packed`` can compute with (q4_0, q4_1, q8_0; other formats are skipped). ``read``
returns them for ``ModelWeights.with_packed``.

Every extracted tensor is checked against the dense conversion: its gguf dequantization must equal the dense weight
bit for bit (that is also how the row order of q/k is found: llama.cpp stores them permuted for its RoPE layout and
transformers un-permutes them while converting). A mismatch skips the tensor, never the model.
"""

from __future__ import annotations

import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

log = logging.getLogger(__name__)

BLOCKS_FILE = Path("packed") / "gguf_blocks.safetensors"
_FORMATS = {"Q4_0": "q4_0", "Q4_1": "q4_1", "Q8_0": "q8_0"}  # ggml type name -> engine.model.packed format
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
PackedBlocks = dict[str, tuple[torch.Tensor, str]]  # HF weight name -> (uint8 block rows, format)


def hf_name(gguf_name: str) -> str | None:
    """The transformers name of a GGUF linear weight (llama-family layout), or None for anything else."""
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def extract(gguf: Path, folder: Path) -> int:
    """Write ``folder/BLOCKS_FILE`` from ``gguf`` (no-op if present); returns how many weights were packed."""
    target = folder / BLOCKS_FILE
    if target.is_file():
        return -1
    import gguf as gguf_py
    from safetensors.torch import save_file

    config = json.loads((folder / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    reader = gguf_py.GGUFReader(str(gguf))
    tensors: dict[str, torch.Tensor] = {}
    formats: dict[str, str] = {}
    with safe_open(str(folder / "model.safetensors"), framework="np") as dense_file:
        names = set(dense_file.keys())
        for tensor in reader.tensors:
            name = hf_name(tensor.name)
            fmt = _FORMATS.get(tensor.tensor_type.name)
            if name is None or fmt is None or name not in names:
                continue
            blocks = np.ascontiguousarray(tensor.data)
            dense = dense_file.get_tensor(name)
            rows = _matching_rows(blocks, tensor.tensor_type, dense, _permutations(name, heads, kv_heads))
            if rows is None:
                log.warning("GGUF tensor %s does not dequantize to %s; it stays dense", tensor.name, name)
                continue
            tensors[name] = torch.from_numpy(blocks[rows].copy())
            formats[name] = fmt
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=target.name + ".tmp")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"formats": json.dumps(formats), "source": gguf.name})
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)
    log.info("kept the quantized blocks of %d GGUF weights for packed matmuls", len(tensors))
    return len(tensors)


def _permutations(name: str, heads: int, kv_heads: int) -> list[Callable[[int], np.ndarray]]:
    """Candidate row orders: as stored, and (q/k only) transformers' un-permutation of llama.cpp's RoPE layout."""
    candidates: list[Callable[[int], np.ndarray]] = [np.arange]
    n_head = heads if ".q_proj." in name else kv_heads if ".k_proj." in name else 0
    if n_head:

        def unpermute(rows: int) -> np.ndarray:
            if rows % (2 * n_head):
                return np.arange(rows)  # not a RoPE layout llama.cpp could have permuted
            half = rows // n_head // 2
            return np.arange(rows).reshape(n_head, half, 2).swapaxes(2, 1).reshape(rows)

        candidates.append(unpermute)
    return candidates


def _matching_rows(
    blocks: np.ndarray, qtype: object, dense: np.ndarray, orders: list[Callable[[int], np.ndarray]]
) -> np.ndarray | None:
    from gguf.quants import dequantize

    if blocks.ndim != 2 or blocks.shape[0] != dense.shape[0]:
        return None
    values = dequantize(blocks, qtype)  # type: ignore[arg-type]
    if values.shape != dense.shape:
        return None
    for order in orders:
        rows = order(dense.shape[0])
        if np.array_equal(values[rows], dense):
            return rows
    return None


def read(folder: Path) -> PackedBlocks:
    """The packed blocks of ``folder`` (empty when it has none or the file is unreadable)."""
    path = folder / BLOCKS_FILE
    if not path.is_file():
        return {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            formats = json.loads((handle.metadata() or {}).get("formats", "{}"))
            names = [name for name in handle.keys() if name in formats]  # noqa: SIM118 - not a dict
            return {name: (handle.get_tensor(name), str(formats[name])) for name in names}
    except Exception as exc:  # noqa: BLE001 - a damaged derived file must never stop a model from loading
        log.warning("ignoring unreadable %s: %s", path, exc)
        return {}
