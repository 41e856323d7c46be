"""``ModelSpec``: the architecture parameters of a Llama-family model, parsed from a HF ``config.json`` dict.

Supported: Llama 2/3 (rope types ``default``, ``linear``, ``llama3``), Mistral, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head
q/k RMSNorm; ``head_dim`` may differ from hidden/heads) and SmolLM2 (Llama architecture).

NOTE: sliding-window attention (Mistral v0.1, Qwen with ``use_sliding_window``) is not implemented. Within the window
it is identical to full attention, so the model context is capped at the window (``max_model_len``) and longer
contexts are rejected by the scheduler instead of being computed wrongly.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engine.errors import ModelLoadError

# model_type -> the HF class name that config.json lists under "architectures".
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeSpec:
    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    sliding_window: int | None  # a window we do not implement; caps max_model_len
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @property
    def max_model_len(self) -> int:
        if self.sliding_window is not None:
            return min(self.max_position_embeddings, self.sliding_window)
        return self.max_position_embeddings

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> ModelSpec:
        """Parse a HF config dict; an unsupported architecture or a malformed config raises ``ModelLoadError``."""
        model_type = _model_type(config)
        try:
            return _parse(model_type, config)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"malformed {model_type} config.json: {exc!r}") from exc


def _model_type(config: Mapping[str, Any]) -> str:
    model_type = config.get("model_type")
    architectures = config.get("architectures") or []
    supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES.values()))
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported model architecture: model_type={model_type!r}, architectures={architectures!r}; "
            f"supported: {supported}"
        )
    unknown = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES.values()]
    if unknown:
        raise ModelLoadError(f"unsupported model architecture {unknown!r}; supported: {supported}")
    return str(model_type)


def _parse(model_type: str, config: Mapping[str, Any]) -> ModelSpec:
    hidden = int(config["hidden_size"])
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    if hidden <= 0 or heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"bad head counts: heads={heads}, kv_heads={kv_heads}, hidden={hidden}")
    head_dim = int(config.get("head_dim") or hidden // heads)
    if head_dim % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
    if config.get("mlp_bias") or config.get("hidden_act", "silu") != "silu":
        raise ValueError("only SwiGLU MLPs without bias (hidden_act=silu, mlp_bias=false) are supported")
    return ModelSpec(
        model_type=model_type,
        vocab_size=int(config["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(config),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        qk_norm=model_type == "qwen3",
        sliding_window=_sliding_window(model_type, config),
        eos_token_ids=_token_ids(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id"),
    )


def _parse_rope(config: Mapping[str, Any]) -> RopeSpec:
    # NOTE: transformers 5 writes "rope_parameters" (with rope_theta inside); older configs have rope_theta at the
    # top level and an optional "rope_scaling" dict. Accept both.
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    return RopeSpec(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _sliding_window(model_type: str, config: Mapping[str, Any]) -> int | None:
    window = config.get("sliding_window")
    if window is None:
        return None
    # Qwen2/3 configs carry a sliding_window value that only applies when use_sliding_window is true.
    if model_type in ("qwen2", "qwen3") and not config.get("use_sliding_window", False):
        return None
    return int(window)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)
