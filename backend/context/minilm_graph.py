"""The all-MiniLM-L6-v2 encoder as an ONNX graph, built in memory from the weights ``minilm.py`` loads.

One graph, the same arithmetic as ``MiniLMEncoder.reference_forward`` (the numpy forward it is tested against):
inputs ``input_ids`` (int64, batch x width) and ``attention_mask`` (float32, 1 for a real token); output
``embeddings`` (float32, batch x 384), the masked mean of the last hidden states, L2-normalised. Each layer is written
the way the PyTorch export of BERT writes it (MatMul + Add, Softmax over scores plus a mask bias, GELU as
``x * 0.5 * (1 + Erf(x / sqrt 2))``, LayerNormalization), so ONNX Runtime's own graph optimizer (level ``ALL``)
fuses what it knows: the scaled score MatMul (``FusedMatMul``) and bias + GELU (``BiasGelu``). Writing its contrib
``Attention`` and ``SkipLayerNormalization`` ops by hand was no faster for one short message (±5 %, Zen 4), so the
graph keeps to standard ops. No file is written and nothing is downloaded; ``onnx`` is imported only while the graph
is built, and the model proto lives only until the session is made.

NOTE: one intra-op and one inter-op thread. A turn encodes one short message (~30 rows) while the server's event
loop, the engine and the database share the same few cores; a second thread only waits for a busy core (the same
reason the numpy forward ran its BLAS on one thread).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import onnxruntime as ort
from numpy.typing import NDArray

if TYPE_CHECKING:
    from onnx import ModelProto, NodeProto, TensorProto

OPSET = 18  # LayerNormalization from opset 17; every Reduce* takes its axes as an input from 18

Weights = Mapping[str, NDArray[np.float32]]


def encoder_session(w: Weights, layers: int, heads: int, eps: float) -> ort.InferenceSession:
    """An ONNX Runtime session (CPU, one thread, every graph optimization) that runs the encoder on ``w``."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # NOTE: no arena: it keeps the largest batch's buffers for good (~300 MB after 32 texts of 256 tokens) for a few
    # per cent of speed on one message
    options.enable_cpu_mem_arena = False
    model = encoder_graph(w, layers, heads, eps).SerializeToString()
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    # NOTE: ORT's Python wrapper keeps the model's bytes (90 MB of weights, a second copy) only to rebuild the
    # session when it falls back to another execution provider, which a CPU-only session never does; the session
    # itself holds its own copy. Measured: 111 MB held instead of 198 MB.
    session._model_bytes = None
    return session


def encoder_graph(w: Weights, layers: int, heads: int, eps: float) -> ModelProto:
    """The ONNX model of the encoder (``w`` as ``minilm._prepared`` lays it out: fused QKV, ``*_t`` matrices)."""
    g = _Graph(w, eps)
    p = "embeddings."
    width = g.op("Gather", g.op("Shape", "input_ids"), g.const("one", np.array(1, dtype=np.int64)))
    positions = g.op(
        "Slice",
        g.weight(p + "position_embeddings.weight"),
        g.const("zero_1d", np.array([0], dtype=np.int64)),
        g.op("Unsqueeze", width, g.const("axis0", np.array([0], dtype=np.int64))),
    )
    words = g.op("Gather", g.weight(p + "word_embeddings.weight"), "input_ids")
    types = g.const("token_type_0", w[p + "token_type_embeddings.weight"][0])
    x = g.norm(g.op("Add", g.op("Add", words, positions), types), p + "LayerNorm")
    # NOTE: the numpy forward's bias, (1 - mask) * float32.min, broadcast over heads and query rows
    inverted = g.op("Sub", g.const("one_f", np.array(1.0, dtype=np.float32)), "attention_mask")
    bias = g.op("Mul", inverted, g.const("min_f", np.array(np.finfo(np.float32).min, dtype=np.float32)))
    bias = g.op("Unsqueeze", bias, g.const("axes12", np.array([1, 2], dtype=np.int64)))
    for layer in range(layers):
        x = _layer(g, x, bias, heads, f"encoder.layer.{layer}.")
    mask = g.op("Unsqueeze", "attention_mask", g.const("axis_last", np.array([-1], dtype=np.int64)))
    axis1 = g.const("axis1", np.array([1], dtype=np.int64))
    summed = g.op("ReduceSum", g.op("Mul", x, mask), axis1, keepdims=0)
    count = g.op("Max", g.op("ReduceSum", "attention_mask", axis1, keepdims=1), g.const("tiny_count", np.float32(1e-9)))
    pooled = g.op("Div", summed, count)
    norm = g.op("ReduceL2", pooled, g.const("axis_m1", np.array([-1], dtype=np.int64)), keepdims=1)
    g.op("Div", pooled, g.op("Max", norm, g.const("tiny_norm", np.float32(1e-12))), out="embeddings")
    return g.model()


def _layer(g: _Graph, x: str, bias: str, heads: int, p: str) -> str:
    hidden = g.w[p + "attention.output.dense.weight_t"].shape[0]
    dim = hidden // heads
    qkv = g.linear(x, p + "attention.self.qkv")
    thirds = g.const("thirds", np.array([hidden] * 3, dtype=np.int64))
    q, k, v = g.ops("Split", qkv, thirds, outputs=[f"{p}{n}" for n in "qkv"], axis=-1)
    split_heads = g.const("split_heads", np.array([0, 0, heads, dim], dtype=np.int64))
    q = g.op("Transpose", g.op("Reshape", q, split_heads), perm=[0, 2, 1, 3])
    k = g.op("Transpose", g.op("Reshape", k, split_heads), perm=[0, 2, 3, 1])
    v = g.op("Transpose", g.op("Reshape", v, split_heads), perm=[0, 2, 1, 3])
    scale = g.const("sqrt_dim", np.array(np.sqrt(dim), dtype=np.float32))
    scores = g.op("Add", g.op("Div", g.op("MatMul", q, k), scale), bias)
    context = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
    merged = g.op(
        "Reshape",
        g.op("Transpose", context, perm=[0, 2, 1, 3]),
        g.const("merge_heads", np.array([0, 0, hidden], dtype=np.int64)),
    )
    x = g.norm(g.op("Add", x, g.linear(merged, p + "attention.output.dense")), p + "attention.output.LayerNorm")
    inner = g.linear(x, p + "intermediate.dense")
    erf = g.op("Erf", g.op("Div", inner, g.const("sqrt2", np.array(np.sqrt(2.0), dtype=np.float32))))
    one, half = g.const("one_f", np.array(1.0, dtype=np.float32)), g.const("half", np.array(0.5, dtype=np.float32))
    gelu = g.op("Mul", g.op("Mul", inner, g.op("Add", erf, one)), half)
    return g.norm(g.op("Add", x, g.linear(gelu, p + "output.dense")), p + "output.LayerNorm")


class _Graph:
    """Collects nodes and initializers; each ``op`` returns its output's name (fresh unless ``out`` is given)."""

    def __init__(self, w: Weights, eps: float) -> None:
        self.w = w
        self.eps = eps
        self.nodes: list[NodeProto] = []
        self.initializers: dict[str, TensorProto] = {}

    def op(self, kind: str, *inputs: str, out: str | None = None, **attrs: Any) -> str:
        return self.ops(kind, *inputs, outputs=[out or f"{kind.lower()}_{len(self.nodes)}"], **attrs)[0]

    def ops(self, kind: str, *inputs: str, outputs: list[str], **attrs: Any) -> list[str]:
        from onnx import helper

        self.nodes.append(helper.make_node(kind, list(inputs), outputs, **attrs))
        return outputs

    def const(self, name: str, value: NDArray[np.generic] | np.generic) -> str:
        from onnx import numpy_helper

        if name not in self.initializers:
            self.initializers[name] = numpy_helper.from_array(np.asarray(value), name)
        return name

    def weight(self, name: str) -> str:
        return self.const(name, self.w[name])

    def linear(self, x: str, name: str) -> str:
        return self.op("Add", self.op("MatMul", x, self.weight(name + ".weight_t")), self.weight(name + ".bias"))

    def norm(self, x: str, name: str) -> str:
        scale, shift = self.weight(name + ".weight"), self.weight(name + ".bias")
        return self.op("LayerNormalization", x, scale, shift, axis=-1, epsilon=self.eps)

    def model(self) -> ModelProto:
        from onnx import TensorProto as proto
        from onnx import helper

        graph = helper.make_graph(
            self.nodes,
            "all-MiniLM-L6-v2",
            [
                helper.make_tensor_value_info("input_ids", proto.INT64, ["batch", "width"]),
                helper.make_tensor_value_info("attention_mask", proto.FLOAT, ["batch", "width"]),
            ],
            [helper.make_tensor_value_info("embeddings", proto.FLOAT, ["batch", None])],
            list(self.initializers.values()),
        )
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], ir_version=9)
