"""(d) HF transformers, full recompute per turn, and (e) HF transformers with a DynamicCache kept per session.

Both serve one request at a time (a plain transformers backend has no continuous batching), on the same converted
safetensors folder kvchat loads, in the same dtype, with the same prompt token ids, greedy, never stopping early.

(d) is what a naive backend does: every turn recomputes the whole conversation (the KV of the generated tokens is
kept only while that reply is generated). (e) keeps each session's DynamicCache between turns and recomputes only
what follows the longest common prefix with the new prompt (the cache is cropped there).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.runners.base import OnTokens, Runner, RunnerInfo, TurnOutcome, TurnRequest
from engine.openmp import release_thread_pool
from engine.prompt import common_prefix

_T = TypeVar("_T")


@dataclass(slots=True)
class _SessionCache:
    cache: Any  # transformers.DynamicCache
    token_ids: list[int]  # the tokens whose K/V the cache holds


class HFRunner(Runner):
    def __init__(self, model_path: str, dtype: str, threads: int, reuse: bool, name: str) -> None:
        self.name = name
        self.model_path = model_path
        self.dtype = dtype
        self.threads = threads
        self.reuse = reuse
        self.model: Any = None
        self._lock = asyncio.Lock()  # NOTE: one request at a time, in arrival order (asyncio.Lock is FIFO)
        self._sessions: dict[str, _SessionCache] = {}
        self._kv_bytes_per_token = 0
        self._live_kv_tokens = 0
        self._mutex = threading.Lock()
        self._cache_kwarg = "past_key_values"

    async def start(self) -> RunnerInfo:
        return await asyncio.to_thread(_releasing_pool, self._load)

    def _load(self) -> RunnerInfo:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(self.threads)
        torch_dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[self.dtype]
        self.model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch_dtype).eval()
        # NOTE: transformers renamed ``past_key_values`` to ``cache`` (the old name warns, then goes away).
        params = inspect.signature(self.model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        cfg = self.model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        itemsize = torch.empty((), dtype=torch_dtype).element_size()
        self._kv_bytes_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * itemsize
        details = {"dtype": self.dtype, "threads": self.threads, "attn": cfg._attn_implementation}
        return RunnerInfo(self.name, transformers.__version__, details)

    async def run_turn(self, request: TurnRequest, on_tokens: OnTokens) -> TurnOutcome:
        async with self._lock:
            # NOTE: each turn may land on another executor thread; every thread that ran torch keeps an OpenMP pool,
            # and more pools than CPUs put idle workers to sleep (engine/openmp.py), so each turn hands its back.
            return await asyncio.to_thread(_releasing_pool, self._generate, request, on_tokens)

    def _generate(self, request: TurnRequest, on_tokens: OnTokens) -> TurnOutcome:
        import torch
        from transformers import DynamicCache

        prompt = request.prompt_ids
        entry = self._sessions.pop(request.session_id, None) if self.reuse else None
        reused = 0
        if entry is not None:
            # NOTE: at least the last prompt token is always recomputed: its logits pick the first new token.
            reused = min(common_prefix(entry.token_ids, prompt), len(prompt) - 1)
            surplus = entry.cache.get_seq_length() - reused
            if surplus > 0:
                entry.cache.crop(-surplus)  # NOTE: transformers 5 crops by a negative count of tokens to drop
            cache = entry.cache
        else:
            cache = DynamicCache()
        fed = list(prompt[:reused])
        with torch.inference_mode():
            ids = torch.tensor([prompt[reused:]], dtype=torch.long)
            out = self.model(input_ids=ids, **{self._cache_kwarg: cache}, use_cache=True, logits_to_keep=1)
            fed += prompt[reused:]
            token = int(out.logits[0, -1].argmax())
            on_tokens(1)
            generated = [token]
            self._set_live(len(fed))
            for _ in range(request.max_tokens - 1):
                step = torch.tensor([[token]])
                out = self.model(input_ids=step, **{self._cache_kwarg: cache}, use_cache=True, logits_to_keep=1)
                fed.append(token)
                token = int(out.logits[0, -1].argmax())
                on_tokens(1)
                generated.append(token)
        if self.reuse:
            self._sessions[request.session_id] = _SessionCache(cache, fed)
        kv = self._kv_bytes_now(0 if self.reuse else len(fed))
        self._set_live(0)
        return TurnOutcome(len(prompt), reused, len(generated), kv)

    def _set_live(self, tokens: int) -> None:
        with self._mutex:
            self._live_kv_tokens = tokens

    def _kv_bytes_now(self, live_tokens: int) -> int:
        kept = sum(len(e.token_ids) for e in self._sessions.values())
        return (kept + live_tokens) * self._kv_bytes_per_token

    async def end_session(self, session_id: str) -> None:
        async with self._lock:
            self._sessions.pop(session_id, None)

    async def close(self) -> None:
        async with self._lock:  # NOTE: a turn the driver gave up on may still run in its thread
            self._sessions.clear()
            self.model = None

    def kv_bytes(self) -> int | None:
        with self._mutex:
            live = self._live_kv_tokens
        return self._kv_bytes_now(live)


def _releasing_pool(fn: Callable[..., _T], *args: Any) -> _T:
    try:
        return fn(*args)
    finally:
        release_thread_pool()
