"""Block allocator reference counts and the block-hash prefix cache (LRU, pins, accounting)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet.kv.allocator import BlockAllocator, OutOfBlocks
from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.hash_cache import HashPrefixCache
from pddnet.kv.prefix_cache import PrefixCache, PrefixMatch
from pddnet.kv.radix import RadixCache

# The engine holds either implementation through the PrefixCache interface; the contract
# tests below run on both.
CACHES = [HashPrefixCache, RadixCache]
BS = 4


def test_allocate_incref_decref_free():
    a = BlockAllocator(4)
    blocks = a.allocate(3)
    assert len(set(blocks)) == 3 and a.num_free == 1
    a.incref(blocks[:1])
    assert a.refcount(blocks[0]) == 2
    assert a.decref(blocks) == blocks[1:]
    assert a.num_free == 3
    assert a.decref(blocks[:1]) == blocks[:1]
    assert a.num_free == 4


def test_out_of_blocks_and_bad_ids_are_clear_errors():
    a = BlockAllocator(2)
    a.allocate(2)
    with pytest.raises(OutOfBlocks, match="requested 1, 0 free of 2"):
        a.allocate(1)
    with pytest.raises(ValueError, match="outside 0..1"):
        a.decref([5])
    b = BlockAllocator(2)
    with pytest.raises(ValueError, match="double free"):
        b.decref([0])
    with pytest.raises(ValueError, match="incref of free block"):
        b.incref([0])
    x = b.allocate(1)
    with pytest.raises(ValueError, match="double free"):
        b.decref(x + x)
    assert b.refcount(x[0]) == 1  # the rejected call changed nothing


def _acquire(cache: PrefixCache, tokens: list[int]) -> PrefixMatch:
    """What an engine does on admission: match, take the matched blocks, count the lookup."""
    m = cache.match(tokens)
    cache.take(m)
    cache.record_lookup(len(tokens), m.num_tokens)
    return m


def _sequence(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Simulate a sequence: acquire its cached prefix, allocate the rest, index full blocks."""
    m = _acquire(cache, tokens)
    n_blocks = -(-len(tokens) // BS)
    try:
        blocks = list(m.block_ids) + cache.allocate(n_blocks - m.num_blocks)
    except OutOfBlocks:
        cache.release(m.block_ids)  # give the matched prefix back, as an engine must
        raise
    cache.insert(tokens, blocks)
    return blocks


def _finished(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """A sequence that ran and ended: its blocks released, the full ones left cached."""
    blocks = _sequence(cache, tokens)
    cache.release(blocks)
    return blocks


def test_chained_hashes_depend_on_the_whole_prefix():
    a = chained_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS)
    b = chained_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, other prefix
    assert a[1:] == chained_hashes([5, 6, 7, 8], BS, a[0])  # the chain continues from a parent
    assert chained_hashes([1, 2, 3], BS) == []  # only full blocks
    # The values themselves are fixed: P's view, MD's cache and the simulator's JSON rely on them.
    assert a == [4869509296380433915, 9287794070694196055]
    assert chained_hashes([5, -7, 1 << 40], 1, 12345) == [
        10421597573688732869,
        17037096904949791008,
        12123579627699254581,
    ]


@pytest.mark.parametrize("kind", CACHES)
def test_match_finds_leading_full_blocks_and_counts_hits(kind: type[PrefixCache]):
    cache = kind(BlockAllocator(16), BS)
    first = list(range(10))  # 2 full blocks + 2 tokens
    blocks = _sequence(cache, first)
    assert cache.num_cached_blocks == 2
    m = _acquire(cache, list(range(8)) + [99, 98, 97, 96, 95])
    assert m.block_ids == tuple(blocks[:2]) and m.num_tokens == 8
    assert cache.tokens_asked == 10 + 13 and cache.tokens_hit == 8
    assert cache.hit_rate == pytest.approx(8 / 23)
    assert _acquire(cache, [0, 1, 2, 3, 4, 5, 6, 99]).num_tokens == 4  # second block differs
    assert cache.match([5, 1, 2, 3, 4]).num_blocks == 0
    assert cache.match(list(range(8)), max_blocks=1).num_blocks == 1


@pytest.mark.parametrize("kind", CACHES)
def test_eviction_is_lru_over_unreferenced_blocks_only(kind: type[PrefixCache]):
    a = BlockAllocator(6)
    cache = kind(a, BS)
    s1 = _sequence(cache, list(range(8)))  # 2 full blocks
    s2 = _sequence(cache, list(range(100, 108)))  # 2 full blocks
    assert a.num_free == 2 and cache.num_evictable == 0
    cache.release(s1)  # s1's blocks: cached, unreferenced
    assert cache.num_evictable == 2 and cache.num_available == 4
    # s2 still referenced: allocating past the free list evicts s1's blocks, never s2's.
    got = cache.allocate(4)
    assert set(s1) <= set(got) and not set(s2) & set(got)
    assert cache.num_evicted == 2 and cache.match(list(range(8))).num_blocks == 0
    with pytest.raises(OutOfBlocks):
        cache.allocate(1)  # s2 blocks are referenced: not evictable
    assert cache.match(list(range(100, 108))).num_blocks == 2


@pytest.mark.parametrize("kind", CACHES)
def test_lru_order_and_tail_first(kind: type[PrefixCache]):
    a = BlockAllocator(4)
    cache = kind(a, BS)
    old = _finished(cache, list(range(8)))
    _finished(cache, list(range(50, 58)))  # newer than `old`
    assert a.num_free == 0 and cache.num_evictable == 4
    got = cache.allocate(1)
    assert got == [old[1]]  # oldest chain first, and its tail before its head
    assert cache.match(list(range(8))).num_blocks == 1
    got = cache.allocate(1)
    assert got == [old[0]]
    # a hit refreshes recency: touch `new`, then release; nothing else left to evict
    m = _acquire(cache, list(range(50, 58)))
    assert cache.num_evictable == 0
    cache.release(m.block_ids)
    assert cache.num_evictable == 2


@pytest.mark.parametrize("kind", CACHES)
def test_pinned_prefix_is_never_evicted_and_unpin_restores(kind: type[PrefixCache]):
    a = BlockAllocator(4)
    cache = kind(a, BS)
    blocks = _finished(cache, list(range(8)))
    m = cache.match(list(range(8)))
    cache.pin(m)
    assert cache.num_evictable == 0 and cache.is_pinned(blocks[0])
    cache.allocate(2)
    with pytest.raises(OutOfBlocks):
        cache.allocate(1)
    assert cache.match(list(range(8))).block_ids == m.block_ids
    cache.unpin(m)
    assert cache.num_evictable == 2
    with pytest.raises(ValueError, match="not pinned"):
        cache.unpin(m)
    cache.allocate(2)
    with pytest.raises(ValueError, match="stale"):
        cache.pin(m)


@pytest.mark.parametrize("kind", CACHES)
def test_duplicate_block_stays_uncached_and_is_freed_normally(kind: type[PrefixCache]):
    a = BlockAllocator(8)
    cache = kind(a, BS)
    tokens = list(range(4))
    b1 = cache.allocate(1)
    b2 = cache.allocate(1)  # two sequences computed the same block concurrently
    cache.insert(tokens, b1)
    cache.insert(tokens, b2)
    assert cache.is_cached(b1[0]) and not cache.is_cached(b2[0])
    cache.release(b2)
    assert a.refcount(b2[0]) == 0
    cache.release(b1)
    assert a.refcount(b1[0]) == 1 and cache.num_evictable == 1  # the cache's own reference
    assert cache.clear() == 1 and a.num_free == 8


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(["run", "release", "pin", "unpin", "alloc"]), st.integers(0, 5)),
        max_size=40,
    )
)
def test_random_operations_never_free_a_referenced_or_pinned_block(ops):
    a = BlockAllocator(12)
    cache = HashPrefixCache(a, BS)
    prompts = [[p] * 4 + list(range(p, p + 6)) for p in range(6)]  # 10 tokens, 2 full blocks
    live: list[list[int]] = []
    pins = []
    for op, arg in ops:
        try:
            if op == "run":
                live.append(_sequence(cache, prompts[arg]))
            elif op == "alloc":
                live.append(cache.allocate(arg % 3 + 1))
            elif op == "release" and live:
                cache.release(live.pop(arg % len(live)))
            elif op == "pin":
                m = cache.match(prompts[arg])
                if m.num_blocks:
                    cache.pin(m)
                    pins.append(m)
            elif op == "unpin" and pins:
                cache.unpin(pins.pop(arg % len(pins)))
        except OutOfBlocks:
            pass
        held = [b for blocks in live for b in blocks]
        for b in held:
            assert a.refcount(b) >= held.count(b)
        for m in pins:
            for b in m.block_ids:
                assert cache.is_pinned(b) and cache.is_cached(b)
        assert a.num_free + sum(1 for b in range(12) if a.refcount(b)) == 12
    for blocks in live:
        cache.release(blocks)
    for m in pins:
        cache.unpin(m)
    cache.clear()
    assert a.num_free == 12
