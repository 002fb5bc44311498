"""The radix tree under RadixCache (pddnet/kv/radix.py): its nodes, walks, splits, the lock
accounting that says which blocks eviction may take, and the least-recently-used order.

Granularity. Only FULL blocks are cached, so every edge spans a whole number of blocks and a node
splits only at block boundaries. Children are keyed by the tokens of their first block (by the
token itself when a block is one token).

Locks. A block is *locked* while a request references it (allocator refcount > 1: the tree holds
one reference itself) or it is pinned. A block is *evictable* when neither it nor any block below
it is locked: repeated leaf eviction can free it. Each node keeps its deepest locked block, how
many descendants hold a locked block and how many of its blocks are evictable, so that
``num_evictable`` is a counter, not a walk.

LRU. Eviction takes the least recently used evictable leaf: a heap of (last_access, uid) entries
pushed when a leaf becomes evictable or is touched, validated when popped (stale ones skipped),
rebuilt when stale ones pile up; so an eviction costs O(log leaves), not a pass over every leaf.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence
from itertools import groupby

from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.prefix_cache import PrefixMatch
from pddnet.kv.radix_node import LruEntry, RadixNode


class RadixTree:
    """The tree's structure and bookkeeping; RadixCache adds the cache's operations on top."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.allocator = allocator
        self.block_size = block_size
        self._uids = itertools.count(1)
        self._root = RadixNode(0, None, (), [], [])
        # owned block id -> its node (None: not cached), indexed like the allocator's ids
        self._node_of: list[RadixNode | None] = [None] * allocator.num_blocks
        self._num_cached = 0
        self._pins: dict[int, int] = {}
        self._leaves: set[RadixNode] = set()
        self._num_evictable = 0
        self._clock = 0
        self._rc = allocator.refcounts()  # read-only fast path for owned ids
        self._lru: list[LruEntry] = []  # the eviction heap (see the module docstring)
        self._lru_epoch = 0

    # -- queries ----------------------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached * self.block_size

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_nodes(self) -> int:
        count, stack = 0, list(self._root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    def is_cached(self, block_id: int) -> bool:
        return self._owner(block_id) is not None

    def is_pinned(self, block_id: int) -> bool:
        return self._pins.get(block_id, 0) > 0

    def snapshot_hashes(self) -> list[int]:
        """Every cached block's chained hash (for a full resync of a stale view)."""
        out: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            out += node.hashes
            stack.extend(node.children.values())
        return out

    # -- structure, locks and LRU order --------------------------------------------------------------

    def _limit(self, token_ids: Sequence[int], max_blocks: int | None) -> int:
        full = len(token_ids) // self.block_size
        return full if max_blocks is None else max(0, min(max_blocks, full))

    def _walk(self, tokens: tuple[int, ...], limit: int) -> list[tuple[RadixNode, int]]:
        """Matched (node, blocks matched in it) from the root; only the last may be partial."""
        bs = self.block_size
        path: list[tuple[RadixNode, int]] = []
        node, i = self._root, 0
        while i < limit:
            child = node.children.get(tokens[i] if bs == 1 else tokens[i * bs : (i + 1) * bs])
            if child is None:
                break
            nb = len(child.blocks)
            n = nb if nb <= limit - i else limit - i
            if (
                n == 1
                or (child.tokens if n == nb else child.tokens[: n * bs])
                == tokens[i * bs : (i + n) * bs]
            ):
                m = n  # (the first block matched: it is the key)
            else:
                # the longest matching run of blocks, 1 <= m < n: bisect on equal prefixes
                lo, hi = 1, n
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if child.tokens[: mid * bs] == tokens[i * bs : (i + mid) * bs]:
                        lo = mid
                    else:
                        hi = mid
                m = lo
            path.append((child, m))
            i += m
            if m < nb:
                break
            node = child
        return path

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut ``node`` after its first ``m`` blocks; returns the new upper node."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None and 0 < m < len(node.blocks)
        upper = RadixNode(
            next(self._uids),
            parent,
            node.tokens[: m * bs],
            node.blocks[:m],
            node.hashes[:m],
            last_access=node.last_access,
        )
        parent.children[self._key(upper.tokens)] = upper
        node.tokens, node.blocks, node.hashes = (
            node.tokens[m * bs :],
            node.blocks[m:],
            node.hashes[m:],
        )
        node.parent = upper
        upper.children[self._key(node.tokens)] = node
        for b in upper.blocks:
            self._node_of[b] = upper
        # Recount the two halves; the ancestors now may have one more node with a locked block.
        had_locked = node.last_locked >= 0
        self._num_evictable -= node.evictable
        node.evictable = 0
        self._scan(node)
        self._scan(upper)
        upper.locked_below = node.locked_below + (node.last_locked >= 0)
        self._refresh(node)
        self._refresh(upper)
        delta = int(upper.last_locked >= 0) + int(node.last_locked >= 0) - int(had_locked)
        up: RadixNode | None = parent
        while up is not self._root and delta:
            assert up is not None
            up.locked_below += delta
            up = up.parent
        return upper

    def _key(self, tokens: tuple[int, ...]) -> object:
        """A child's key in its parent: its first block's tokens (the token itself for
        one-token blocks: an int key hashes and compares without a tuple around it)."""
        return tokens[0] if self.block_size == 1 else tokens[: self.block_size]

    def _detach(self, node: RadixNode, key: object) -> RadixNode:
        """Remove an emptied leaf (``key``: its first block's tokens); returns its parent, which
        may become a leaf."""
        parent = node.parent
        assert parent is not None and not node.blocks and not node.children
        del parent.children[key]
        node.parent = None
        self._leaves.discard(node)
        if not parent.children and parent is not self._root:
            self._leaves.add(parent)
        return parent

    def _owner(self, block_id: object) -> RadixNode | None:
        """The node owning a block id, None when it is not cached (or not a block id at all:
        for ids a caller passed in, unchecked)."""
        if type(block_id) is int and 0 <= block_id < len(self._node_of):
            return self._node_of[block_id]
        return None

    def _locked(self, block_id: int) -> bool:
        return self.allocator.refcount(block_id) > 1 or self._pins.get(block_id, 0) > 0

    def _scan(self, node: RadixNode) -> None:
        """Recompute a node's deepest locked block, scanning from the tail (a request in use
        locks whole paths, so this usually stops at once). Owned ids are valid: unchecked."""
        blocks, rc, pins = node.blocks, self._rc, self._pins
        last = len(blocks) - 1
        if (
            last >= 0
            and rc[blocks[last]] <= 1
            and not pins
            and max(map(rc.__getitem__, blocks)) <= 1
        ):
            node.last_locked = -1  # nothing locked (a request just let go): C speed
            return
        if pins:
            while last >= 0 and rc[blocks[last]] <= 1 and pins.get(blocks[last], 0) <= 0:
                last -= 1
        else:
            while last >= 0 and rc[blocks[last]] <= 1:
                last -= 1
        node.last_locked = last

    def _refresh(self, node: RadixNode) -> None:
        want = 0 if node.locked_below else len(node.blocks) - (node.last_locked + 1)
        self._num_evictable += want - node.evictable
        node.evictable = want
        if want and not node.children:
            self._offer_leaf(node)

    def _offer_leaf(self, node: RadixNode) -> None:
        """Give an evictable leaf its entry in the eviction heap at its current last_access
        (unless it has that entry already)."""
        if (
            node.children
            or not node.evictable
            or node.parent is None
            or (node.heap_at == node.last_access and node.heap_epoch == self._lru_epoch)
        ):
            return
        heap = self._lru
        if len(heap) > 2 * len(self._leaves) + 64:
            # mostly stale entries: rebuild from the evictable leaves (amortised O(1) a push)
            self._lru_epoch += 1
            heap.clear()
            for x in self._leaves:
                if x.evictable and x.parent is not None:
                    x.heap_at, x.heap_epoch = x.last_access, self._lru_epoch
                    heap.append(LruEntry(x.last_access, x.uid, x))
            heapq.heapify(heap)
            if node.heap_at == node.last_access and node.heap_epoch == self._lru_epoch:
                return
        node.heap_at, node.heap_epoch = node.last_access, self._lru_epoch
        heapq.heappush(heap, LruEntry(node.last_access, node.uid, node))

    def _recount(self, node: RadixNode) -> None:
        """A node's lock state may have changed: rescan it, propagate to its ancestors."""
        before = node.last_locked >= 0
        self._scan(node)
        self._refresh(node)
        delta = int(node.last_locked >= 0) - int(before)
        up = node.parent
        while up is not None and up is not self._root:
            if delta:
                up.locked_below += delta
            self._refresh(up)
            up = up.parent

    def _relock(self, block_ids: Iterable[int]) -> None:
        nodes = self._nodes(block_ids)
        if nodes:
            self._relock_nodes(nodes)

    def _nodes(self, block_ids: Iterable[int]) -> list[RadixNode]:
        """The distinct nodes owning the given (cached) blocks, in first-seen order."""
        # a node's blocks come in runs: group at C speed, then dedupe the (few) runs
        runs = [x for x, _ in groupby(map(self._node_of.__getitem__, block_ids)) if x is not None]
        return list(dict.fromkeys(runs)) if len(runs) > 1 else runs

    def _chain(self, node: RadixNode) -> list[RadixNode]:
        """A node and its ancestors below the root, deepest first."""
        chain = []
        root = self._root
        while node is not None and node is not root:
            chain.append(node)
            node = node.parent  # type: ignore[assignment]
        return chain

    def _relock_nodes(
        self, nodes: list[RadixNode], path: bool = False, chain: list[RadixNode] | None = None
    ) -> None:
        """Recount nodes whose blocks' lock state may have changed. When they all lie on one
        root path (a request's blocks: the usual case; ``path``: known to be the whole chain
        of the last) this is one bottom-up pass carrying the change in ``locked_below``,
        instead of one walk to the root per node; the result is the same (each node's counts
        depend only on the final lock states). ``chain``: the last node's, when known."""
        if chain is None:
            chain = self._chain(nodes[-1])
        todo = set(nodes)
        if not path and len(todo) > 1 and not todo.issubset(chain):
            for node in nodes:  # not one path: each recount propagates its own delta
                self._recount(node)
            return
        carry, left = 0, len(todo)
        for node in chain:
            if node in todo:
                before = node.last_locked >= 0
                self._scan(node)
                node.locked_below += carry
                self._refresh(node)
                carry += (node.last_locked >= 0) - before
                left -= 1
            elif carry:
                node.locked_below += carry
                self._refresh(node)
            elif not left:
                break

    def _touch_path(self, node: RadixNode) -> None:
        """Mark a node and its ancestors most recently used (the node itself the newest)."""
        self._mark_chain(self._chain(node))

    def _mark_chain(self, chain: list[RadixNode]) -> None:
        """Stamp a node's chain (the node first, the root's child last) with the next clock
        values, the root side oldest, and offer the node to the eviction heap."""
        clock = self._clock
        for n in reversed(chain):
            clock += 1
            n.last_access = clock
        self._clock = clock
        if chain:
            self._offer_leaf(chain[0])

    def _touch_paths(self, nodes: list[RadixNode]) -> list[RadixNode]:
        """``_touch_path`` of each node in order; returns the last node's chain. When every
        node is an ancestor of the last one (a request's path) only the last touch's marks
        survive: do that one, with the clock advanced exactly as the whole sequence would
        have (same values, one walk)."""
        chain = self._chain(nodes[-1])
        if len(nodes) > 1:
            depth = {n: len(chain) - i for i, n in enumerate(chain)}
            if not all(n in depth for n in nodes):
                for node in nodes[:-1]:
                    self._touch_path(node)
            else:
                self._clock += sum(depth[n] for n in nodes[:-1])
        self._mark_chain(chain)
        return chain

    def _group(self, block_ids: Sequence[int]) -> list[tuple[RadixNode, int]]:
        """(node, number of the given blocks in it) for cached blocks, in first-seen order."""
        out: dict[RadixNode, int] = {}
        for b in block_ids:
            node = self._owner(b)
            if node is not None:
                out[node] = out.get(node, 0) + 1
        return list(out.items())

    def _check_valid(self, match: PrefixMatch) -> list[RadixNode]:
        """Raise unless the match still names cached blocks; returns the nodes it covers."""
        if match.block_size != self.block_size:
            raise ValueError(
                f"match at block size {match.block_size}, cache uses {self.block_size}"
            )
        ids, hashes = list(match.block_ids), list(match.hashes)
        if len(ids) != len(hashes):
            raise ValueError("prefix match has different numbers of blocks and hashes")
        # A match runs from the root, so it covers whole nodes from their first block on.
        i = 0
        nodes = []
        while i < len(ids):
            node = self._owner(ids[i])
            k = min(len(node.blocks), len(ids) - i) if node is not None else 0
            if (
                node is None
                or node.blocks[:k] != ids[i : i + k]
                or node.hashes[:k] != hashes[i : i + k]
            ):
                raise ValueError(
                    f"prefix match is stale: block {ids[i]} is no longer cached for that prefix"
                )
            nodes.append(node)
            i += k
        return nodes
