"""Engine configuration: one validated, immutable object.

Derived values (the number of KV blocks that fit the memory budget, the resolved device and dtype) are not written
back here; they live in ``engine.llm_engine.EngineInfo`` (see STYLE.md, habit 6).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import InvalidRequestError
from engine.kv.tier_config import CacheSettings


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "smollm2"  # "smollm2" (the packaged default), a safetensors folder, or a .gguf file
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:N"
    dtype: str = "auto"  # "auto" (bf16 where the CPU supports it, else fp32), "float32", "bfloat16", "float16"
    block_size: int = 16
    max_kv_memory_mb: int = 512
    max_num_seqs: int = 32
    # NOTE: 2048, not 1024: a cold 2000-token prompt prefills in one chunk — 1374 vs 1041 tok/s measured (SmolLM2,
    # bf16, 2 threads); the price is that decodes of other sequences wait up to one such chunk (~1.5 s here).
    max_num_batched_tokens: int = 2048
    # While other requests are in flight, a prefill chunk takes at most this many tokens of a step, and while other
    # tenants' are, the step's prefill in all (None: the CPU kind's, engine.model.kernels.prefill_chunk; 0: no cap).
    # Alone, a prompt takes the whole max_num_batched_tokens.
    long_prefill_chunk: int | None = None
    # Whether the step's prefill in all stays within long_prefill_chunk while one tenant alone has several requests in
    # flight too (None: the CPU kind's, engine.model.kernels.caps_lone_steps).
    cap_lone_steps: bool | None = None
    max_waiting: int = 256
    max_model_len: int | None = None  # defaults to the model's context length
    enable_prefix_caching: bool = True
    num_threads: int | None = None  # torch intra-op threads on CPU; None leaves torch's default
    quantization: str | None = (
        None  # None, or "int8": weight-only int8 on CPU (slightly different outputs; faster only with AVX-512 int8)
    )
    cache_dir: str | None = None  # converted models and built kernels; default $KVCHAT_CACHE_DIR, ~/.cache/kvchat
    disk_cache_dir: str | None = None  # the disk tier of the KV cache (safetensors + an SQLite index); None = none
    cache_settings: CacheSettings = field(default_factory=CacheSettings)  # TTLs, disk cap, eviction, pinning
    # Suffix drafts (engine.spec), verified exactly; used where arctic-inference is installed and the cost model
    # measured for this CPU kind and dtype says they pay (engine.spec.cost_model). This is the default of requests
    # that do not say (``SamplingParams.drafts`` None); a request's True or False wins. Off by default: with the
    # chat's repetition penalty they gained nothing (docs/benchmarks.md, issue 44).
    drafts: bool = False
    # A file that gets one JSON line per step: its forward pass's time and what it held per tenant (engine.step_trace).
    # None: off. For finding which steps a reply waited behind under load.
    step_trace: str | None = None
    # Run each step on the cores the rest of the machine leaves (engine.cpu_share): fewer OpenMP threads while other
    # processes or the backend's threads hold cores, where that never changes a bit (our C kernels). False: always
    # num_threads (torch's default).
    adapt_threads: bool = True

    def __post_init__(self) -> None:
        checks = {
            "block_size": self.block_size >= 1 and (self.block_size & (self.block_size - 1)) == 0,
            "max_kv_memory_mb": self.max_kv_memory_mb >= 1,
            "max_num_seqs": self.max_num_seqs >= 1,
            "max_num_batched_tokens": self.max_num_batched_tokens >= 1,
            "max_waiting": self.max_waiting >= 1,  # every request passes through the waiting queue
            "long_prefill_chunk": self.long_prefill_chunk is None or self.long_prefill_chunk >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise InvalidRequestError(f"invalid engine config: {name}={getattr(self, name)!r}")
        if self.quantization not in (None, "int8"):
            raise InvalidRequestError(f"invalid engine config: quantization={self.quantization!r} (None or 'int8')")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise InvalidRequestError(f"invalid engine config: dtype={self.dtype!r}")
