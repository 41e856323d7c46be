"""What the engine reports about itself: ``EngineInfo`` (fixed at load) and ``EngineStats`` (a snapshot)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.kv.cache_stats import CacheStats
from engine.kv.kv_cache_manager import KVCacheUsage
from engine.kv.tiers import TierStats

if TYPE_CHECKING:
    from engine.model_runner import ModelRunner


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """Values derived at load time (never written back into ``EngineConfig``)."""

    model_path: str
    fingerprint: str
    architecture: str
    device: str
    dtype: str
    num_blocks: int
    block_size: int
    kv_bytes_per_token: int
    max_model_len: int
    vocab_size: int

    @classmethod
    def of(cls, runner: ModelRunner, config: EngineConfig) -> EngineInfo:
        from engine.model.loader import fingerprint

        return cls(
            model_path=str(runner.model_path),
            fingerprint=runner.fingerprint or fingerprint(runner.model_path),
            architecture=runner.architecture,
            device=str(runner.device),
            dtype=str(runner.dtype).removeprefix("torch."),
            num_blocks=runner.num_blocks,
            block_size=config.block_size,
            kv_bytes_per_token=runner.kv_bytes_per_token,
            max_model_len=min(runner.max_model_len, config.max_model_len or runner.max_model_len),
            vocab_size=runner.vocab_size,
        )


@dataclass(frozen=True, slots=True)
class EngineStats:
    running: int
    waiting: int
    kv: KVCacheUsage
    requests_finished: int
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    steps: int
    cache: CacheStats  # prefix-cache hits by block type, reuse depth, efficiency, invalidations by reason
    tiers: TierStats  # memory and disk tier occupancy, promotions, demotions, refused writes
    # Suffix drafts (engine.spec): tokens verified as drafts, those accepted, and the steps that verified some
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    verify_steps: int = 0
    # how many verify steps gave n tokens (the accepted drafts and the one more): /metrics' histogram of them
    tokens_per_verify_step: Mapping[int, int] = field(default_factory=dict)
    # The OpenMP width of the engine's steps now (engine.cpu_share; the fixed thread count where it does not adapt),
    # and how often it changed: a width below the cores says other work holds them
    threads: int = 0
    width_changes: int = 0
