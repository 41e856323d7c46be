"""The backend's one settings object (env prefix ``KVCHAT_``)."""

from __future__ import annotations

from enum import StrEnum
from functools import cached_property
from pathlib import Path
from typing import Literal, Self

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from backend.engine_client.values import CacheSettings, RepetitionScope
from engine.config import EngineConfig

DEV_SECRET = "dev-insecure-secret-change-me"


class Environment(StrEnum):
    DEVELOPMENT = "development"
    TEST = "test"
    PRODUCTION = "production"


class Settings(BaseSettings):
    """Every knob of the backend. Each field's ``description`` is its row in ``docs/configuration.md``
    (``python -m backend.core.config_doc`` writes it; a test holds the two equal)."""

    model_config = SettingsConfigDict(env_prefix="KVCHAT_", env_file=None, extra="ignore", frozen=True)

    env: Environment = Field(
        default=Environment.DEVELOPMENT,
        description="`development`, `test` or `production`; anything but development refuses the default secret",
    )
    host: str = Field(default="127.0.0.1", description="where the server listens")
    port: int = Field(default=8000, ge=1, le=65535, description="the server's port")
    # NOTE: several ``kvchat serve`` workers on one port act as one service through Postgres (backend/chat/fanout.py)
    reuse_port: bool = Field(
        default=False,
        description="let several `kvchat serve` workers listen on one port (Linux `SO_REUSEPORT`; Postgres only)",
    )
    data_dir: Path = Field(default=Path("data"), description="the embedded SQLite database and other local state")
    database_url: str | None = Field(
        default=None,
        description="e.g. `postgresql://user:pass@host:5432/kvchat` (the asyncpg driver is picked for you); "
        "unset: SQLite at `<data dir>/kvchat.db`",
    )
    secret_key: str | None = Field(
        default=None,
        description="the server secret the cache namespaces are derived from (HMAC-SHA256 of the tenant id); must be "
        "set outside development, and the same in every worker on one database (a worker with another one refuses "
        "to start). Unset in development: a random one is generated once into `<data dir>/cache_secret` (0600)",
    )
    log_level: str = Field(default="info", description="the server's log level (`debug` shows health-probe requests)")
    log_format: Literal["text", "json"] = Field(
        default="text", description="`json`: one JSON object a line, with request and session ids"
    )
    run_migrations_on_start: bool = Field(default=True, description="run `alembic upgrade head` when the server starts")
    gc_freeze: bool = Field(
        default=True,
        description="collect once at start, then keep the start's objects out of full garbage collections while "
        "serving (a full pass would stall every request; `backend/core/heap.py`). The test suite turns it off: "
        "its collection at every app start dominates a test process that starts hundreds",
    )
    # Engine (in-process)
    model: str = Field(
        default="smollm2",
        description="`smollm2` (packaged SmolLM2-135M-Instruct), a HF safetensors folder, or a `.gguf` file",
    )
    engine_device: str = Field(default="auto", description="`cpu`, `cuda` or `auto`")
    engine_dtype: str = Field(default="auto", description="`auto`: bf16 where the CPU supports it, else fp32")
    max_kv_memory_mb: int = Field(default=512, ge=1, description="size of the paged KV pool (MiB)")
    engine_drafts: bool = Field(
        default=False,
        description="suffix drafts (issue 44), verified exactly: the engine drafts a reply's next tokens from the "
        "tenant's earlier replies and keeps those the model would have written; needs the `spec` extra "
        "(arctic-inference). The default of every tenant that did not choose: a tenant's own setting (`PUT "
        "/admin/tenant/drafts`, `on`/`off`/`default`) wins over it, and a `/v1` request's `drafts` field over both. "
        "Off by default: with the chat's repetition penalty they gained nothing here (docs/benchmarks.md)",
    )
    engine_step_trace: Path | None = Field(
        default=None,
        description="a file that gets one JSON line per engine step: its forward pass's time and, per tenant, the "
        "sequences, prefill tokens, decode and draft rows it held, and the running and waiting sequences (for finding "
        "which steps a reply waited behind under load; ~200 bytes a step). Unset: off",
    )
    engine_adapt_threads: bool = Field(
        default=True,
        description="run each engine step on the cores the rest of the machine leaves it: fewer OpenMP threads "
        "while other processes (or the backend's own threads) hold cores, since a step's threads wait for each other "
        "at ~150 barriers and a descheduled one stalls them all; only where the width never changes a bit (the C "
        "kernels; not AMX's dense-copy GEMMs). Off: always the torch thread count",
    )
    engine_quantization: Literal["int8"] | None = Field(
        default=None,
        description="`int8`: weight-only int8 on CPU (slightly different outputs; faster only with AVX-512 int8)",
    )
    max_num_seqs: int = Field(default=32, ge=1, description="sequences per engine step (continuous batching)")
    max_num_batched_tokens: int = Field(default=2048, ge=1, description="tokens per engine step")
    max_waiting: int = Field(
        default=256, ge=1, description="queued requests beyond this are refused as busy (with a retry-after)"
    )
    cache_dir: str | None = Field(
        default=None,
        description="the one cache folder of every command (`serve`, `engine-serve`, `generate`, `doctor`): "
        "converted models under `<cache dir>/models`, the C kernels under `<cache dir>/kernels`; unset: "
        "`~/.cache/kvchat`",
    )
    model_cache_dir: str | None = Field(
        default=None,
        description="deprecated: read as `KVCHAT_CACHE_DIR` (with a warning) when that is unset; removed in the "
        "next release",
    )
    # Where the engine runs (docs/scale-out.md)
    engine_mode: Literal["inproc", "process", "remote"] | None = Field(
        default=None,
        description="`inproc`: in this process; `process`: in one child process per machine, on a unix socket, "
        "shared by every worker there (restarted when it exits); `remote`: the replicas at `KVCHAT_ENGINE_URL`. "
        "Unset: `remote` when the engine URL is set, else `inproc`",
    )
    engine_process_dir: Path | None = Field(
        default=None,
        description="`process` mode: the folder of the engine's unix socket, lock and log (mode 0700; one per "
        "machine, the same for every worker); unset: `<data dir>/engine`",
    )
    engine_url: str | None = Field(
        default=None,
        description="a remote engine: vllm-router or one `kvchat engine-serve` replica; unset, the engine runs in "
        "this process ([scale-out](scale-out.md))",
    )
    engine_replicas: str = Field(
        default="",
        description="every replica behind the engine URL, comma-separated, for cache control; empty: the workers "
        "the router lists (read again every minute)",
    )
    engine_secret: str | None = Field(
        default=None,
        description="the shared secret between the backend and its replicas (`Authorization: Bearer`); a replica "
        "refuses a non-loopback host without one",
    )
    engine_timeout_s: float = Field(default=30.0, gt=0, description="a replica silent this long is given up on")
    engine_retries: int = Field(
        default=2, ge=0, description="tries again on another replica before the first token when one fails"
    )
    # The KV cache's disk tier and the cache settings a start begins with (the operator changes them at runtime
    # through ``/admin/cache/settings``, until the process stops).
    kv_disk_cache: bool = Field(
        default=True, description="the KV cache's disk tier (survives restarts); `false`: memory only"
    )
    kv_disk_cache_dir: Path | None = Field(
        default=None, description="the disk tier's folder; unset: `<data dir>/kv_cache`"
    )
    kv_memory_ttl_s: float = Field(default=60.0, gt=0, description="an idle block moves to disk after this long")
    kv_disk_ttl_s: float = Field(
        default=7 * 24 * 3600.0, gt=0, description="an idle block leaves the disk after this long"
    )
    kv_disk_cache_max_gb: float = Field(default=10.0, gt=0, description="size cap of the disk tier")
    kv_min_free_space_gb: float = Field(
        default=5.0, ge=0, description="below this free space disk writes are refused (and counted); serving goes on"
    )
    kv_eviction_policy: Literal["weighted", "lru"] = Field(
        default="lru",
        description="`lru` or `weighted` (temperature, block type, recency: [kv_tiers](kv_tiers.md)); LRU won the "
        "replay",
    )
    kv_pin_max_fraction: float = Field(
        default=0.25, ge=0, le=0.9, description="the share of the memory pool pinned prefixes may hold"
    )
    # Replies
    reply_max_tokens: int = Field(default=256, ge=1, description="the longest chat reply, in tokens")
    reply_temperature: float = Field(
        default=0.0,
        ge=0.0,
        le=2.0,
        description="chat replies' temperature (0: greedy); a tenant's reply settings replace this and the six below",
    )
    reply_top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="chat replies' top-p (1: off)")
    reply_top_k: int = Field(default=0, ge=0, description="chat replies' top-k (0: off)")
    reply_min_p: float = Field(default=0.0, ge=0.0, le=1.0, description="chat replies' min-p (0: off)")
    reply_repetition_penalty: float = Field(
        default=1.2,
        ge=0.01,
        le=2.0,
        description="against replies that loop; 1.2 from the measurement in [benchmarks](benchmarks.md)",
    )
    reply_repetition_penalty_scope: RepetitionScope = Field(
        default=RepetitionScope.REPLY,
        description="the tokens the repetition penalty covers: `reply` (the reply's own: as few loops, replies that "
        "end on their own, and the prompt's wording free to quote and to draft; [benchmarks](benchmarks.md)) or `all` "
        "(the prompt's too, vLLM's way)",
    )
    reply_presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="chat replies' presence penalty")
    reply_frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0, description="chat replies' frequency penalty")
    tools_allow_private_networks: bool = Field(
        default=False,
        description="may tenants' tools be on loopback, private or link-local addresses "
        "([chat_tools](chat_tools.md)); a tool the policy refuses is refused when it is registered",
    )
    # Chat sessions and websocket limits
    session_timeout_seconds: int = Field(
        default=3600, ge=1, description="idle sessions are closed and their cache released"
    )
    shutdown_grace_seconds: float = Field(
        default=10.0,
        ge=0,
        description="on SIGTERM, replies in flight get this long to finish (still streaming); what is cut off is "
        "stored `incomplete`",
    )
    turn_submit_concurrency: int = Field(
        default=8,
        ge=1,
        description="customer messages checked and stored at once, all tenants together (a turn's steps 1-2: "
        "[turn_path](turn_path.md)); the slot that frees goes to the waiting tenant holding the fewest, so one "
        "tenant's burst does not queue the others' messages. Below the Postgres pool's 20 connections, so a "
        "message let in finds a connection: the gate, not the pool's first-come queue, decides who goes next",
    )
    test_commit_delay_seconds: float = Field(
        default=0.0,
        ge=0,
        le=10,
        description="test hook (crash tests): hold each reply's transaction open this long; refused in production",
    )
    ws_max_message_bytes: int = Field(
        default=64 * 1024, ge=1024, description="larger websocket frames close the socket with 1009"
    )
    ws_compression: bool = Field(
        default=False,
        description="websocket permessage-deflate; off, since a reply's deltas are a few bytes each and every "
        "socket would hold a compressor and a decompressor (CPU per frame, memory per socket)",
    )
    ws_rate_per_second: float = Field(default=5.0, gt=0, description="per-connection frame rate limit")
    ws_rate_burst: int = Field(default=10, ge=1, description="per-connection frame burst")
    max_connections_per_tenant: int = Field(
        default=200, ge=1, description="a tenant's sockets; further ones are closed with 1013"
    )
    max_connections_per_client: int = Field(
        default=20,
        ge=1,
        description="sockets per client of a tenant (its `external_ref`, else its IP address); further ones are "
        "closed with 1013",
    )
    max_rules_per_tenant: int = Field(
        default=200, ge=0, description="a tenant's own splitter rules; past it, a new rule is a 422 `rule_limit`"
    )
    max_rules_program_size: int = Field(
        default=50_000,
        ge=0,
        description="a tenant's splitter rules' compiled RE2 programs, summed (instructions: what they cost per "
        "message)",
    )
    max_handbook_sections: int = Field(default=200, ge=1, description="sections in a tenant's handbook")
    max_handbook_section_chars: int = Field(default=8_000, ge=100, description="characters in one handbook section")
    max_handbook_chars: int = Field(default=400_000, ge=100, description="characters in a whole handbook")
    default_handbook: str = Field(
        default="builtin",
        description="the default tenant's first handbook on a fresh install: `builtin`, a Markdown file's path, "
        "or `none`",
    )
    ws_max_queued_frames: int = Field(
        default=1024, ge=16, description="a socket with more unsent frames (a client that stopped reading) is closed"
    )
    ws_max_queued_bytes: int = Field(
        default=4 * 1024 * 1024, ge=64 * 1024, description="a socket with more unsent bytes is closed (1008)"
    )
    metrics_token: str | None = Field(
        default=None, description="the bearer token `/metrics` requires; unset, it answers loopback clients only"
    )
    operator_token: str | None = Field(
        default=None,
        description="the bearer token of the operator routes (`/admin/cache/...`); unset, they answer loopback "
        "clients only. Never a tenant's key",
    )
    max_request_bytes: int = Field(
        default=1024 * 1024,
        ge=1024,
        description="REST request bodies over this get a 413 (`request_too_large`); a `/v1/chat/completions` body"
        " also past the largest one a usable request can take (1.7 MB for SmolLM2: `backend/openai/body_bound.py`)",
    )
    allowed_origins: list[str] = Field(
        default=["*"],
        description="the Origins the chat websocket accepts (a JSON list; `*`: any); others are closed with 1008",
    )
    bootstrap_chat_token: str | None = Field(
        default=None, description="the default tenant's chat token on the first start; unset: generated and printed"
    )
    bootstrap_admin_key: str | None = Field(
        default=None, description="the default tenant's admin key on the first start; unset: generated and printed"
    )

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

    @model_validator(mode="after")
    def _remote_needs_a_url(self) -> Self:
        if self.engine_mode == "remote" and not self.engine_url:
            raise ValueError("KVCHAT_ENGINE_MODE=remote needs KVCHAT_ENGINE_URL (the router or a replica)")
        return self

    @property
    def resolved_engine_mode(self) -> Literal["inproc", "process", "remote"]:
        """``engine_mode``, else ``remote`` when an engine URL is set, else ``inproc``."""
        return self.engine_mode or ("remote" if self.engine_url else "inproc")

    @property
    def resolved_engine_process_dir(self) -> Path:
        return self.engine_process_dir or self.data_dir / "engine"

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
            drafts=self.engine_drafts,
            step_trace=str(self.engine_step_trace) if self.engine_step_trace else None,
            adapt_threads=self.engine_adapt_threads,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_waiting=self.max_waiting,
            cache_dir=self.resolved_cache_dir,
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

    @property
    def resolved_cache_dir(self) -> str | None:
        """``cache_dir``, else the deprecated ``model_cache_dir`` (``deprecated_settings`` names it); None: the
        engine's default (``engine.model.loader.default_cache_dir``)."""
        return self.cache_dir or self.model_cache_dir

    def deprecated_settings(self) -> list[str]:
        """One warning line per deprecated setting in use, for the commands to log once at their start."""
        if self.model_cache_dir and not self.cache_dir:
            return [
                "KVCHAT_MODEL_CACHE_DIR is deprecated and will be removed in the next release: it is read as "
                "KVCHAT_CACHE_DIR (models and kernels, for every command); set that instead"
            ]
        if self.model_cache_dir:
            return ["KVCHAT_MODEL_CACHE_DIR is deprecated and ignored: KVCHAT_CACHE_DIR is set and holds every cache"]
        return []

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
