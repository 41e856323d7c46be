"""vLLM (CPU build) as a benchmark worker (runs in .bench-venvs/vllm; stdlib + vllm only).

Speaks the JSON-lines protocol of ``bench/runners/worker_client.py``. One ``LLMEngine`` with automatic prefix
caching, continuous batching across every request in flight; the prompt goes in as token ids, greedy, ``ignore_eos``
so every system generates exactly ``max_tokens``, unless a request names its own ``sampling`` (e.g. the chat's
repetition penalty, stopping at EOS). The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
set by the runner) so the peak RSS reported is the process holding the model.

``speculative_config`` in the start message (e.g. ``{"method": "suffix"}``: arctic-inference's suffix trees, no draft
model) is vLLM's ``--speculative-config``; each ``done`` then carries the engine's cumulative draft counters
(``spec``), and with ``return_ids`` a request's ``done`` carries its token ids (to compare outputs).
"""

from __future__ import annotations

import queue
import resource
import sys
import threading
import time
from typing import Any

from worker_io import emit, read_stdin  # next to this script (runs in the peer's venv)


class Worker:
    def __init__(self, args: dict[str, Any]) -> None:
        import vllm
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        engine_args = EngineArgs(
            model=args["model_path"],
            dtype=args.get("dtype", "bfloat16"),
            max_model_len=int(args.get("max_model_len", 4096)),
            max_num_seqs=int(args.get("max_num_seqs", 32)),
            enable_prefix_caching=True,
            seed=0,
            disable_log_stats=False,
            speculative_config=args.get("speculative_config"),
        )
        self.engine = LLMEngine.from_engine_args(engine_args)
        self.version = vllm.__version__
        self.counts: dict[str, int] = {}
        self.ids: dict[str, list[int]] = {}
        self.wants_ids: set[str] = set()
        self.kv_capacity = int(float(args.get("kv_space_gb", 1)) * (1 << 30))
        self.details = {
            "dtype": engine_args.dtype,
            "max_model_len": engine_args.max_model_len,
            "prefix_caching": True,
            "kv_capacity_bytes": self.kv_capacity,
            "speculative_config": args.get("speculative_config"),
        }
        self.last_kv_report = 0.0

    def add(self, message: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        sampling = {"temperature": 0.0, "ignore_eos": True} | dict(message.get("sampling") or {})
        params = SamplingParams(max_tokens=int(message["max_tokens"]), output_kind=RequestOutputKind.DELTA, **sampling)
        if message.get("return_ids"):
            self.wants_ids.add(message["id"])
        self.engine.add_request(message["id"], {"prompt_token_ids": list(message["prompt_ids"])}, params)

    def step(self) -> None:
        now = time.monotonic()
        if now - self.last_kv_report >= 0.5:  # NOTE: reading the metrics every step would cost time of its own
            self.last_kv_report = now
            kv = self.kv_bytes()
            if kv is not None:
                emit({"event": "kv", "bytes": kv})
        for out in self.engine.step():
            completion = out.outputs[0]
            if completion.token_ids:
                self.counts[out.request_id] = self.counts.get(out.request_id, 0) + len(completion.token_ids)
                if out.request_id in self.wants_ids:
                    self.ids.setdefault(out.request_id, []).extend(completion.token_ids)
                emit({"id": out.request_id, "event": "tokens", "n": len(completion.token_ids)})
            if out.finished:
                done = {
                    "id": out.request_id,
                    "event": "done",
                    "prompt_tokens": len(out.prompt_token_ids or []),
                    "cached_tokens": out.num_cached_tokens,
                    "output_tokens": self.counts.pop(out.request_id, 0),
                    "kv_bytes": self.kv_bytes(),
                }
                if out.request_id in self.wants_ids:
                    self.wants_ids.discard(out.request_id)
                    done["token_ids"] = self.ids.pop(out.request_id, [])
                if self.details["speculative_config"]:
                    done["spec"] = self.spec_counters()
                emit(done)

    def spec_counters(self) -> dict[str, int]:
        """The engine's cumulative speculative-decoding counters (``vllm:spec_decode_num_*``: drafts = verify steps,
        draft_tokens, accepted_tokens); a caller running one request at a time takes differences."""
        counters = dict.fromkeys(("drafts", "draft_tokens", "accepted_tokens"), 0)
        for metric in self.engine.get_metrics():
            name = metric.name.removeprefix("vllm:spec_decode_num_")
            if name in counters:
                counters[name] += int(getattr(metric, "value", 0))
        return counters

    def kv_bytes(self) -> int | None:
        try:
            for metric in self.engine.get_metrics():
                if metric.name == "vllm:kv_cache_usage_perc":
                    return int(float(getattr(metric, "value", 0.0)) * self.kv_capacity)
        except Exception:  # noqa: BLE001 - metrics are optional
            return None
        return None


def main() -> int:
    inbox: queue.Queue[dict[str, Any] | None] = queue.Queue()
    threading.Thread(target=read_stdin, args=(inbox,), daemon=True).start()
    worker: Worker | None = None
    closing = False
    while not closing:
        busy = worker is not None and worker.engine.has_unfinished_requests()
        try:
            message = inbox.get_nowait() if busy else inbox.get()
        except queue.Empty:
            message = {}
        while message or message is None:
            if message is None or message.get("op") == "close":
                closing = True
                break
            op = message.get("op")
            try:
                if op == "start":
                    worker = Worker(message)
                    emit({"event": "ready", "version": worker.version, "details": worker.details})
                elif op == "generate" and worker is not None:
                    worker.add(message)
            except Exception as exc:  # noqa: BLE001 - reported to the driver, which records it
                if op == "start":
                    emit({"event": "fatal", "error": f"{type(exc).__name__}: {exc}"})
                    return 1
                emit({"id": message.get("id"), "event": "error", "error": f"{type(exc).__name__}: {exc}"})
            try:
                message = inbox.get_nowait()
            except queue.Empty:
                message = {}
        if not closing and worker is not None and worker.engine.has_unfinished_requests():
            worker.step()
    emit({"event": "closed", "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})
    return 0


if __name__ == "__main__":
    sys.exit(main())
