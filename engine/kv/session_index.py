"""Which chat sessions still want which cached blocks: ``session key -> chain of block hashes`` plus per-hash counts.

The engine records a session's chain (prompt + generated full blocks of its most recent request) when the request
finishes, with its head: how many leading blocks hold the prompt's system message(s). When the session closes
(inactivity timeout, admin close) ``release`` returns the hashes no other session references any more, and
``KVCacheManager.evict_cached`` drops those that no running request holds either. The head is never returned: every
conversation of the deployment starts with it, so the next one would compute it again (it stays cached, evicted by LRU
like any idle block when memory runs short). When part of its context changes, ``truncate`` cuts the chain where the
change starts, and ``wanted_by_others`` names the hashes an invalidation must keep (``KVCacheManager.invalidate``).

Pure bookkeeping over hashes: it never looks at the pool, so a hash it returns may already have been evicted by LRU.
"""

from __future__ import annotations

from collections.abc import Sequence, Set

from engine.kv.block_hash import BlockHash


class SessionIndex:
    def __init__(self) -> None:
        self._chains: dict[str, tuple[BlockHash, ...]] = {}
        self._heads: dict[str, int] = {}  # leading blocks of a chain that release keeps (the system message's)
        # NOTE: counts sessions, not occurrences: a hash listed twice in one chain counts once, so one release can
        # never take a count below what the other sessions contribute. A hash whose count would be 0 is not stored.
        self._sessions_per_hash: dict[BlockHash, int] = {}

    def __len__(self) -> int:
        return len(self._chains)

    def __contains__(self, session_key: object) -> bool:
        return session_key in self._chains

    def chain(self, session_key: str) -> tuple[BlockHash, ...]:
        """The session's recorded chain (empty for an unknown session)."""
        return self._chains.get(session_key, ())

    def sessions_of(self, block_hash: BlockHash) -> int:
        """How many sessions reference ``block_hash``."""
        return self._sessions_per_hash.get(block_hash, 0)

    def wanted_by_others(self, session_key: str | None) -> set[BlockHash]:
        """Hashes some session other than ``session_key`` references (every referenced hash when it is None).

        NOTE: a scan of every indexed hash: invalidations follow context edits and topic shifts, not tokens, and a
        per-session reverse index would cost memory on every record instead.
        """
        own = set(self._chains.get(session_key, ())) if session_key is not None else set()
        return {h for h, n in self._sessions_per_hash.items() if n > (h in own)}

    def truncate(self, session_key: str, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` hashes of the session's chain (an invalidation took the rest)."""
        if session_key in self._chains:
            self.record(session_key, self._chains[session_key][:num_blocks], self._heads.get(session_key, 0))

    def record(self, session_key: str, chain: Sequence[BlockHash], head: int = 0) -> None:
        """Set the session's chain, replacing its previous one (counts of hashes it no longer lists drop by one);
        its first ``head`` blocks hold the prompt's system message(s)."""
        new = tuple(dict.fromkeys(chain))
        old = self._chains.get(session_key, ())
        self._heads[session_key] = min(head, len(new))
        # NOTE: add before removing so a hash in both chains never passes through 0 (and is never dropped from the map).
        for block_hash in new:
            self._sessions_per_hash[block_hash] = self._sessions_per_hash.get(block_hash, 0) + 1
        self._chains[session_key] = new
        self._unref(old)

    def cut_at(self, hashes: Set[BlockHash]) -> list[str]:
        """Truncate every chain at its first hash in ``hashes`` (shared text they pass through changed); returns the
        sessions cut. A chain's later blocks depend on that one, so nothing past it can still be wanted."""
        cut = []
        for session_key, chain in list(self._chains.items()):
            first = next((i for i, h in enumerate(chain) if h in hashes), None)
            if first is not None:
                self.truncate(session_key, first)
                cut.append(session_key)
        return cut

    def release(self, session_key: str) -> list[BlockHash]:
        """Forget the session. Returns the hashes of its chain past its head that no other session references, tail
        first.

        Unknown sessions return ``[]``. Tail first matches ``KVCacheManager.free``: a chain's tail is dropped before
        its earlier turns.
        """
        chain = self._chains.pop(session_key, None)
        if chain is None:
            return []
        head = set(chain[: self._heads.pop(session_key, 0)])
        return [h for h in self._unref(chain) if h not in head][::-1]

    def _unref(self, chain: tuple[BlockHash, ...]) -> list[BlockHash]:
        """Drop one count per hash; returns the hashes that reached 0, in chain order."""
        orphans = []
        for block_hash in chain:
            n = self._sessions_per_hash[block_hash] - 1
            if n == 0:
                del self._sessions_per_hash[block_hash]
                orphans.append(block_hash)
            else:
                self._sessions_per_hash[block_hash] = n
        return orphans
