"""Our own Llama-family forward pass over the paged KV pool (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

Written for low per-step overhead on CPU rather than as a module tree: weights are plain tensors, q/k/v are fused into
one matrix and gate/up into another at load time (two matmuls fewer per layer), RoPE cos/sin come from tables built
once, the whole batch (every sequence's new tokens, concatenated) goes through each linear layer as one matmul, and
the LM head runs only on the rows whose logits are needed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.errors import ModelLoadError
from engine.model import bf16_linear, cpu_kernels, huge_pages, kernels
from engine.model.bf16_linear import Bf16Panels
from engine.model.linear import Weight, dense, linear
from engine.model.paged_attention import AttentionPlan, attend, write_kv
from engine.model.panel_linear import PanelWeight, to_panels
from engine.model.quant import quantize
from engine.model.spec import ModelSpec, RopeSpec

TensorGetter = Callable[[str], torch.Tensor | None]


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None
    o: Weight
    o_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3
    k_norm: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor
    layers: list[LayerWeights]
    norm: torch.Tensor
    lm_head: Weight  # the same tensor as ``embed`` when the embeddings are tied (unless quantized or pair panels)

    @classmethod
    def from_tensors(cls, spec: ModelSpec, get: TensorGetter, dtype: torch.dtype, device: torch.device) -> ModelWeights:
        """Build from HF-named tensors; ``get(name)`` returns the tensor or None when the checkpoint lacks it."""

        def need(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            tensor = get(name)
            if tensor is None:
                raise ModelLoadError(f"checkpoint is missing tensor {name!r}")
            if tuple(tensor.shape) != shape:
                raise ModelLoadError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}")
            return tensor.to(device=device, dtype=dtype)

        embed = need("model.embed_tokens.weight", (spec.vocab_size, spec.hidden_size))
        lm_head = embed
        if not spec.tie_word_embeddings or get("lm_head.weight") is not None:
            lm_head = need("lm_head.weight", (spec.vocab_size, spec.hidden_size))
        layers = [_layer(spec, f"model.layers.{i}.", need, get, dtype, device) for i in range(spec.num_layers)]
        return cls(embed, layers, need("model.norm.weight", (spec.hidden_size,)), lm_head)

    def quantized_int8(self) -> ModelWeights:
        """The same model with every linear layer (and the LM head) as weight-only int8 (see ``quant.py``)."""

        def q(w: Weight) -> Weight:
            return quantize(dense(w))

        layers = [
            dataclasses.replace(layer, qkv=q(layer.qkv), o=q(layer.o), gate_up=q(layer.gate_up), down=q(layer.down))
            for layer in self.layers
        ]
        return ModelWeights(self.embed, layers, self.norm, q(self.lm_head))

    def in_huge_pages(self) -> ModelWeights:
        """The same weights with the embedding table and the dense linear weights (or their panels, bf16 pairs or
        fp32) copied into transparent huge pages (``huge_pages.py``; CPU tensors): the table in a mapping of its own (a
        tied LM head stays that same tensor), the linear weights in another, which goes when they are replaced
        (``quantized_int8``) and dropped."""
        weights = self._linear_weights()
        linear = [w for w in weights if isinstance(w, torch.Tensor) and w is not self.embed]
        linear += [w.panels for w in weights if isinstance(w, Bf16Panels | PanelWeight)]
        linear += [w.wide for w in weights if isinstance(w, Bf16Panels) and w.wide is not None]
        moved = {id(t): c for t, c in zip(linear, huge_pages.copies(linear), strict=True)}
        moved[id(self.embed)] = huge_pages.copies([self.embed])[0]

        def m(w: Weight) -> Weight:
            if isinstance(w, Bf16Panels):
                return Bf16Panels(moved[id(w.panels)], w.out_features, None if w.wide is None else moved[id(w.wide)])
            if isinstance(w, PanelWeight):
                return dataclasses.replace(w, panels=moved[id(w.panels)])
            return moved.get(id(w), w) if isinstance(w, torch.Tensor) else w

        layers = [
            dataclasses.replace(layer, qkv=m(layer.qkv), o=m(layer.o), gate_up=m(layer.gate_up), down=m(layer.down))
            for layer in self.layers
        ]
        return ModelWeights(moved[id(self.embed)], layers, self.norm, m(self.lm_head))

    def with_panels(self) -> ModelWeights:
        """The same fp32 weights with every linear layer and the LM head as 16-output panels (``panel_linear``). The
        dense copies are dropped (the embedding table stays)."""

        def panels(w: Weight) -> Weight:
            return w if isinstance(w, PanelWeight) else to_panels(dense(w))

        layers = [
            dataclasses.replace(
                layer, qkv=panels(layer.qkv), o=panels(layer.o), gate_up=panels(layer.gate_up), down=panels(layer.down)
            )
            for layer in self.layers
        ]
        return ModelWeights(self.embed, layers, self.norm, panels(self.lm_head))

    def with_bf16_panels(self, keep_dense: bool = False) -> ModelWeights:
        """The same bf16 weights with every linear layer and the LM head as pair panels (``bf16_linear``), those whose
        input width is even; the dense copies are dropped (the embedding table stays: a tied LM head becomes a panel
        copy of it), or kept beside the layers' panels with ``keep_dense`` (for ``F.linear`` on many rows:
        ``kernels.dense_copy_rows``; the LM head, which multiplies only the rows that need logits, keeps none)."""

        def panels(w: Weight, keep: bool = keep_dense) -> Weight:
            if isinstance(w, Bf16Panels):
                return w
            d = dense(w)
            return bf16_linear.to_panels(d, keep) if bf16_linear.convertible(d) else w

        layers = [
            dataclasses.replace(
                layer, qkv=panels(layer.qkv), o=panels(layer.o), gate_up=panels(layer.gate_up), down=panels(layer.down)
            )
            for layer in self.layers
        ]
        return ModelWeights(self.embed, layers, self.norm, panels(self.lm_head, False))

    def _linear_weights(self) -> list[Weight]:
        return [self.lm_head] + [w for layer in self.layers for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def num_panels(self) -> int:
        """How many of the linear weights (4 per layer + the LM head) are held as panels (fp32, or bf16 pairs)."""
        return sum(isinstance(w, PanelWeight | Bf16Panels) for w in self._linear_weights())


def _layer(
    spec: ModelSpec,
    prefix: str,
    need: Callable[[str, tuple[int, ...]], torch.Tensor],
    get: TensorGetter,
    dtype: torch.dtype,
    device: torch.device,
) -> LayerWeights:
    h, d, inter = spec.hidden_size, spec.head_dim, spec.intermediate_size
    attn, mlp = prefix + "self_attn.", prefix + "mlp."
    sizes = {"q": spec.q_size, "k": spec.kv_size, "v": spec.kv_size}
    qkv = torch.cat([need(f"{attn}{n}_proj.weight", (size, h)) for n, size in sizes.items()])
    biases = [get(f"{attn}{n}_proj.bias") for n in sizes]
    qkv_bias = None
    if any(b is not None for b in biases):  # Qwen2 (q/k/v), Llama with attention_bias
        qkv_bias = torch.cat([need(f"{attn}{n}_proj.bias", (size,)) for n, size in sizes.items()])
    o_bias = get(attn + "o_proj.bias")
    return LayerWeights(
        input_norm=need(prefix + "input_layernorm.weight", (h,)),
        qkv=qkv,
        qkv_bias=qkv_bias,
        o=need(attn + "o_proj.weight", (h, spec.q_size)),
        o_bias=None if o_bias is None else need(attn + "o_proj.bias", (h,)),
        q_norm=need(attn + "q_norm.weight", (d,)) if spec.qk_norm else None,
        k_norm=need(attn + "k_norm.weight", (d,)) if spec.qk_norm else None,
        post_norm=need(prefix + "post_attention_layernorm.weight", (h,)),
        gate_up=torch.cat([need(mlp + "gate_proj.weight", (inter, h)), need(mlp + "up_proj.weight", (inter, h))]),
        down=need(mlp + "down_proj.weight", (h, inter)),
    )


def row_groups(plan: AttentionPlan, wide_rows: int | None) -> list[tuple[int, int]] | None:
    """The row ranges of a batch that the layers' linear weights multiply one call each (None: the whole batch in
    one call), so that the row count which picks a row's kernel (``kernels.WIDE_ROWS``) is its own request's: a
    prefill chunk of at least ``wide_rows`` rows alone (the dense copy), the other requests' rows in runs of fewer
    (the tiles). A decode row then gets the same bits beside a long chunk as alone."""
    n = plan.num_tokens
    if wide_rows is None or n < wide_rows or (len(plan.prefills) == 1 and plan.prefills[0].q_len == n):
        return None
    spans = {p.q_start: p.q_len for p in plan.prefills}
    groups: list[tuple[int, int]] = []
    start = row = 0
    while row < n:
        size = spans.get(row, 1)  # (a row outside every prefill chunk is one decode row)
        if size >= wide_rows:
            groups += [(start, row)] if row > start else []
            groups.append((row, row + size))
            start = row + size
        elif row + size - start >= wide_rows:
            groups.append((start, row))
            start = row
        row += size
    return groups + ([(start, n)] if start < n else [])


def linear_rows(
    x: torch.Tensor, w: Weight, bias: torch.Tensor | None, groups: list[tuple[int, int]] | None
) -> torch.Tensor:
    """``linear`` over ``x``, one call per row range of ``groups`` (``row_groups``)."""
    if groups is None:
        return linear(x, w, bias)
    return torch.cat([linear(x[a:b], w, bias) for a, b in groups])


def rope_inv_freq(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` (float32), as transformers computes them for each rope type."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        return inv_freq
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_tables(spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[max_len, 2, head_dim]``: cos and *signed* sin per position, so that RoPE is
    ``x * cos + cat(x2, x1) * sin_signed`` (``sin_signed = cat(-sin, sin)``, the same products as rotate_half)."""
    inv_freq = rope_inv_freq(spec.rope, spec.head_dim)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)
    cos, sin = freqs.cos(), freqs.sin()
    table = torch.stack([torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)], dim=1)
    return table.to(device=device, dtype=dtype)


class LlamaModel:
    """The forward pass. Stateless apart from the weights; the KV pool is passed in."""

    def __init__(self, spec: ModelSpec, weights: ModelWeights, max_len: int, device: torch.device) -> None:
        self.spec = spec
        self.weights = weights
        self.device = device
        self.dtype = weights.embed.dtype
        self.rope = rope_tables(spec, max_len, self.dtype, device)
        self.scale = spec.head_dim**-0.5
        # NOTE: every library the table picks is built (once per machine) now, at load, not on the first request
        chosen = {op: kernels.choose_with_library(op, self.dtype, device=device.type) for op in kernels.Op}
        self.norm_kernel = chosen[kernels.Op.NORM][1]
        self.rope_kernel = chosen[kernels.Op.ROPE][1]
        self.activation_kernel = chosen[kernels.Op.ACTIVATION][1]
        kept = any(isinstance(w, Bf16Panels) and w.wide is not None for w in weights._linear_weights())
        self.wide_rows = kernels.dense_copy_rows(self.dtype, device.type) if kept else None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        plan: AttentionPlan,
        kv_pool: torch.Tensor,
        logit_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        """``input_ids``/``positions``: ``[N]``; returns float32 logits ``[len(logit_rows), vocab]`` (all rows when
        ``logit_rows`` is None)."""
        x = self.hidden_states(input_ids, positions, plan, kv_pool)
        return self.logits(x if logit_rows is None else x.index_select(0, logit_rows))

    def hidden_states(
        self, input_ids: torch.Tensor, positions: torch.Tensor, plan: AttentionPlan, kv_pool: torch.Tensor
    ) -> torch.Tensor:
        """The last layer's output ``[N, hidden]`` (before the final norm), writing each layer's K/V into the pool."""
        x = F.embedding(input_ids, self.weights.embed)
        rope = _Rope(self.rope, positions)
        groups = row_groups(plan, self.wide_rows)
        for i, layer in enumerate(self.weights.layers):
            x = self._layer(x, layer, rope, plan, kv_pool[i], groups)
        return x

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of rows of ``hidden_states``: the final norm, then the LM head."""
        return linear(self._norm(hidden, self.weights.norm), self.weights.lm_head).float()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.norm_kernel is not None and cpu_kernels.norm_supported(x, weight, None):
            return cpu_kernels.rms_norm(self.norm_kernel, x, weight, self.spec.rms_norm_eps)
        return F.rms_norm(x, (self.spec.hidden_size,), weight, self.spec.rms_norm_eps)

    def _add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x + delta, rms_norm(x + delta))``; the kernel adds into ``x`` in place (it is this step's own tensor)."""
        if self.norm_kernel is not None and cpu_kernels.norm_supported(x, weight, delta):
            return x, cpu_kernels.rms_norm(self.norm_kernel, x, weight, self.spec.rms_norm_eps, delta)
        x = x + delta
        return x, F.rms_norm(x, (self.spec.hidden_size,), weight, self.spec.rms_norm_eps)

    def _layer(
        self,
        x: torch.Tensor,
        w: LayerWeights,
        rope: _Rope,
        plan: AttentionPlan,
        kv: torch.Tensor,
        groups: list[tuple[int, int]] | None = None,
    ) -> torch.Tensor:
        spec = self.spec
        n, heads, kv_heads, d = x.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        h = self._norm(x, w.input_norm)
        qkv = linear_rows(h, w.qkv, w.qkv_bias, groups)
        fused = w.q_norm is None and cpu_kernels.rope_supported(qkv, rope.table, kv, rope.positions, plan.slots)
        if self.rope_kernel is not None and fused:
            # NOTE: one C call instead of ~10 ops (slices, cat, 3 products, 2 index_copy_) per layer and step
            table, positions = rope.table, rope.positions
            q = cpu_kernels.rope_store(self.rope_kernel, qkv, heads, kv_heads, table, positions, plan.slots, *kv)
        else:
            q = self._rope_and_store(qkv, w, rope, plan, kv)
        attn = attend(q, kv[0], kv[1], plan).reshape(n, heads * d)
        x, h = self._add_norm(x, linear_rows(attn, w.o, w.o_bias, groups), w.post_norm)
        gate_up = linear_rows(h, w.gate_up, None, groups)
        if self.activation_kernel is not None and cpu_kernels.silu_mul_supported(gate_up):
            act = cpu_kernels.silu_mul(self.activation_kernel, gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return x + linear_rows(act, w.down, None, groups)

    def _rope_and_store(
        self, qkv: torch.Tensor, w: LayerWeights, rope: _Rope, plan: AttentionPlan, kv: torch.Tensor
    ) -> torch.Tensor:
        """The torch path (no kernel, CUDA, or Qwen3's per-head q/k norm): rotated q; k and v written to the pool."""
        spec = self.spec
        n, heads, kv_heads, d = qkv.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        qk = qkv[:, : (heads + kv_heads) * d].view(n, heads + kv_heads, d)
        v = qkv[:, (heads + kv_heads) * d :].view(n, kv_heads, d)
        if w.q_norm is not None and w.k_norm is not None:
            qk = torch.cat(
                [
                    F.rms_norm(qk[:, :heads], (d,), w.q_norm, spec.rms_norm_eps),
                    F.rms_norm(qk[:, heads:], (d,), w.k_norm, spec.rms_norm_eps),
                ],
                dim=1,
            )
        cos, sin = rope.cos_sin()
        qk = _apply_rope(qk, cos, sin)
        write_kv(kv[0], kv[1], plan, qk[:, heads:], v)
        return qk[:, :heads]


@dataclass(slots=True)
class _Rope:
    """A step's positions over the RoPE table. The C kernel reads the table by position; the torch path needs the
    rows gathered, which happens once per step and only when that path runs."""

    table: torch.Tensor  # [max_len, 2, D] (rope_tables)
    positions: torch.Tensor  # int64 [N]
    _gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin, ``[N, 1, D]`` each (broadcast over heads)."""
        if self._gathered is None:
            rows = self.table.index_select(0, self.positions)
            self._gathered = (rows[:, 0:1], rows[:, 1:2])
        return self._gathered


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
