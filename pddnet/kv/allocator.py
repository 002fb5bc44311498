"""Reference-counted allocation of KV block ids.

The allocator knows nothing about what a block holds. A block is *free* when nobody holds a
reference; the prefix cache (prefix_cache.py) keeps cached blocks alive by holding one reference
of its own, which is why "free" here never includes blocks that the cache could evict -- the cache
decides eviction and then drops its reference.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from itertools import repeat
from typing import Any

from pddnet.kv.errors import OutOfBlocks

__all__ = ["BlockAllocator", "OutOfBlocks"]

# Block id n is the same int object in every allocator of the process. Ids above 256 are heap
# objects, and every list of ids (block tables, tree nodes, the free list) touches them: a
# simulation holding a hundred allocators then reads one small set of them, which stays in the
# CPU's caches, instead of a separate copy per allocator (speed only; ids compare by value).
# Compiled with mypyc, an id held in an ``int`` variable is unboxed, and storing it boxes a NEW
# object: so the loops below that move ids between lists store them from an ``Any`` view of the
# list (the object), while indexing the counts with the typed (fast) value.
_SHARED_IDS: list[int] = []


def _ids(n: int) -> list[int]:
    if len(_SHARED_IDS) < n:
        _SHARED_IDS.extend(range(len(_SHARED_IDS), n))
    return _SHARED_IDS[:n]


class BlockAllocator:
    """Block ids ``0..num_blocks-1`` with reference counts; a block is free at count 0."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # FIFO reuse: a block freed late is reused late, which keeps recently freed contents
        # around a little longer (useful when debugging; correctness never depends on it).
        self._free: deque[int] = deque(_ids(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block_id: int) -> int:
        self._check(block_id)
        return self._refcount[block_id]

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, each with reference count 1; raises OutOfBlocks if short."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"cannot allocate {n!r} blocks")
        if n > len(self._free):
            raise OutOfBlocks(n, len(self._free), self.num_blocks)
        free: Any = self._free
        blocks: list[Any] = [free.popleft() for _ in range(n)]
        rc = self._refcount
        ids: list[int] = blocks
        for b in ids:
            rc[b] = 1
        return blocks

    def incref(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        if self.plain_ids(ids) and self._incref_or_undo(ids):
            return  # fast path: ids checked at C speed, counts on the way
        for b in ids:
            self._check(b)
            if self._refcount[b] == 0:
                raise ValueError(f"incref of free block {b}: allocate it first")
        for b in ids:
            self._refcount[b] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one reference per id; returns the ids that became free (count reached 0)."""
        ids = list(block_ids)
        if self.plain_ids(ids):
            freed = self._decref_or_undo(ids)
            if freed is not None:
                return freed  # fast path: ids checked at C speed, counts on the way
        pending: dict[int, int] = {}
        for b in ids:
            self._check(b)
            pending[b] = pending.get(b, 0) + 1
            if pending[b] > self._refcount[b]:
                raise ValueError(f"decref of block {b} below zero (double free?)")
        freed = []
        for b in ids:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    def decref_plain(self, ids: list[int]) -> list[int]:
        """``decref`` of ids the caller knows are plain ints in range (a cache's own, or ones
        it checked): only the counts are checked -- none may go below zero, or it raises as
        ``decref`` does, changing nothing."""
        freed = self._decref_or_undo(ids)
        return freed if freed is not None else self.decref(ids)

    def _incref_or_undo(self, ids: list[int]) -> bool:
        """incref valid ids; on a free one, undo and return False (the checked path raises)."""
        rc = self._refcount
        for k, b in enumerate(ids):
            if not rc[b]:
                for u in ids[:k]:
                    rc[u] -= 1
                return False
            rc[b] += 1
        return True

    def _decref_or_undo(self, ids: list[int]) -> list[int] | None:
        """decref valid ids; if one would go below zero, undo everything and return None (the
        checked path raises), so a rejected call still changes nothing."""
        rc = self._refcount
        free = self._free
        freed: list[Any] = []
        objs: list[Any] = ids
        for k, b in enumerate(ids):
            c = rc[b] - 1
            if c < 0:
                for u in reversed(ids[:k]):  # newest first: a freed id is the free tail
                    if not rc[u]:
                        free.pop()
                        freed.pop()
                    rc[u] += 1
                return None
            rc[b] = c
            if not c:
                free.append(objs[k])
                freed.append(objs[k])
        return freed

    def incref_unchecked(self, block_ids: list[int]) -> None:
        """``incref`` without validation, for a caller that vouches for every id (a valid
        int of a referenced block), e.g. a cache taking references on blocks it owns."""
        rc = self._refcount
        for b in block_ids:
            rc[b] += 1

    def refcounts(self) -> list[int]:
        """The reference counts by block id, READ ONLY: the fast path for a cache that walks
        blocks it owns (ids known valid) block by block; mutate only through the methods."""
        return self._refcount

    def plain_ids(self, ids: list[int]) -> bool:
        """True when every id is a plain int in range, checked at C speed; False sends the
        caller to the per-id checks (which raise the errors, or accept int subclasses)."""
        if not ids:
            return True
        return (
            all(map(isinstance, ids, repeat(int))) and min(ids) >= 0 and max(ids) < self.num_blocks
        )

    def _check(self, block_id: int) -> None:
        if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id!r} outside 0..{self.num_blocks - 1}")
