"""llama-cpp-python as a benchmark worker (runs in .bench-venvs/llamacpp; stdlib + llama_cpp only).

Speaks the JSON-lines protocol of ``bench/runners/worker_client.py``. Requests are served one at a time (one
``Llama`` context, as llama-cpp-python serves them). Prompt reuse is llama-cpp-python's own: the context keeps the
KV of the last sequence (``generate`` skips the longest common prefix) and a ``LlamaRAMCache`` keeps the state saved
after each completion, loaded back when it shares a longer prefix with the next prompt — the same steps its
``create_completion`` takes, done here around ``generate`` so that every token is timed and EOS never ends a reply
early (every system generates exactly ``max_tokens``).

NOTE: ``use_extra_bufts=False``: on CPUs with AMX, llama.cpp's extra buffer types (repacked AMX weights) crash here.
``Llama()`` has no argument for it (unknown keywords are silently ignored), so the model parameters' defaults are
patched before the model loads.
"""

from __future__ import annotations

import queue
import resource
import sys
import threading
from typing import Any

from worker_io import emit, read_stdin  # next to this script (runs in the peer's venv)


def _disable_extra_bufts() -> None:
    import llama_cpp.llama_cpp as lib

    defaults = lib.llama_model_default_params

    def params() -> Any:
        p = defaults()
        p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


class Worker:
    def __init__(self, args: dict[str, Any]) -> None:
        import llama_cpp
        from llama_cpp import Llama, LlamaRAMCache

        _disable_extra_bufts()
        self.llm = Llama(
            model_path=args["model_path"],
            n_ctx=int(args.get("n_ctx", 4096)),
            n_batch=int(args.get("n_batch", 512)),
            n_threads=int(args["threads"]),
            n_threads_batch=int(args["threads"]),
            seed=0,
            verbose=False,
        )
        self.cache = (
            LlamaRAMCache(capacity_bytes=int(args.get("cache_bytes", 2 << 30))) if args.get("ram_cache", True) else None
        )
        meta = self.llm.metadata
        arch = meta.get("general.architecture", "llama")
        layers = int(meta[f"{arch}.block_count"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta[f"{arch}.embedding_length"]) // heads
        self.kv_bytes_per_token = 2 * layers * kv_heads * head_dim * 2  # f16 K and V
        self.version = llama_cpp.__version__
        self.details = {
            "n_ctx": self.llm.n_ctx(),
            "threads": int(args["threads"]),
            "ram_cache": self.cache is not None,
            "kv_capacity_bytes": self.llm.n_ctx() * self.kv_bytes_per_token,
        }

    def generate(self, message: dict[str, Any]) -> None:
        from llama_cpp import Llama

        rid, prompt, max_tokens = message["id"], list(message["prompt_ids"]), int(message["max_tokens"])
        llm = self.llm
        reused = Llama.longest_token_prefix(llm._input_ids.tolist(), prompt)
        if self.cache is not None:
            try:
                item = self.cache[prompt]
                from_cache = Llama.longest_token_prefix(item.input_ids.tolist(), prompt)
                if from_cache > reused:
                    llm.load_state(item)
                    reused = from_cache
            except KeyError:
                pass
        reused = min(reused, len(prompt) - 1)  # NOTE: generate always re-evaluates the last prompt token
        n = 0
        for _token in llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            n += 1
            emit({"id": rid, "event": "tokens", "n": 1})
            if n >= max_tokens:
                break
        if self.cache is not None:
            self.cache[llm._input_ids.tolist()] = llm.save_state()
        emit(
            {
                "id": rid,
                "event": "done",
                "prompt_tokens": len(prompt),
                "cached_tokens": reused,
                "output_tokens": n,
                "kv_bytes": self.kv_bytes(),
            }
        )

    def kv_bytes(self) -> int:
        saved = self.cache.cache_size if self.cache is not None else 0
        return int(saved + self.llm.n_tokens * self.kv_bytes_per_token)


def main() -> int:
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=read_stdin, args=(inbox,), daemon=True).start()
    worker: Worker | None = None
    while True:
        message = inbox.get()
        if message is None or message.get("op") == "close":
            break
        op = message.get("op")
        try:
            if op == "start":
                worker = Worker(message)
                emit({"event": "ready", "version": worker.version, "details": worker.details})
            elif op == "generate" and worker is not None:
                worker.generate(message)
            elif op == "end_session":
                pass  # NOTE: the RAM cache is keyed by tokens, not sessions; its LRU bound does the freeing
        except Exception as exc:  # noqa: BLE001 - reported to the driver, which records it
            if op == "start":
                emit({"event": "fatal", "error": f"{type(exc).__name__}: {exc}"})
                return 1
            emit({"id": message.get("id"), "event": "error", "error": f"{type(exc).__name__}: {exc}"})
    emit({"event": "closed", "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    return 0


if __name__ == "__main__":
    sys.exit(main())
