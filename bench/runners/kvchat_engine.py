"""(a) kvchat's engine in-process, and (c) the same engine with prefix caching disabled.

Chat messages go in as they are (the engine applies the chat template); each tenant is its own cache namespace and
each session is named, so a finished session can release what only it used.
"""

from __future__ import annotations

from bench.runners.base import OnTokens, Runner, RunnerInfo, TurnOutcome, TurnRequest
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.outputs import RequestFinished, TokenDelta
from engine.sampling_params import SamplingParams


def engine_config(model: str, threads: int, kv_mb: int, prefix_caching: bool, dtype: str = "auto") -> EngineConfig:
    return EngineConfig(
        model=model,
        dtype=dtype,
        device="cpu",
        max_kv_memory_mb=kv_mb,
        max_num_seqs=32,
        enable_prefix_caching=prefix_caching,
        num_threads=threads,
    )


def kv_resident_bytes(engine: LLMEngine) -> int:
    """Blocks in use plus cached (evictable) blocks: the KV the engine keeps resident for reuse."""
    usage = engine.stats().kv
    info = engine.info
    return (usage.num_used_blocks + usage.num_evictable_blocks) * info.block_size * info.kv_bytes_per_token


class KvchatEngineRunner(Runner):
    def __init__(self, config: EngineConfig, name: str = "kvchat") -> None:
        self.name = name
        self.engine = LLMEngine(config)

    async def start(self) -> RunnerInfo:
        import engine as engine_pkg

        info = await self.engine.start()
        return RunnerInfo(
            self.name,
            getattr(engine_pkg, "__version__", "dev"),
            {
                "dtype": info.dtype,
                "kv_blocks": info.num_blocks,
                "block_size": info.block_size,
                "prefix_caching": self.engine.config.enable_prefix_caching,
            },
        )

    async def run_turn(self, request: TurnRequest, on_tokens: OnTokens) -> TurnOutcome:
        params = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        finished: RequestFinished | None = None
        async for event in self.engine.generate(
            request.messages, params, namespace=request.tenant, session=request.session_id
        ):
            if isinstance(event, TokenDelta):
                if event.token_ids:
                    on_tokens(len(event.token_ids))
            else:
                finished = event
        if finished is None:  # pragma: no cover - generate always ends with RequestFinished
            raise RuntimeError("the engine ended a request without RequestFinished")
        s = finished.stats
        return TurnOutcome(s.prompt_tokens, s.cached_tokens, s.completion_tokens, kv_resident_bytes(self.engine))

    async def end_session(self, session_id: str) -> None:
        self.engine.release_session(session_id)

    async def close(self) -> None:
        await self.engine.stop()

    def kv_bytes(self) -> int | None:
        return kv_resident_bytes(self.engine)

    def kv_capacity_bytes(self) -> int | None:
        info = self.engine.info
        return info.num_blocks * info.block_size * info.kv_bytes_per_token
