"""HashPrefixCache: the "hash" prefix cache (P's and RLD's engines), over FULL KV blocks keyed by
chained block hashes (pddnet/kv/block_hash.py). See pddnet/kv/prefix_cache.py for the interface.

Why chained hashes and not a radix tree here: this cache serves the engine's own admission,
where reuse is only ever at block granularity and the question is "how many leading full blocks
of this prompt do I already hold". A chained hash answers that with one dict lookup per block.
Every entry also keeps its tokens and parent hash, and a lookup compares them, so a 64-bit
collision can never hand out the wrong KV.

Ownership: the cache holds one reference (in the BlockAllocator) on every block it indexes. A
cached block whose only reference is the cache's and that is not pinned is *evictable*; eviction
is LRU over exactly those blocks, so a block referenced by a sequence or pinned is never freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.prefix_cache import PrefixMatch, allocate_evicting


@dataclass
class _Entry:
    block_id: int
    parent_hash: int
    tokens: tuple[int, ...]
    pins: int = 0


class HashPrefixCache:
    """Block-hash prefix cache on top of a BlockAllocator, with LRU eviction and pinning."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self._by_hash: dict[int, _Entry] = {}
        self._hash_of_block: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.tokens_asked = 0
        self.tokens_hit = 0
        self.num_evicted = 0

    # -- sizes and accounting ------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.allocator.num_free + len(self._evictable)

    @property
    def hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_asked if self.tokens_asked else 0.0

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    def is_pinned(self, block_id: int) -> bool:
        h = self._hash_of_block.get(block_id)
        return h is not None and self._by_hash[h].pins > 0

    # -- lookup -------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], max_blocks: int | None = None) -> PrefixMatch:
        """Longest cached chain of leading full blocks (no references taken, no accounting)."""
        bs = self.block_size
        limit = (
            len(token_ids) // bs if max_blocks is None else min(max_blocks, len(token_ids) // bs)
        )
        blocks: list[int] = []
        hashes: list[int] = []
        parent = 0
        for i, h in enumerate(chained_hashes(token_ids[: limit * bs], bs)):
            tokens = tuple(token_ids[i * bs : (i + 1) * bs])
            entry = self._by_hash.get(h)
            if entry is None or entry.tokens != tokens or entry.parent_hash != parent:
                break
            blocks.append(entry.block_id)
            hashes.append(h)
            parent = h
        return PrefixMatch(tuple(blocks), tuple(hashes), bs)

    def acquisition_cost(self, match: PrefixMatch) -> int:
        """How many currently available blocks taking references on ``match`` would consume."""
        return sum(1 for b in match.block_ids if b in self._evictable)

    def record_lookup(self, asked_tokens: int, hit_tokens: int) -> None:
        """Count one lookup in the hit statistics."""
        if asked_tokens < 0 or not 0 <= hit_tokens <= asked_tokens:
            raise ValueError(f"bad lookup: {hit_tokens} hit of {asked_tokens} asked")
        self.tokens_asked += asked_tokens
        self.tokens_hit += hit_tokens

    def take(self, match: PrefixMatch) -> None:
        """Take one reference per block of a match that is still valid."""
        self._check_valid(match)
        self.allocator.incref(match.block_ids)
        for b in match.block_ids:
            self._evictable.pop(b, None)

    def pin(self, match: PrefixMatch) -> None:
        """Keep a matched prefix from eviction until ``unpin`` (pins nest)."""
        self._check_valid(match)
        for h in match.hashes:
            entry = self._by_hash[h]
            entry.pins += 1
            self._evictable.pop(entry.block_id, None)

    def unpin(self, match: PrefixMatch) -> None:
        self._check_valid(match)
        for h in match.hashes:
            if self._by_hash[h].pins == 0:
                raise ValueError(f"unpin of block {self._by_hash[h].block_id} that is not pinned")
        # Tail first, so that a chain's deeper blocks are evicted before its head.
        for h in reversed(match.hashes):
            entry = self._by_hash[h]
            entry.pins -= 1
            self._maybe_evictable(entry.block_id)

    def _check_valid(self, match: PrefixMatch) -> None:
        for b, h in zip(match.block_ids, match.hashes, strict=True):
            entry = self._by_hash.get(h)
            if entry is None or entry.block_id != b:
                raise ValueError(f"prefix match is stale: block {b} is no longer cached")

    # -- insertion and release -------------------------------------------------------------------

    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[int], chain: Sequence[int] = ()
    ) -> list[int]:
        """PrefixCache.insert. A block whose prefix is already cached under another block id
        stays uncached (the sequence keeps using its own copy)."""
        first_block = len(chain)
        parent_hash = chain[-1] if chain else 0
        bs = self.block_size
        hashes = chained_hashes(token_ids[first_block * bs :], bs, parent_hash)
        if first_block + len(hashes) > len(block_ids):
            raise ValueError(
                f"{first_block + len(hashes)} full blocks of tokens but the block "
                f"table has {len(block_ids)}"
            )
        parent = parent_hash
        for i, h in enumerate(hashes):
            idx = first_block + i
            b = block_ids[idx]
            if h not in self._by_hash and b not in self._hash_of_block:
                if self.allocator.refcount(b) == 0:
                    raise ValueError(f"cannot cache free block {b}")
                self.allocator.incref([b])  # the cache's own reference
                self._by_hash[h] = _Entry(b, parent, tuple(token_ids[idx * bs : (idx + 1) * bs]))
                self._hash_of_block[b] = h
            parent = h
        return hashes

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference per block (a sequence finishing); returns blocks that became free.

        Blocks are handled tail first so that, among a chain's blocks, the deepest become the
        least recently used and are evicted before the blocks their chain starts with.
        """
        ids = list(block_ids)[::-1]
        # One batched decref (checked at C speed; a bad id changes nothing), then the cache's
        # own bookkeeping: a 64K-token sequence is 4096 blocks, a decref each cost ~15 ms.
        freed = self.allocator.decref(ids)
        for b in ids:
            self._maybe_evictable(b)
        return freed

    def _maybe_evictable(self, block_id: int) -> None:
        h = self._hash_of_block.get(block_id)
        if h is None:
            return
        # a cached block's id is valid: read its count without the per-call check
        if self._by_hash[h].pins == 0 and self.allocator.refcounts()[block_id] == 1:
            self._evictable[block_id] = None
            self._evictable.move_to_end(block_id)

    # -- allocation with eviction ------------------------------------------------------------------

    def evict(self, n: int) -> int:
        """Evict up to ``n`` least recently used unreferenced, unpinned blocks; returns how many."""
        done = 0
        while done < n and self._evictable:
            b, _ = self._evictable.popitem(last=False)
            h = self._hash_of_block.pop(b)
            del self._by_hash[h]
            self.allocator.decref([b])
            done += 1
        self.num_evicted += done
        return done

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks for a sequence, evicting LRU cached blocks when the free list is short."""
        return allocate_evicting(self.allocator, n, len(self._evictable), self.evict)

    def clear(self) -> int:
        """Evict everything evictable (referenced or pinned blocks stay cached)."""
        return self.evict(len(self._evictable))
