"""Runtime settings of the tiered KV cache: TTLs, the disk cap and free-space floor, the eviction policy, pinning.

One immutable value; ``LLMEngine.configure_cache`` swaps it for a validated copy while the engine runs, so no setting
needs a restart. Block-type weights rank what eviction keeps longest: policy text and identifiers a support chat must
not lose outrank chit-chat and generated replies.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from types import MappingProxyType
from typing import Any

from engine.errors import InvalidRequestError

GIB = 1024**3
EVICTION_POLICIES = ("weighted", "lru")

DEFAULT_TYPE_WEIGHTS: Mapping[str, float] = MappingProxyType(
    {
        "system_prompt": 3.0,
        "policy_text": 3.0,
        "pinned_context": 2.5,
        "identifier": 2.5,
        "clause_reference": 2.0,
        "section": 2.0,
        "step": 1.5,
        "code": 1.5,
        "question": 1.0,
        "context": 1.0,
        "template": 1.0,
        "untyped": 1.0,
        "generated": 0.75,
    }
)


@dataclass(frozen=True, slots=True)
class CacheSettings:
    memory_ttl_s: float = 60.0  # an idle block moves from memory to disk after this (only with a disk tier)
    disk_ttl_s: float = 7 * 24 * 3600.0  # an untouched block leaves the disk after this
    disk_cache_max_gb: float = 10.0  # size cap of the disk tier (least recently used files go first)
    min_free_space_gb: float = 5.0  # below this much free space on the disk, writes are refused (and counted)
    eviction_policy: str = "lru"  # or "weighted" (temperature, type, recency): no better on our replay, see eviction.py
    type_weights: Mapping[str, float] = field(default_factory=lambda: DEFAULT_TYPE_WEIGHTS)
    pin_max_fraction: float = 0.25  # pinned blocks may hold at most this share of the memory pool

    def __post_init__(self) -> None:
        positive = {
            "memory_ttl_s": self.memory_ttl_s,
            "disk_ttl_s": self.disk_ttl_s,
            "disk_cache_max_gb": self.disk_cache_max_gb,
        }
        for name, value in positive.items():
            if not _finite(value) or value <= 0:
                raise InvalidRequestError(f"invalid cache setting: {name}={value!r} (a number > 0)")
        if not _finite(self.min_free_space_gb) or self.min_free_space_gb < 0:
            raise InvalidRequestError(f"invalid cache setting: min_free_space_gb={self.min_free_space_gb!r} (>= 0)")
        if self.eviction_policy not in EVICTION_POLICIES:
            choices = ", ".join(EVICTION_POLICIES)
            raise InvalidRequestError(f"invalid cache setting: eviction_policy={self.eviction_policy!r} ({choices})")
        if not _finite(self.pin_max_fraction) or not 0 <= self.pin_max_fraction <= 0.9:
            raise InvalidRequestError(f"invalid cache setting: pin_max_fraction={self.pin_max_fraction!r} (0 .. 0.9)")
        if not isinstance(self.type_weights, Mapping):
            raise InvalidRequestError("invalid cache setting: type_weights must map block types to numbers")
        for name, weight in self.type_weights.items():
            if not isinstance(name, str) or not name or not _finite(weight) or not 0 <= weight <= 100:
                raise InvalidRequestError(f"invalid cache setting: type_weights[{name!r}]={weight!r} (0 .. 100)")
        # NOTE: a private copy (a plain dict, so the config can be deep-copied and serialized); never mutated
        object.__setattr__(self, "type_weights", dict(self.type_weights))

    @property
    def disk_max_bytes(self) -> int:
        return int(self.disk_cache_max_gb * GIB)

    @property
    def min_free_bytes(self) -> int:
        return int(self.min_free_space_gb * GIB)

    def type_weight(self, block_types: frozenset[str] | tuple[str, ...]) -> float:
        """The weight of a block: its most valuable type's (1.0 for a type without a weight)."""
        return max((self.type_weights.get(t, 1.0) for t in block_types), default=1.0)

    def changed(self, **changes: Any) -> CacheSettings:
        """A validated copy with ``changes``; unknown names are refused. ``type_weights`` is merged, not replaced."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(changes) - known)
        if unknown:
            raise InvalidRequestError(f"unknown cache setting(s): {', '.join(unknown)}")
        if "type_weights" in changes and isinstance(changes["type_weights"], Mapping):
            changes["type_weights"] = {**self.type_weights, **changes["type_weights"]}
        try:
            return replace(self, **changes)
        except TypeError as exc:  # a value of the wrong kind (a string for a number...)
            raise InvalidRequestError(f"invalid cache setting: {exc}") from None

    def as_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["type_weights"] = dict(self.type_weights)
        return out


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
