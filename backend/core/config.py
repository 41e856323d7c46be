"""The backend's one settings object (env prefix ``KVCHAT_``)."""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from backend.engine_client.values import CacheSettings
from engine.config import EngineConfig

DEV_SECRET = "dev-insecure-secret-change-me"


class Environment(StrEnum):
    DEVELOPMENT = "development"
    TEST = "test"
    PRODUCTION = "production"


class Settings(BaseSettings):
    """Every knob of the backend. See README.md (Configuration) for the table of env vars."""

    model_config = SettingsConfigDict(env_prefix="KVCHAT_", env_file=None, extra="ignore", frozen=True)

    env: Environment = Environment.DEVELOPMENT
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=1, le=65535)
    # several ``kvchat serve`` workers on one port (Linux SO_REUSEPORT: the kernel spreads the connections); they
    # act as one service through Postgres (backend/chat/fanout.py)
    reuse_port: bool = False
    data_dir: Path = Path("data")
    database_url: str | None = None  # default: SQLite file under data_dir
    # The server secret the cache namespaces are derived from (backend/core/namespaces.py). Unset in development: a
    # random one is generated once and kept in ``data_dir`` (0600), so the disk cache survives restarts.
    secret_key: str | None = None
    log_level: str = "info"
    log_format: Literal["text", "json"] = "text"  # json: one object a line, with request and session ids
    run_migrations_on_start: bool = True
    # Engine (in-process)
    model: str = "smollm2"  # "smollm2", a safetensors folder or a .gguf file
    engine_device: str = "auto"
    engine_dtype: str = "auto"
    max_kv_memory_mb: int = Field(default=512, ge=1)
    engine_quantization: Literal["int8"] | None = None
    max_num_seqs: int = Field(default=32, ge=1)
    max_num_batched_tokens: int = Field(default=2048, ge=1)
    max_waiting: int = Field(default=256, ge=1)
    model_cache_dir: str | None = None
    # Remote engine (docs/scale-out.md): unset, the engine runs in this process. Set, the backend sends its requests
    # to this URL (vllm-router, or one ``kvchat engine-serve`` replica) and its cache control to every replica.
    engine_url: str | None = None
    engine_replicas: str = ""  # every replica behind engine_url, comma-separated (default: the router's list)
    engine_secret: str | None = None  # the shared secret between the backend and its replicas (Bearer)
    engine_timeout_s: float = Field(default=30.0, gt=0)  # a replica silent this long (no token) is given up on
    engine_retries: int = Field(default=2, ge=0)  # tries again before the first token when a replica fails
    # The KV cache's disk tier (survives restarts) and the cache settings a start begins with; the operator changes
    # them at runtime through ``/admin/cache/settings`` (until the process stops).
    kv_disk_cache: bool = True
    kv_disk_cache_dir: Path | None = None  # default: <data_dir>/kv_cache
    kv_memory_ttl_s: float = Field(default=60.0, gt=0)
    kv_disk_ttl_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    kv_disk_cache_max_gb: float = Field(default=10.0, gt=0)
    kv_min_free_space_gb: float = Field(default=5.0, ge=0)
    kv_eviction_policy: Literal["weighted", "lru"] = "lru"  # LRU won the replay (docs/benchmarks.md)
    kv_pin_max_fraction: float = Field(default=0.25, ge=0, le=0.9)
    # Replies
    reply_max_tokens: int = Field(default=256, ge=1)
    reply_temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    reply_top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    reply_top_k: int = Field(default=0, ge=0)
    reply_min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    reply_repetition_penalty: float = Field(default=1.2, ge=0.01, le=2.0)  # measured: docs/benchmarks.md, "Replies"
    reply_presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    reply_frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    # Tenants' tools: may the bot call endpoints on loopback/private addresses (the server's own network)?
    tools_allow_private_networks: bool = False
    # Chat sessions and websocket limits
    session_timeout_seconds: int = Field(default=3600, ge=1)
    # On SIGTERM: replies in flight get this long to finish (still streaming); what is cut off is stored incomplete.
    shutdown_grace_seconds: float = Field(default=10.0, ge=0)
    # Test hook (crash tests only): hold each reply's transaction open this long before its commit.
    test_commit_delay_seconds: float = Field(default=0.0, ge=0, le=10)
    ws_max_message_bytes: int = Field(default=64 * 1024, ge=1024)
    ws_rate_per_second: float = Field(default=5.0, gt=0)
    ws_rate_burst: int = Field(default=10, ge=1)
    max_connections_per_tenant: int = Field(default=200, ge=1)
    max_connections_per_client: int = Field(default=20, ge=1)  # per customer ref, else per IP address
    # A tenant's own splitter rules: how many, and their RE2 programs' size summed (instructions; bounds their cost).
    max_rules_per_tenant: int = Field(default=200, ge=0)
    max_rules_program_size: int = Field(default=50_000, ge=0)
    # A tenant's handbook (backend/context/handbook.py): its sections, one section's text, and all of it.
    max_handbook_sections: int = Field(default=200, ge=1)
    max_handbook_section_chars: int = Field(default=8_000, ge=100)
    max_handbook_chars: int = Field(default=400_000, ge=100)
    # The default tenant's first handbook, when a fresh install creates it: builtin, a Markdown file's path, or none.
    default_handbook: str = "builtin"
    # A socket whose unsent frames pass either bound is closed (1008): a client that stops reading.
    ws_max_queued_frames: int = Field(default=1024, ge=16)
    ws_max_queued_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024)
    # /metrics: when set, scrapers send "Authorization: Bearer <token>"; unset, only loopback clients are answered.
    metrics_token: str | None = None
    # Operator routes (``/admin/cache/settings``: engine-global cache settings): when set, callers send it as a bearer
    # token; unset, only loopback clients are answered. Never a tenant's key.
    operator_token: str | None = None
    max_request_bytes: int = Field(default=1024 * 1024, ge=1024)  # REST bodies; larger ones get a 413
    allowed_origins: list[str] = ["*"]
    # First start: the default tenant's keys. Unset → generated and printed once.
    bootstrap_chat_token: str | None = None
    bootstrap_admin_key: str | None = None

    @model_validator(mode="after")
    def _refuse_default_secrets(self) -> Self:
        # NOTE: a deployment that forgot to set its secret must fail loudly at start, not run with a public one.
        if self.env != Environment.DEVELOPMENT and self.secret_key in (None, "", DEV_SECRET):
            raise ValueError(f"KVCHAT_SECRET_KEY must be set to a non-default value when KVCHAT_ENV={self.env.value}")
        return self

    @model_validator(mode="after")
    def _refuse_test_hooks_in_production(self) -> Self:
        if self.env == Environment.PRODUCTION and self.test_commit_delay_seconds > 0:
            raise ValueError("KVCHAT_TEST_COMMIT_DELAY_SECONDS is a test hook; it must be 0 in production")
        return self

    @property
    def engine_replica_urls(self) -> list[str]:
        """The replicas cache control reaches (each one: a session's blocks may be on any after a failover); empty:
        the workers vllm-router lists at ``engine_url``, or ``engine_url`` itself (``RemoteEngine._discover``)."""
        return [u.strip().rstrip("/") for u in self.engine_replicas.split(",") if u.strip()]

    def engine_config(self) -> EngineConfig:
        return EngineConfig(
            model=self.model,
            device=self.engine_device,
            dtype=self.engine_dtype,
            max_kv_memory_mb=self.max_kv_memory_mb,
            quantization=self.engine_quantization,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_waiting=self.max_waiting,
            cache_dir=self.model_cache_dir,
            disk_cache_dir=str(self.kv_disk_cache_dir or self.data_dir / "kv_cache") if self.kv_disk_cache else None,
            cache_settings=CacheSettings(
                memory_ttl_s=self.kv_memory_ttl_s,
                disk_ttl_s=self.kv_disk_ttl_s,
                disk_cache_max_gb=self.kv_disk_cache_max_gb,
                min_free_space_gb=self.kv_min_free_space_gb,
                eviction_policy=self.kv_eviction_policy,
                pin_max_fraction=self.kv_pin_max_fraction,
            ),
        )

    @cached_property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return normalize_database_url(self.database_url)
        return f"sqlite+aiosqlite:///{(self.data_dir / 'kvchat.db').resolve()}"


def normalize_database_url(url: str) -> str:
    """Accept the usual spellings and pick the async driver (``postgres://`` → ``postgresql+asyncpg://``)."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+asyncpg://" + url[len(prefix) :]
    if url.startswith("sqlite:///"):
        return "sqlite+aiosqlite:///" + url[len("sqlite:///") :]
    return url
