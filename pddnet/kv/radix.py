"""Decode-side RadixCache (DRC): a radix tree over token ids whose nodes own KV blocks.

MD keeps the KV of finished requests (prompt + generated tokens) so that the next turn of a
conversation only needs its *uncached* KV to cross the WAN. Why a radix tree here and not the
chained-hash HashPrefixCache: eviction must free only *leaves* (a block whose descendants stay
cached would leave them unreachable yet still holding memory), and the tree makes "leaf"
explicit. The tree itself (nodes, locks, LRU order) is pddnet/kv/radix_tree.py.

Ownership (the PrefixCache contract, pddnet/kv/prefix_cache.py):
- the tree holds ONE allocator reference on every block it owns; a block is owned by one node;
- a request using cached blocks holds its own allocator reference on them (``take``/``lock``),
  and drops it with ``release``/``unlock``; pins (``pin``) protect a prefix without a reference;
- eviction takes the least recently used leaf whose tail block is unlocked and frees its blocks
  tail first, one block at a time (the leaf may shrink and then vanish; its parent may become a
  leaf in turn).

Calls: the PrefixCache interface (the engine's), and the simulator's and MD's on top:
``match_prefix`` -> (block_ids, hit_tokens, handle), ``lock``/``unlock`` of a handle,
``match_and_lock``, ``insert_running`` (cache a running request's blocks; it keeps its
references), ``insert_finished`` (insert a finished request and drop its references;
duplicates freed), ``evict`` returning the freed block ids, hit statistics (with the ratio
histogram of pddnet/kv/hit_histogram.py) and the log of inserted / evicted prefixes
(pddnet/kv/cache_events.py) that MD drains into CACHE_EVENTS notices for P's view.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.cache_events import CacheEventBatch, CacheEventLog
from pddnet.kv.hit_histogram import HIT_INTERVAL_EDGES, hit_interval
from pddnet.kv.prefix_cache import PrefixMatch, allocate_evicting
from pddnet.kv.radix_node import RadixNode
from pddnet.kv.radix_tree import RadixTree


class RadixMatch(NamedTuple):
    """Result of ``match_prefix``; ``handle`` is what ``lock``/``unlock`` take."""

    block_ids: tuple[int, ...]
    hit_tokens: int
    handle: PrefixMatch


@dataclass(frozen=True)
class InsertResult:
    """What ``insert_finished`` did with a finished request's blocks."""

    hashes: tuple[int, ...]  # chained hashes of the request's full blocks
    adopted: tuple[int, ...]  # the request's blocks the tree now owns
    duplicates: tuple[int, ...]  # the request's blocks whose prefix the tree already held
    freed: tuple[int, ...]  # blocks that became free (duplicates, partial tail, ...)


class RadixCache(RadixTree):
    """Radix tree of cached full KV blocks on top of a BlockAllocator (see module docstring)."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, max_pending_events: int = 1 << 16
    ) -> None:
        super().__init__(allocator, block_size)
        self.events = CacheEventLog(block_size, max_pending_events)
        # statistics
        self.tokens_asked = 0
        self.tokens_hit = 0
        self.num_requests = 0
        self.hit_histogram = [0] * (len(HIT_INTERVAL_EDGES) - 1)
        self.num_evicted = 0
        self.num_inserted = 0

    # -- sizes and accounting -------------------------------------------------------------------

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.allocator.num_free + self._num_evictable

    @property
    def hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_asked if self.tokens_asked else 0.0

    def record_lookup(self, asked_tokens: int, hit_tokens: int) -> None:
        """Count one request's lookup in the statistics (tokens and the ratio histogram)."""
        if asked_tokens <= 0 or not 0 <= hit_tokens <= asked_tokens:
            raise ValueError(f"bad lookup: {hit_tokens} hit of {asked_tokens} asked")
        self.tokens_asked += asked_tokens
        self.tokens_hit += hit_tokens
        self.num_requests += 1
        self.hit_histogram[hit_interval(hit_tokens / asked_tokens)] += 1

    # -- lookup -----------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], max_blocks: int | None = None) -> PrefixMatch:
        """Longest cached chain of leading full blocks (no references, no accounting, no LRU)."""
        return self._match_path(token_ids, max_blocks)[0]

    def _match_path(
        self, token_ids: Sequence[int], max_blocks: int | None
    ) -> tuple[PrefixMatch, list[tuple[RadixNode, int]]]:
        blocks: list[int] = []
        hashes: list[int] = []
        path = self._walk(tuple(token_ids), self._limit(token_ids, max_blocks))
        for node, m in path:
            if m == len(node.blocks):  # (a whole node: no temporary slice)
                blocks += node.blocks
                hashes += node.hashes
            else:
                blocks += node.blocks[:m]
                hashes += node.hashes[:m]
        return PrefixMatch(tuple(blocks), tuple(hashes), self.block_size), path

    def match_and_lock(self, token_ids: Sequence[int], max_blocks: int | None = None) -> RadixMatch:
        """``match_prefix(token_ids, max_blocks, record=False)`` then ``lock`` of its handle,
        in one walk: the same effect, without re-validating a match just made."""
        m, path = self._match_path(token_ids, max_blocks)
        if path:
            self.allocator.incref_unchecked(list(m.block_ids))  # the tree's own ids
            nodes = [node for node, _ in path]
            self._touch_path(nodes[-1])
            self._relock_nodes(nodes, path=True)
        return RadixMatch(m.block_ids, m.num_tokens, m)

    def match_prefix(
        self, token_ids: Sequence[int], max_blocks: int | None = None, record: bool = True
    ) -> RadixMatch:
        """``match`` plus, with ``record``, the lookup counted in the hit statistics."""
        m = self.match(token_ids, max_blocks)
        if record and len(token_ids):
            self.record_lookup(len(token_ids), m.num_tokens)
        return RadixMatch(m.block_ids, m.num_tokens, m)

    def acquisition_cost(self, match: PrefixMatch) -> int:
        """How many currently available blocks taking references on ``match`` would consume."""
        cost = 0
        for node, m in self._group(match.block_ids):
            cost += max(0, m - (len(node.blocks) - node.evictable))
        return cost

    def take(self, match: PrefixMatch) -> None:
        """Take one reference per block of a still valid match (a request now uses them)."""
        nodes = self._check_valid(match)
        if not nodes:
            return
        self.allocator.incref(match.block_ids)
        self._touch_path(nodes[-1])
        # a match from match() is a root path: then one bottom-up pass recounts it
        path = nodes[0].parent is self._root and all(
            b.parent is a for a, b in zip(nodes, nodes[1:], strict=False)
        )
        self._relock_nodes(nodes, path=path)

    def lock(self, handle: PrefixMatch) -> None:
        """Protect a matched path for a request (one reference per block); see ``unlock``."""
        self.take(handle)

    def unlock(self, handle: PrefixMatch) -> list[int]:
        """Drop the references ``lock`` took; returns blocks that became free (none: the tree
        still holds its own)."""
        self._check_valid(handle)
        return self.release(handle.block_ids)

    def pin(self, match: PrefixMatch) -> None:
        """Keep a matched prefix from eviction until ``unpin`` (pins nest)."""
        self._check_valid(match)
        for b in match.block_ids:
            self._pins[b] = self._pins.get(b, 0) + 1
        self._relock(match.block_ids)

    def unpin(self, match: PrefixMatch) -> None:
        self._check_valid(match)
        for b in match.block_ids:
            if self._pins.get(b, 0) == 0:
                raise ValueError(f"unpin of block {b} that is not pinned")
        for b in match.block_ids:
            self._pins[b] -= 1
            if not self._pins[b]:
                del self._pins[b]
        self._relock(match.block_ids)

    # -- insertion and release --------------------------------------------------------------------

    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[int], chain: Sequence[int] = ()
    ) -> list[int]:
        """PrefixCache.insert. The tree adopts (takes its own reference on) each block whose
        prefix it does not hold yet; a block whose prefix it already holds under another id
        stays the caller's alone (a duplicate, freed when the caller releases it). ``chain``
        is checked against the tokens' own hashes (its last one)."""
        tokens = tuple(token_ids)
        full = len(tokens) // self.block_size
        first_block = len(chain)
        if first_block > full:
            raise ValueError(f"a chain of {first_block} hashes for {full} full blocks")
        hashes, _, _, _ = self._insert(tokens, block_ids)
        # The insertion itself is driven by the tokens (walked from the root), so it is right
        # even when this check fails; the check catches a caller whose hash chain is broken.
        if chain and hashes[first_block - 1] != chain[-1]:
            raise ValueError(
                f"the chain's last hash {chain[-1]:#x} is not the hash of block "
                f"{first_block - 1} of these tokens"
            )
        return hashes[first_block:]

    def insert_running(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        hashes: Sequence[int] | None = None,
    ) -> None:
        """Cache the full blocks of a request that goes on running (it keeps its references, as
        after the engine's ``insert``): the tree adopts each block whose prefix it does not
        hold yet. ``hashes``: as ``insert_finished``'s (the caller's chained hashes, so the
        tree does not hash the tokens again)."""
        self._insert(tuple(token_ids), block_ids, hashes)

    def insert_finished(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        hashes: Sequence[int] | None = None,
    ) -> InsertResult:
        """A request finished: cache its full blocks (prompt + generated tokens with KV), then
        drop its references on all of ``block_ids`` (its locked prefix included). Duplicates and
        the partial last block become free; the tree keeps what it adopted.

        ``hashes``: the chained hashes of ``token_ids``' full blocks (``chained_hashes``; more
        trailing ones are ignored) when the caller keeps them, e.g. per conversation: the tree
        then names its new blocks with them instead of hashing again. Only the last new block's
        hash is checked against its tokens (a misaligned list fails; a wrong value further up
        would only mislead a view of this cache, never a match, which compares tokens)."""
        tokens = tuple(token_ids)
        ids = list(block_ids)
        hashes, adopted, duplicates, owners = self._insert(tokens, ids, hashes)
        unchecked = duplicates + ids[len(tokens) // self.block_size :]
        freed = self._release_inserted(ids, owners, unchecked)
        return InsertResult(tuple(hashes), tuple(adopted), tuple(duplicates), tuple(freed))

    def _release_inserted(
        self, ids: list[int], owners: list[RadixNode], unchecked: list[int]
    ) -> list[int]:
        """``release(ids)`` right after ``_insert`` of them. That walk found the nodes holding
        any of them (``owners``, in the order ``_nodes(ids)`` gives) and checked every id but
        the duplicates and the partial tail (``unchecked``), so only those are checked here.
        (tests/test_sim_scale.py compares it with ``release``.)"""
        alloc = self.allocator
        # (the walk matched ids by value: a float equal to a block id still needs the checks)
        plain = alloc.plain_ids(unchecked) and not set(map(type, ids)) - {int}
        freed = alloc.decref_plain(ids) if plain else alloc.decref(ids)
        if owners:
            chain = self._touch_paths(owners)
            self._relock_nodes(owners, chain=chain)
        return freed

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference per block (a request finishing); returns blocks that became free.
        Cached blocks become most recently used."""
        ids = list(block_ids)
        freed = self.allocator.decref(ids)
        nodes = self._nodes(ids)
        if nodes:
            chain = self._touch_paths(nodes)
            self._relock_nodes(nodes, chain=chain)
        return freed

    # -- eviction and allocation -------------------------------------------------------------------

    def evict(self, n: int) -> list[int]:
        """Free up to ``n`` evictable blocks, tail blocks of least recently used leaves first;
        returns the freed block ids (now free in the allocator)."""
        if n < 0:
            raise ValueError(f"cannot evict {n} blocks")
        heap = self._lru
        freed: list[int] = []
        while len(freed) < n and heap:
            entry = heapq.heappop(heap)
            at, node = entry.at, entry.node
            if at == node.heap_at and node.heap_epoch == self._lru_epoch:
                node.heap_at = -1  # its live entry is used up
            if at != node.last_access or node.children or not node.evictable or node.parent is None:
                continue  # a stale entry: touched since, no longer a leaf or not evictable
            key = self._key(node.tokens)
            k = min(n - len(freed), node.evictable)
            # the node's k tail blocks, tail first (the order they are noted and freed in)
            if k == len(node.blocks):  # all of them: reversed in place, not copied
                gone, hashes = node.blocks, node.hashes
                gone.reverse()
                hashes.reverse()
                node.blocks, node.hashes = [], []
            else:
                gone, hashes = node.blocks[: -k - 1 : -1], node.hashes[: -k - 1 : -1]
                del node.blocks[-k:], node.hashes[-k:]
            node_of = self._node_of
            for b in gone:
                node_of[b] = None
            self._num_cached -= len(gone)
            self.events.note_all(hashes, False)
            got = self.allocator.decref_plain(gone)  # the tree's own ids
            if got != gone:
                raise AssertionError(
                    f"evicted blocks {sorted(set(gone) - set(got))} were still referenced"
                )
            freed += gone
            if node.blocks:
                node.tokens = node.tokens[: len(node.blocks) * self.block_size]
            else:
                node.tokens = ()
            self._refresh(node)  # re-enters the heap if still evictable
            if not node.blocks:
                self._offer_leaf(self._detach(node, key))
        self.num_evicted += len(freed)
        return freed

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks for a request, evicting when the free list is short."""
        return allocate_evicting(self.allocator, n, self._num_evictable, self.evict)

    def clear(self) -> int:
        """Evict everything evictable (locked blocks and their ancestors stay); returns how many."""
        return len(self.evict(self._num_evictable))

    # -- event log (pddnet/kv/cache_events.py; its counters are ``events``') ----------------------

    def drain_events(self, max_hashes: int = 1 << 20) -> CacheEventBatch | None:
        """The next notice of inserted / evicted prefixes (see CacheEventLog.drain)."""
        return self.events.drain(max_hashes)

    # -- insertion internals ---------------------------------------------------------------------

    def _insert(
        self, tokens: tuple[int, ...], block_ids: Sequence[int], known: Sequence[int] | None = None
    ) -> tuple[list[int], list[int], list[int], list[RadixNode]]:
        """Insert the full blocks of ``tokens``; returns their hashes, the ids adopted, the
        duplicates (ids whose prefix the tree held under other ids) and the nodes now holding
        any of ``block_ids`` (matched ones and the new leaf, in table order)."""
        bs = self.block_size
        full = len(tokens) // bs
        if full > len(block_ids):
            raise ValueError(
                f"{full} full blocks of tokens but the block table has {len(block_ids)}"
            )
        if known is not None and len(known) < full:
            raise ValueError(f"{len(known)} hashes for {full} full blocks of tokens")
        path = self._walk(tokens, full)
        hashes: list[int] = []
        duplicates: list[int] = []
        ids = block_ids if type(block_ids) is list else list(block_ids)
        owners: list[RadixNode] = []
        i = 0
        for node, m in path:
            hashes += node.hashes if m == len(node.hashes) else node.hashes[:m]
            mine = ids[i : i + m]
            if mine == (node.blocks if m == len(node.blocks) else node.blocks[:m]):
                owners.append(node)
            else:
                dup = [b for b, own in zip(mine, node.blocks, strict=False) if b != own]
                if len(dup) < m:
                    owners.append(node)  # holds the ones that are not duplicates
                duplicates += dup
            i += m
        new = ids[i:full]
        if set(map(type, new)) - {int}:
            new = [int(b) for b in new]  # int subclasses stored as plain ints
        if not new:
            if path:
                self._touch_path(path[-1][0])
            return hashes, [], duplicates, owners
        if known is None:
            new_hashes = chained_hashes(tokens[i * bs : full * bs], bs, hashes[-1] if hashes else 0)
        else:
            new_hashes = list(known[i:full])
            before = known[full - 2] if full > 1 else 0
            if chained_hashes(tokens[(full - 1) * bs : full * bs], bs, before) != new_hashes[-1:]:
                raise ValueError("the given hashes are not the chained hashes of these tokens")
        # Check each new id (in range, not cached, referenced, not repeated) in one pass,
        # marking it as seen; any failure undoes the marks and raises the precise error.
        rc = self._rc
        node_of = self._node_of
        n = len(rc)
        marker = self._root  # owns no block: marks the ids this pass has seen
        for k, b in enumerate(new):
            if b < 0 or b >= n or node_of[b] is not None or rc[b] == 0:
                for u in new[:k]:
                    node_of[u] = None
                self._reject_new(new)
            node_of[b] = marker
        # from here on every id in `new` is a plain, valid, referenced int
        parent = self._root
        if path:  # split only when something hangs below the match point
            last, m = path[-1]
            if m < len(last.blocks):
                parent = self._split(last, m)
                if owners and owners[-1] is last:
                    owners[-1] = parent  # the matched blocks moved up into it
            else:
                parent = last
        self.allocator.incref_unchecked(new)  # the tree's own reference (checked above)
        leaf = RadixNode(next(self._uids), parent, tokens[i * bs : full * bs], new, new_hashes)
        parent.children[self._key(leaf.tokens)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        for b in new:
            node_of[b] = leaf
        self._num_cached += len(new)
        self.events.note_all(new_hashes, True)
        self.num_inserted += len(new)
        self._touch_path(leaf)
        self._recount(leaf)  # after the touch: its heap entry gets the new mark
        hashes += new_hashes
        owners.append(leaf)
        return hashes, new, duplicates, owners

    def _reject_new(self, new: list[int]) -> None:
        """Raise the error for the first bad id of ``new`` (ids a finished request brings)."""
        if len(set(new)) != len(new):
            raise ValueError(f"block table repeats a block id: {new}")
        for b in new:
            count = self.allocator.refcount(b)  # (raises for an id out of range)
            if self._node_of[b] is not None:
                raise ValueError(f"block {b} is already cached for another prefix")
            if count == 0:
                raise ValueError(f"cannot cache free block {b}")
        raise AssertionError(f"no bad id in {new}")
