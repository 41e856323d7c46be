"""What the engine benchmark drives: our ``LLMEngine`` as a client sees it (``EngineDriver``, a ``Trace`` per
request) and the peers it is compared with (``Peers``: HF transformers, and our own bare ``ModelRunner``)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.llm_engine import LLMEngine
from engine.model.loader import ResolvedModel
from engine.model_runner import BatchItem, ModelRunner
from engine.outputs import GenerationEvent, RequestFinished, TokenDelta
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedModel

_REQUEST_TIMEOUT_S = 3600.0


@dataclass(slots=True)
class Trace:
    """One request as the caller saw it (``time.perf_counter`` seconds)."""

    submitted: float
    token_times: list[float] = field(default_factory=list)
    first_token: float | None = None
    done: float | None = None
    finished: RequestFinished | None = None
    error: EngineError | None = None

    @property
    def ttft_s(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.submitted

    @property
    def decode_tokens_per_s(self) -> float:
        """(tokens − 1) / (last token − first token), like ``RequestStats.decode_tokens_per_s``."""
        assert self.first_token is not None and self.done is not None
        n = len(self.token_times)
        return (n - 1) / (self.done - self.first_token) if n > 1 and self.done > self.first_token else 0.0


class EngineDriver:
    """Owns a started ``LLMEngine`` (its step-loop thread) and submits batches of requests to it."""

    def __init__(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.info = asyncio.run(self.engine.start())

    def close(self) -> None:
        asyncio.run(self.engine.stop())

    def run(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        namespaces: Sequence[str],
        on_wait: Callable[[], None] | None = None,
    ) -> list[Trace]:
        """Submit every prompt (each under its namespace), wait until all finish; ``on_wait`` polls meanwhile."""
        traces: list[Trace] = []
        left = [len(prompts)]
        all_done = threading.Event()
        guard = threading.Lock()

        def sink_for(trace: Trace) -> Callable[[GenerationEvent | EngineError], None]:
            def sink(event: GenerationEvent | EngineError) -> None:  # runs on the engine's step thread
                now = time.perf_counter()
                if isinstance(event, TokenDelta):
                    if event.token_ids and trace.first_token is None:
                        trace.first_token = now
                    trace.token_times.extend(now for _ in event.token_ids)
                    return
                if isinstance(event, RequestFinished):
                    trace.finished = event
                    if trace.first_token is None:
                        trace.first_token = now
                    # NOTE: a final token whose text is empty arrives only with RequestFinished.
                    trace.token_times.extend(now for _ in range(len(event.token_ids) - len(trace.token_times)))
                else:
                    trace.error = event
                trace.done = now
                with guard:
                    left[0] -= 1
                    if left[0] == 0:
                        all_done.set()

            return sink

        requests = []
        for prompt, namespace in zip(prompts, namespaces, strict=True):
            trace = Trace(submitted=time.perf_counter())
            traces.append(trace)
            requests.append((list(prompt), params, namespace, sink_for(trace)))
        ids = self.engine.submit_many(requests)  # NOTE: atomically: the "concurrent" streams really start together
        deadline = time.monotonic() + _REQUEST_TIMEOUT_S
        while not all_done.wait(0.001 if on_wait else 0.5):
            if on_wait is not None:
                on_wait()
            if time.monotonic() > deadline:
                for request_id in ids:  # the next section must not run beside them
                    self.engine.abort(request_id)
                raise TimeoutError(f"{left[0]} of {len(prompts)} benchmark requests did not finish")
        errors = [t.error for t in traces if t.error is not None]
        if errors:
            raise errors[0]
        return traces


def fixed_length(tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, min_tokens=tokens, ignore_eos=True)


def stats_of(trace: Trace) -> Any:
    assert trace.finished is not None
    return trace.finished.stats


# ---------------------------------------------------------------------------------------------------- the peers


class Peers:
    """The comparison points, loaded on first use: HF transformers and our own bare ``ModelRunner``."""

    def __init__(self, resolved: ResolvedModel, config: EngineConfig, dtype: torch.dtype) -> None:
        self.resolved = resolved
        self.config = config
        self.dtype = dtype
        self._hf: PreTrainedModel | None = None
        self._runner: ModelRunner | None = None

    @property
    def hf(self) -> PreTrainedModel:
        if self._hf is None:
            from transformers import AutoModelForCausalLM
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
            hf_logging.disable_progress_bar()
            self._hf = AutoModelForCausalLM.from_pretrained(self.resolved.path, dtype=self.dtype).eval()
        return self._hf

    @property
    def runner(self) -> ModelRunner:
        """Built exactly as ``LLMEngine.load`` builds its own (``ModelRunner.from_config`` on the same config)."""
        if self._runner is None:
            self._runner = ModelRunner.from_config(self.config)
        return self._runner

    @torch.inference_mode()
    def hf_forward(self, token_ids: Sequence[int], cache: Any) -> int:
        """One HF forward over ``token_ids`` appending to ``cache``; the greedy next token (logits of the last only)."""
        out = self.hf(torch.tensor([list(token_ids)]), cache=cache, use_cache=True, logits_to_keep=1)
        return int(out.logits[0, -1].argmax())

    def hf_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)

    @torch.inference_mode()
    def hf_generate(self, prompt: Sequence[int], new_tokens: int) -> list[float]:
        """``generate`` greedily exactly ``new_tokens`` tokens; the time at which each new token arrived."""
        from transformers import GenerationConfig
        from transformers.generation.streamers import BaseStreamer

        times: list[float] = []

        class TimingStreamer(BaseStreamer):
            calls = 0

            def put(self, value: Any) -> None:
                self.calls += 1
                if self.calls > 1:  # NOTE: the first put is the prompt itself
                    times.extend(time.perf_counter() for _ in range(int(value.numel())))

            def end(self) -> None:
                pass

        config = self.hf.config
        eos = getattr(config, "eos_token_id", None)
        gen = GenerationConfig(
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=getattr(config, "pad_token_id", None) or eos,
        )
        ids = torch.tensor([list(prompt)])
        model: Any = self.hf  # NOTE: transformers' stubs type ``generate`` as a Tensor attribute
        model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen, streamer=TimingStreamer()
        )
        if len(times) != new_tokens:
            raise RuntimeError(f"HF generate produced {len(times)} tokens, expected {new_tokens}")
        return times

    @torch.inference_mode()
    def bare_prefill(self, token_ids: Sequence[int], table: list[int]) -> None:
        """Write ``token_ids``' K/V into the runner's pool at positions 0.. (chunked like the engine's scheduler)."""
        chunk = self.config.max_num_batched_tokens
        for start in range(0, len(token_ids), chunk):
            self.runner.forward([BatchItem(list(token_ids[start : start + chunk]), start, table, False)])
