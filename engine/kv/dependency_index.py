"""Parent -> children links of published blocks: which cached blocks depend on which.

The cache is causal: block ``h_i`` holds K/V computed from every token before it, so it depends on its parent
``h_{i-1}`` and, through it, on the whole chain back to the namespace root. Freeing a block must free its subtree of
cached descendants too (they are unreachable for a match, which walks the chain from the root, and stale for whoever
invalidated the parent).

NOTE: edges are keyed by hash and kept while the child is published, whether or not the parent still is: LRU may
evict a parent before its children, and an invalidation that names that parent must still find them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.kv.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class _Link:
    parent: BlockHash
    root: BlockHash  # the chain's namespace root (block_hash.root_hash)


class DependencyIndex:
    def __init__(self) -> None:
        self._links: dict[BlockHash, _Link] = {}
        # NOTE: dicts used as ordered sets, so subtree order (and so free-queue order) is deterministic.
        self._children: dict[BlockHash, dict[BlockHash, None]] = {}

    def __len__(self) -> int:
        return len(self._links)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._links

    def add(self, block_hash: BlockHash, parent: BlockHash, root: BlockHash) -> None:
        """Record a block as it is published (``parent`` is ``root`` for a chain's first block)."""
        if block_hash in self._links:
            raise ValueError("block hash is already linked")
        self._links[block_hash] = _Link(parent, root)
        self._children.setdefault(parent, {})[block_hash] = None

    def remove(self, block_hash: BlockHash) -> None:
        """Forget a block as it is unpublished; its own children keep their link to it."""
        link = self._links.pop(block_hash, None)
        if link is None:
            return
        siblings = self._children[link.parent]
        del siblings[block_hash]
        if not siblings:
            del self._children[link.parent]

    def parent(self, block_hash: BlockHash) -> BlockHash | None:
        link = self._links.get(block_hash)
        return None if link is None else link.parent

    def root_of(self, block_hash: BlockHash) -> BlockHash | None:
        link = self._links.get(block_hash)
        return None if link is None else link.root

    def children(self, block_hash: BlockHash) -> list[BlockHash]:
        return list(self._children.get(block_hash, ()))

    def subtree(self, block_hash: BlockHash) -> list[BlockHash]:
        """``block_hash`` (when published) and every published descendant, parents before children (pre-order)."""
        out = [block_hash] if block_hash in self._links else []
        stack = self.children(block_hash)[::-1]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(self.children(node)[::-1])
        return out
