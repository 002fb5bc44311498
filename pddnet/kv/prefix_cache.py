"""The engine's prefix cache: one interface, two implementations.

``PrefixCache`` is what the engine (pddnet/engine/scheduler.py ``BlockManager``) calls;
``make_prefix_cache`` there picks the implementation by the config's ``prefix_cache`` kind:

- ``HashPrefixCache`` (pddnet/kv/hash_cache.py, "hash": P and RLD): a dict of chained block
  hashes, one lookup per block; eviction is LRU over any unreferenced cached block.
- ``RadixCache`` (pddnet/kv/radix.py, "radix": MD's decode-side cache, and every simulated
  cache): a radix tree that evicts leaves only, so a cached block never outlives the prefix
  that reaches it, and that logs what it inserts and evicts for P's view of it.

Both keep the same ownership contract: the cache holds one allocator reference on every block
it indexes; a request using cached blocks holds its own (``take`` ... ``release``); ``pin``
protects a prefix without a reference; ``num_available`` = free + evictable blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pddnet.kv.allocator import BlockAllocator, OutOfBlocks


@dataclass(frozen=True)
class PrefixMatch:
    """The leading full blocks of a token sequence found in the cache."""

    block_ids: tuple[int, ...]
    hashes: tuple[int, ...]
    block_size: int

    @property
    def num_tokens(self) -> int:
        return len(self.block_ids) * self.block_size

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class PrefixCache(Protocol):
    """What the engine asks of a prefix cache (HashPrefixCache and RadixCache implement it)."""

    allocator: BlockAllocator
    block_size: int
    tokens_asked: int
    tokens_hit: int
    num_evicted: int

    @property
    def num_cached_blocks(self) -> int: ...

    @property
    def num_evictable(self) -> int: ...

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        ...

    @property
    def hit_rate(self) -> float: ...

    def is_cached(self, block_id: int) -> bool: ...

    def is_pinned(self, block_id: int) -> bool: ...

    def match(self, token_ids: Sequence[int], max_blocks: int | None = None) -> PrefixMatch:
        """Longest cached chain of leading full blocks (no references taken, no accounting)."""
        ...

    def acquisition_cost(self, match: PrefixMatch) -> int:
        """How many currently available blocks taking references on ``match`` would consume."""
        ...

    def take(self, match: PrefixMatch) -> None:
        """Take one reference per block of a still valid match (a request now uses them)."""
        ...

    def record_lookup(self, asked_tokens: int, hit_tokens: int) -> None:
        """Count one lookup in the hit statistics."""
        ...

    def pin(self, match: PrefixMatch) -> None:
        """Keep a matched prefix from eviction until ``unpin`` (pins nest)."""
        ...

    def unpin(self, match: PrefixMatch) -> None: ...

    def insert(
        self, token_ids: Sequence[int], block_ids: Sequence[int], chain: Sequence[int] = ()
    ) -> list[int]:
        """Cache the full blocks of a sequence whose KV is computed, from block ``len(chain)``
        on; returns their chained hashes. ``token_ids``: the sequence's tokens from position 0
        (only whole blocks count); ``block_ids``: its block table; ``chain``: the hashes earlier
        calls returned for the blocks before (the engine inserts a sequence as it computes it)."""
        ...

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference per block (a request finishing); returns blocks that became free."""
        ...

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting cached ones when the free list is short."""
        ...

    def clear(self) -> int:
        """Evict everything evictable; returns how many blocks."""
        ...


def allocate_evicting(
    allocator: BlockAllocator, n: int, num_evictable: int, evict: Callable[[int], Any]
) -> list[int]:
    """``n`` fresh blocks for a cache's ``allocate``: when the free list is short, ``evict``
    (the cache's own eviction) frees the difference first; ``num_evictable``: what it could."""
    short = n - allocator.num_free
    if short > 0:
        if short > num_evictable:
            raise OutOfBlocks(n, allocator.num_free + num_evictable, allocator.num_blocks)
        evict(short)
    return allocator.allocate(n)
