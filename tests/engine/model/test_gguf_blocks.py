"""Keeping a GGUF's quantized blocks beside its dense conversion: names, row order, and refusing what does not match."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from safetensors.torch import save_file

from engine.model import gguf_blocks

Q4_1 = gguf.GGMLQuantizationType.Q4_1
Q8_0 = gguf.GGMLQuantizationType.Q8_0
HEADS, KV_HEADS, HIDDEN = 4, 2, 64


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("token_embd.weight", "model.embed_tokens.weight"),
        ("output.weight", "lm_head.weight"),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.12.attn_output.weight", "model.layers.12.self_attn.o_proj.weight"),
        ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
        ("blk.3.attn_norm.weight", None),
        ("blk.3.ffn_gate_exps.weight", None),
        ("rope_freqs.weight", None),
    ],
)
def test_hf_names(name: str, expected: str | None) -> None:
    assert gguf_blocks.hf_name(name) == expected


def _llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows (the inverse of transformers' un-permutation)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _quantized(rows: int, qtype: gguf.GGMLQuantizationType, seed: int) -> np.ndarray:
    values = np.random.default_rng(seed).standard_normal((rows, HIDDEN)).astype(np.float32)
    return quantize(values, qtype)


def _model(tmp_path: Path) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A GGUF with q (permuted, Q4_1), k (permuted, Q4_1), v (Q8_0), o (F16: not packable), an embedding whose dense
    copy was altered (must be refused); and the dense folder transformers would have written."""
    q, k = _quantized(HIDDEN, Q4_1, 1), _quantized(HIDDEN // HEADS * KV_HEADS, Q4_1, 2)
    v, emb = _quantized(HIDDEN // HEADS * KV_HEADS, Q8_0, 3), _quantized(10, Q8_0, 4)
    o = np.random.default_rng(5).standard_normal((HIDDEN, HIDDEN)).astype(np.float16)
    stored = {
        "blk.0.attn_q.weight": (_llama_permute(q, HEADS), Q4_1),  # rows of blocks permute like rows of weights
        "blk.0.attn_k.weight": (_llama_permute(k, KV_HEADS), Q4_1),
        "blk.0.attn_v.weight": (v, Q8_0),
        "token_embd.weight": (emb, Q8_0),
    }
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in stored.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.add_tensor("blk.0.attn_output.weight", o)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    dense = {
        "model.layers.0.self_attn.q_proj.weight": dequantize(q, Q4_1),
        "model.layers.0.self_attn.k_proj.weight": dequantize(k, Q4_1),
        "model.layers.0.self_attn.v_proj.weight": dequantize(v, Q8_0),
        "model.layers.0.self_attn.o_proj.weight": o.astype(np.float32),
        "model.embed_tokens.weight": dequantize(emb, Q8_0) * 1.5,  # not what the blocks hold
    }
    folder = tmp_path / "dense"
    folder.mkdir()
    save_file({n: torch.from_numpy(np.ascontiguousarray(t)) for n, t in dense.items()}, folder / "model.safetensors")
    config = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "hidden_size": HIDDEN}
    (folder / "config.json").write_text(json.dumps(config))
    return path, folder, {"q": q, "k": k, "v": v}


def test_extract_keeps_matching_blocks_in_hf_row_order(tmp_path: Path) -> None:
    path, folder, raw = _model(tmp_path)
    assert gguf_blocks.extract(path, folder) == 3
    kept = gguf_blocks.read(folder)
    assert set(kept) == {f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv"}  # not o (F16), not the embedding
    for n, qtype, fmt in (("q", Q4_1, "q4_1"), ("k", Q4_1, "q4_1"), ("v", Q8_0, "q8_0")):
        blocks, got_fmt = kept[f"model.layers.0.self_attn.{n}_proj.weight"]
        assert got_fmt == fmt
        assert np.array_equal(blocks.numpy(), raw[n])  # un-permuted back to transformers' order
        assert np.array_equal(dequantize(blocks.numpy(), qtype), dequantize(raw[n], qtype))
    assert gguf_blocks.extract(path, folder) == -1  # once


def test_read_of_a_folder_without_blocks_or_with_a_damaged_file(tmp_path: Path) -> None:
    assert gguf_blocks.read(tmp_path) == {}
    (tmp_path / gguf_blocks.BLOCKS_FILE).parent.mkdir()
    (tmp_path / gguf_blocks.BLOCKS_FILE).write_bytes(b"not safetensors")
    assert gguf_blocks.read(tmp_path) == {}
