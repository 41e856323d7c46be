"""Draft tokens from suffix trees (SuffixDecoding, arXiv 2411.04975), over Snowflake's ``arctic-inference`` trees.

Two sources, as in the paper: the request's own tree (its prompt and its reply so far) and its tenant's tree (the
replies that tenant's requests produced recently, FIFO-bounded at ``max_cached_replies``). The draft is the better
scored of the two continuations of the sequence's last ``max_tree_depth`` tokens, at most ``max_spec_factor * match +
max_spec_offset`` tokens long (as the paper and vLLM's ``suffix`` method). How much of it is verified is the cost
model's choice (``LiveCostModel.rows``): from the tree's estimate that each token follows, scaled by the acceptance
measured on the request's earlier drafts, and the measured cost of a verify row at the step's batch size.

Isolation: a tenant's tree is its own ``SuffixDecodingCache``, keyed by the request's namespace, so one tenant's text
is never proposed to another (acceptance speed would be a timing channel between tenants). A session's erasure
removes its replies from its tenant's tree. At most ``max_tenants`` trees are kept; the least recently used idle one
is dropped first.

The engine calls every method under its lock (the step thread and erasure both hold it).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from engine.spec.cost_model import Acceptance, LiveCostModel, score

try:  # NOTE: optional (the `spec` extra): it builds its C++ tree from the sdist. Without it the engine drafts nothing.
    from arctic_inference.suffix_decoding import SuffixDecodingCache  # type: ignore[import-not-found,unused-ignore]
except ImportError:  # pragma: no cover - exercised where the extra is not installed
    SuffixDecodingCache = None


def available() -> bool:
    """Whether suffix drafts can be made here (``arctic-inference`` is installed)."""
    return SuffixDecodingCache is not None


@dataclass(frozen=True, slots=True)
class DraftSettings:
    max_draft_tokens: int = 24  # the longest draft asked of the tree (the cost model verifies a prefix of it)
    max_tree_depth: int = 24  # the longest context matched (and the deepest tree node); the paper's and vLLM's 24
    max_spec_factor: float = 1.0  # draft at most factor * matched length + offset tokens
    max_spec_offset: float = 0.0
    min_token_prob: float = 0.1  # stop a draft at a node whose estimated probability falls below this
    max_cached_replies: int = 1000  # replies kept per tenant tree (FIFO)
    max_tenants: int = 64  # tenant trees kept (LRU over idle ones)


@dataclass(slots=True)
class _Active:
    key: int  # the tree's request key (ours, never the caller's id: ids may be reused)
    tenant: Hashable
    session: str | None
    prompt: list[int]
    fed: int = 0  # reply tokens already in the trees
    acceptance: Acceptance = field(default_factory=lambda: Acceptance(0.5))  # its own, against the engine's
    last: tuple[list[int], list[float], int] | None = None  # the last draft: tokens, tree probs, reply length then


class SuffixDrafter:
    """Per-request and per-tenant suffix trees; ``propose`` gives a request's draft for its next step."""

    def __init__(self, settings: DraftSettings | None = None, cost: LiveCostModel | None = None) -> None:
        if SuffixDecodingCache is None:
            raise RuntimeError("suffix drafts need arctic-inference (pip install 'kvchat[spec]')")
        self.settings = settings or DraftSettings()
        self.cost = cost  # when drafts pay (engine.spec.cost_model); the engine's scheduler asks its ``limit``
        self._tenants: OrderedDict[Hashable, SuffixDecodingCache] = OrderedDict()
        self._active: dict[str, _Active] = {}
        self._cached: dict[tuple[Hashable, str | None], set[int]] = {}  # (tenant, session) -> reply keys kept
        self._keys = itertools.count()

    @property
    def active(self) -> list[str]:
        return list(self._active)

    def begin(self, request_id: str, tenant: Hashable, prompt: Sequence[int], *, session: str | None = None) -> None:
        """Start drafting for a request: its prompt goes into its own tree; its reply will go into its tenant's."""
        if request_id in self._active:
            raise ValueError(f"request {request_id!r} is already drafting")
        state = _Active(next(self._keys), tenant, session, list(prompt))
        self._tenant(tenant).start_request(state.key, state.prompt)
        self._active[request_id] = state
        self._cached.setdefault((tenant, session), set()).add(state.key)

    def is_active(self, request_id: str) -> bool:
        return request_id in self._active

    def propose(self, request_id: str, output: Sequence[int], max_tokens: int, decoding: int = 1) -> list[int]:
        """The draft (at most ``max_tokens`` tokens) that follows ``prompt + output``, as much of it as pays for one
        of ``decoding`` sequences in a step (the cost model's choice; all of it without one). ``output`` is the
        request's whole reply so far (what is new since the last call is added to the trees first)."""
        state = self._active[request_id]
        cache = self._tenant(state.tenant)
        if len(output) > state.fed:
            cache.add_active_response(state.key, list(output[state.fed :]))
            state.fed = len(output)
        self._score(state, output)
        limit = min(max_tokens, self.settings.max_draft_tokens)
        if limit <= 0:
            return []
        depth = self.settings.max_tree_depth
        tail = list(output[-depth:])
        context = state.prompt[len(state.prompt) - (depth - len(tail)) :] + tail if len(tail) < depth else tail
        s = self.settings
        draft = cache.speculate(state.key, context, limit, s.max_spec_factor, s.max_spec_offset, s.min_token_prob)
        tokens, probs = list(draft.token_ids)[:limit], list(draft.probs)[:limit]
        state.last = (tokens, probs, len(output)) if tokens else None
        if self.cost is None:
            return tokens
        return tokens[: self.cost.rows(decoding, probs, state.acceptance)]

    def _score(self, state: _Active, output: Sequence[int]) -> None:
        """How the last draft fared against the tokens produced since (verified or not: NOTE: a draft the cost model
        did not verify is scored too, so a request whose rate fell is seen to recover without verify rows)."""
        if state.last is None or len(output) <= state.last[2]:
            return
        tokens, probs, at = state.last
        passed, expected = score(tokens, probs, output[at:])
        state.acceptance.observe(passed, expected)
        if self.cost is not None:
            self.cost.acceptance.observe(passed, expected)
        state.last = None

    def end(self, request_id: str, output: Sequence[int], keep: bool) -> None:
        """The request finished: its own tree goes; its reply stays in its tenant's tree when ``keep`` (a completed
        reply), else it is removed (an aborted or failed one)."""
        state = self._active.pop(request_id, None)
        if state is None:
            return
        cache = self._tenant(state.tenant)
        if len(output) > state.fed and keep:
            cache.add_active_response(state.key, list(output[state.fed :]))
        cache.stop_request(state.key)
        if not keep:
            self._forget(state.tenant, state.session, state.key)

    def erase_session(self, tenant: Hashable, session: str) -> int:
        """Remove every reply of ``session`` from ``tenant``'s tree (erasure); returns how many went."""
        keys = self._cached.pop((tenant, session), set())
        cache = self._tenants.get(tenant)
        gone = 0
        for key in keys:
            if cache is not None and key in cache.cached_requests:
                cache.evict_cached_response(key)
                gone += 1
        return gone

    def _forget(self, tenant: Hashable, session: str | None, key: int) -> None:
        cache = self._tenants.get(tenant)
        if cache is not None and key in cache.cached_requests:
            cache.evict_cached_response(key)
        self._cached.get((tenant, session), set()).discard(key)

    def _tenant(self, tenant: Hashable) -> SuffixDecodingCache:
        cache = self._tenants.get(tenant)
        if cache is None:
            s = self.settings
            cache = SuffixDecodingCache(s.max_tree_depth, max_cached_requests=s.max_cached_replies)
            self._tenants[tenant] = cache
            self._evict_tenants()
        self._tenants.move_to_end(tenant)
        return cache

    def _evict_tenants(self) -> None:
        """Drop the least recently used tenant trees beyond ``max_tenants`` that no active request drafts from."""
        busy = {a.tenant for a in self._active.values()}
        for tenant in list(self._tenants):
            if len(self._tenants) <= self.settings.max_tenants:
                return
            if tenant not in busy:
                del self._tenants[tenant]
                for key in [k for k in self._cached if k[0] == tenant]:
                    del self._cached[key]
