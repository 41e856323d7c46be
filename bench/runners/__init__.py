"""One runner per system under test, and the one place that builds them by name.

Systems in our venv run in the driver's process; peers with their own dependencies (llama-cpp-python, vLLM) run as
worker subprocesses in ``.bench-venvs/`` (``bench/peers/install.sh``), so their packages never touch kvchat's venv.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bench.runners.base import Runner, RunnerUnavailable

SYSTEMS: dict[str, str] = {
    "kvchat": "(a) kvchat engine, in-process",
    "kvchat-ws": "(b) kvchat end to end, websocket server",
    "kvchat-nocache": "(c) kvchat, prefix caching disabled",
    "hf-recompute": "(d) HF transformers, full recompute per turn",
    "hf-cache": "(e) HF transformers, DynamicCache per session",
    "llamacpp": "(f) llama-cpp-python, same GGUF, its prompt reuse",
    "vllm": "(g) vLLM CPU build, prefix caching",
    "vllm-suffix": "(h) vLLM CPU build, prefix caching, suffix speculative decoding",
}
VENV_PEERS = ("llamacpp", "vllm", "vllm-suffix")


@dataclass(frozen=True, slots=True)
class SystemOptions:
    model: str  # "smollm2", a safetensors folder or a .gguf file (as EngineConfig.model)
    threads: int
    kv_mb: int
    max_tokens: int
    dtype: str  # "auto" resolves like the engine: bf16 where the CPU has it, else float32
    log_dir: Path


def resolved_dtype(dtype: str) -> str:
    if dtype != "auto":
        return dtype
    from engine.device import cpu_supports_bf16

    return "bfloat16" if cpu_supports_bf16() else "float32"


def model_folder(model: str) -> Path:
    from engine.model.loader import resolve_model

    return Path(resolve_model(model).path)


def gguf_file(model: str) -> Path:
    if model == "smollm2":
        from engine.model.loader import _packaged_smollm2

        return Path(_packaged_smollm2())
    if model.endswith(".gguf"):
        return Path(model)
    raise RunnerUnavailable(f"llama.cpp needs a GGUF file; model {model!r} is a safetensors folder")


def make_runner(system: str, opts: SystemOptions) -> Runner:
    from bench.runners.hf import HFRunner
    from bench.runners.kvchat_engine import KvchatEngineRunner, engine_config
    from bench.runners.kvchat_ws import KvchatWebsocketRunner
    from bench.runners.llamacpp import llamacpp_runner
    from bench.runners.vllm import vllm_runner

    dtype = resolved_dtype(opts.dtype)
    if system in ("kvchat", "kvchat-nocache", "kvchat-ws"):
        config = engine_config(opts.model, opts.threads, opts.kv_mb, system != "kvchat-nocache", dtype)
        if system == "kvchat-ws":
            return KvchatWebsocketRunner(config, opts.max_tokens, name=system)
        return KvchatEngineRunner(config, name=system)
    if system in ("hf-recompute", "hf-cache"):
        return HFRunner(str(model_folder(opts.model)), dtype, opts.threads, system == "hf-cache", system)
    if system == "llamacpp":
        return llamacpp_runner(gguf_file(opts.model), opts.threads, opts.log_dir / "llamacpp.worker.log")
    if system in ("vllm", "vllm-suffix"):
        log = opts.log_dir / f"{system}.worker.log"
        return vllm_runner(model_folder(opts.model), opts.threads, dtype, log, name=system)
    raise RunnerUnavailable(f"unknown system {system!r} (known: {', '.join(SYSTEMS)})")
