"""Decode-side RadixCache: matching, ownership, locking, leaf-only LRU eviction, events, stats,
the engine's PrefixCache interface, and hypothesis-checked invariants under random traffic."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pddnet.kv.allocator import BlockAllocator, OutOfBlocks
from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.hit_histogram import HIT_INTERVAL_LABELS, hit_interval
from pddnet.kv.radix import RadixCache
from pddnet.kv.radix_check import check_invariants
from pddnet.protocol.messages import CacheEvents

BS = 4


def make(num_blocks: int = 32, bs: int = BS) -> tuple[BlockAllocator, RadixCache]:
    a = BlockAllocator(num_blocks)
    return a, RadixCache(a, bs)


def serve(cache: RadixCache, tokens: list[int]) -> tuple[list[int], int]:
    """One request the way MD does it: match + lock the hit, allocate the rest."""
    m = cache.match_prefix(tokens, max_blocks=(len(tokens) - 1) // cache.block_size)
    cache.lock(m.handle)
    need = -(-len(tokens) // cache.block_size) - len(m.block_ids)
    return list(m.block_ids) + cache.allocate(need), m.hit_tokens


def finish(cache: RadixCache, tokens: list[int]) -> list[int]:
    table, _ = serve(cache, tokens)
    cache.insert_finished(tokens, table)
    return table


# -- matching and insertion -------------------------------------------------------------------------


def test_match_after_insert_returns_the_inserted_full_blocks_only():
    a, c = make()
    tokens = list(range(10))  # 2 full blocks + 2 tokens
    table = a.allocate(3)
    res = c.insert_finished(tokens, table)
    assert res.adopted == tuple(table[:2]) and res.duplicates == ()
    assert res.freed == (table[2],)  # the partial block is never cached
    assert res.hashes == tuple(chained_hashes(tokens, BS))
    m = c.match_prefix(tokens + [99, 98])
    assert m.block_ids == tuple(table[:2]) and m.hit_tokens == 8
    assert m.handle.hashes == res.hashes
    assert c.match(list(range(7))).block_ids == (table[0],)  # block granularity
    assert c.match([5] + list(range(1, 12))).num_blocks == 0
    again = c.insert_finished(list(range(4)), a.allocate(1))  # a prefix of what is cached
    assert again.adopted == () and again.freed == again.duplicates and c.num_nodes == 1
    check_invariants(c)


def test_diverging_suffix_splits_at_a_block_boundary_and_dedups_the_shared_part():
    a, c = make()
    first = finish(c, list(range(12)))
    assert c.num_nodes == 1
    other = list(range(4)) + [50, 51, 52, 53, 54, 55, 56, 57]
    table = a.allocate(3)
    res = c.insert_finished(other, table)
    assert res.duplicates == (table[0],)  # block 0 was cached under first[0]
    assert table[0] in res.freed and res.adopted == tuple(table[1:])
    assert c.num_nodes == 3  # shared head + two tails
    assert c.match(other).block_ids == (first[0], table[1], table[2])
    assert c.match(list(range(12))).block_ids == tuple(first[:3])
    check_invariants(c)


def test_incremental_engine_style_insert_continues_the_hash_chain():
    a, c = make()
    tokens = list(range(16))
    table = a.allocate(4)
    h1 = c.insert(tokens[:8], table)
    h2 = c.insert(tokens, table, h1)
    assert h1 + h2 == chained_hashes(tokens, BS)
    with pytest.raises(ValueError, match="the chain's last hash"):
        c.insert(tokens, table, [h1[0], 12345])
    with pytest.raises(ValueError, match="a chain of 9 hashes"):
        c.insert(tokens, table, [0] * 9)
    check_invariants(c)


def test_a_running_request_shares_its_prompt_and_keeps_its_blocks():
    """insert_running caches a running request's full blocks while it holds them (the
    simulator's MD at a request's first step): another request matches them at once, they
    cannot be evicted under it, and its end (insert_finished) adds the output's blocks."""
    a, c = make()
    prompt = list(range(10))  # two full blocks and a partial one
    table, _ = serve(c, prompt)
    table += c.allocate(1)  # room for the output
    c.insert_running(prompt, table, chained_hashes(prompt, BS))
    assert c.match(prompt[:8] + [99]).block_ids == tuple(table[:2])
    assert c.evict(8) == []  # the running request still holds them
    check_invariants(c)
    output = [10, 11, 12, 13, 14, 15]
    res = c.insert_finished(prompt + output, table)
    assert res.adopted == (table[2], table[3]) and res.duplicates == ()
    assert res.freed == ()
    assert c.match(prompt + output + [0]).block_ids == tuple(table)
    check_invariants(c)
    assert sorted(c.evict(8)) == sorted(table)
    assert a.num_free == 32


def test_bad_inserts_are_refused_with_clear_errors():
    a, c = make()
    with pytest.raises(ValueError, match="cannot cache free block"):
        c.insert(list(range(4)), [0])
    table = a.allocate(2)
    with pytest.raises(ValueError, match="block table has 2"):
        c.insert(list(range(12)), table)
    with pytest.raises(ValueError, match="repeats"):
        c.insert(list(range(8)), [table[0], table[0]])
    c.insert(list(range(4)), table[:1])
    with pytest.raises(ValueError, match="already cached for another prefix"):
        c.insert([9, 9, 9, 9], table[:1])
    check_invariants(c)
    # a table naming a cached block by an equal float: the clear error, not a TypeError
    lock = c.match_and_lock(list(range(4)) + [7] * 4, max_blocks=1)
    own = a.allocate(1)
    with pytest.raises(ValueError, match="outside"):
        c.insert_finished(list(range(4)) + [7] * 4, [float(lock.block_ids[0])] + own)
    c.release(list(lock.block_ids) + own)
    check_invariants(c)
    # refused part way through the new ids: nothing is left marked or cached
    more = a.allocate(2)
    for bad, why in (
        ([more[0], more[1], 10_000], "outside"),
        ([more[0], -1], "outside"),
        ([more[0], more[1], more[0]], "repeats"),
        ([more[0], table[0]], "already cached"),
    ):
        with pytest.raises(ValueError, match=why):
            c.insert_finished([5] * (4 * len(bad)), bad)
        check_invariants(c)
        assert not c.is_cached(more[0]) and not c.is_cached(more[1])


def test_split_inside_a_locked_deep_node_keeps_the_lock_counts_exact():
    a, c = make()
    finish(c, [0] * 4 + [1] * 8)
    finish(c, [0] * 4 + [2] * 4)  # head [0000] + two tails
    m = c.match_prefix([0] * 4 + [1] * 8)
    c.lock(m.handle)  # the deep tail [1111 1111] is locked
    finish(c, [0] * 4 + [1] * 4 + [3] * 4)  # splits that locked tail in two
    check_invariants(c)
    assert c.unlock(m.handle) == []
    check_invariants(c)
    assert c.num_evictable == c.num_cached_blocks == 5
    assert len(c.evict(9)) == 5 and a.num_free == a.num_blocks


# -- locking, pinning, eviction ------------------------------------------------------------------------


def test_locked_prefix_survives_eviction_and_unlock_makes_it_evictable():
    a, c = make(8)
    finish(c, list(range(12)))
    m = c.match_prefix(list(range(12)))
    assert c.acquisition_cost(m.handle) == 3
    c.lock(m.handle)
    assert c.num_evictable == 0 and c.evict(10) == [] and c.num_cached_blocks == 3
    with pytest.raises(OutOfBlocks):
        c.allocate(6)  # 5 free, nothing evictable
    assert c.unlock(m.handle) == []  # the tree still holds its reference
    assert c.num_evictable == 3 and c.num_available == 8
    assert sorted(c.allocate(8)) == list(range(8))  # evicts all three for a big allocation
    check_invariants(c)


def test_partial_lock_keeps_the_locked_head_and_frees_the_tail():
    a, c = make()
    blocks = finish(c, list(range(16)))
    m = c.match_prefix(list(range(8)))  # first two of four blocks
    assert c.acquisition_cost(m.handle) == 2
    c.lock(m.handle)
    assert c.num_evictable == 2
    assert c.evict(5) == [blocks[3], blocks[2]]  # tail first, the locked head stays
    assert c.match(list(range(16))).block_ids == tuple(blocks[:2])
    check_invariants(c)


def test_pins_nest_and_protect_like_references():
    a, c = make()
    finish(c, list(range(8)))
    m = c.match(list(range(8)))
    c.pin(m)
    c.pin(m)
    c.unpin(m)
    assert c.is_pinned(m.block_ids[0]) and c.evict(4) == []
    c.unpin(m)
    with pytest.raises(ValueError, match="not pinned"):
        c.unpin(m)
    assert len(c.evict(4)) == 2
    with pytest.raises(ValueError, match="stale"):
        c.pin(m)
    check_invariants(c)


def test_eviction_takes_least_recently_used_leaves_first():
    a, c = make()
    old = finish(c, [1] * 8)
    new = finish(c, [2] * 8)
    assert c.evict(1) == [old[1]]
    # touching the old conversation (a request used and released it) makes it the newest
    m = c.match_prefix([1] * 4)
    c.lock(m.handle)
    c.unlock(m.handle)
    assert c.evict(3) == [new[1], new[0], old[0]]
    assert c.num_cached_blocks == 0 and a.num_free == a.num_blocks
    check_invariants(c)


def test_only_leaves_are_evicted_even_when_an_inner_block_is_unreferenced():
    # Two requests computed the same first block concurrently: the tree keeps the first copy,
    # and the second request's deeper block hangs below it while only that request holds it.
    a, c = make(8)
    t1, t2 = a.allocate(1), a.allocate(2)
    c.insert([7] * 4, t1)
    c.release(t1)  # block t1 now unreferenced in the tree
    c.insert([7] * 4 + [8] * 4, t2)  # t2[0] duplicate, t2[1] adopted below t1
    assert c.match([7] * 4 + [8] * 4).block_ids == (t1[0], t2[1])
    assert c.num_evictable == 0 and c.evict(2) == []  # t1's child is referenced by request 2
    assert c.acquisition_cost(c.match([7] * 4)) == 0
    assert sorted(c.release(t2)) == [t2[0]]  # its duplicate is freed, t2[1] stays cached
    assert c.evict(2) == [t2[1], t1[0]]  # leaf first, then its parent
    check_invariants(c)


# -- statistics and events -----------------------------------------------------------------------------


def test_hit_statistics_and_seven_interval_histogram():
    a, c = make(64)
    finish(c, list(range(40)))
    serve(c, list(range(40)) + [1, 2])  # 40 of 42 hit: > 95%
    assert c.num_requests == 2 and c.tokens_asked == 82 and c.tokens_hit == 40
    assert c.hit_histogram[HIT_INTERVAL_LABELS.index("0-20%")] == 1
    assert c.hit_histogram[HIT_INTERVAL_LABELS.index("95-100%")] == 1
    assert [hit_interval(x) for x in (0, 0.2, 0.21, 0.8, 0.9, 0.95, 0.951, 1.0)] == [
        0,
        0,
        1,
        3,
        4,
        5,
        6,
        6,
    ]
    with pytest.raises(ValueError):
        hit_interval(1.5)


def test_events_name_prefixes_by_chained_hashes_and_are_netted_per_notice():
    a, c = make(8)
    tokens = list(range(12))
    finish(c, tokens)
    ev = c.drain_events()
    assert ev is not None and ev.seq == 0 and ev.block_size == BS
    assert set(ev.inserted) == set(chained_hashes(tokens, BS)) and ev.evicted == ()
    msg = CacheEvents(**dataclasses.asdict(ev))  # the wire message takes it as is
    assert msg.inserted == ev.inserted
    assert c.drain_events() is None
    c.evict(1)
    finish(c, tokens)  # evicted, then re-inserted: net present
    c.evict(2)
    ev = c.drain_events()
    assert ev.seq == 1 and set(ev.evicted) == set(chained_hashes(tokens, BS)[1:])
    assert set(ev.inserted).isdisjoint(ev.evicted)
    assert set(c.snapshot_hashes()) == set(chained_hashes(tokens, BS)[:1])


def test_undrained_event_log_is_bounded_and_skips_a_notice_number():
    a = BlockAllocator(64)
    c = RadixCache(a, BS, max_pending_events=5)
    finish(c, list(range(24)))  # 6 inserts > 5 pending: dropped
    assert c.events.num_pending == 0 and c.events.dropped == 6
    finish(c, [100] * 4)
    ev = c.drain_events()
    assert ev.seq == 1  # notice 0 never sent: receivers see a gap
    quiet = RadixCache(BlockAllocator(64), BS, max_pending_events=0)  # nobody watches
    finish(quiet, list(range(24)))
    quiet.evict(3)
    assert quiet.drain_events() is None and quiet.events.num_pending == 0
    check_invariants(quiet)
    with pytest.raises(ValueError, match="max_pending_events must be >= 0"):
        RadixCache(BlockAllocator(4), BS, max_pending_events=-1)


def test_drain_splits_a_large_log_into_numbered_notices():
    a, c = make(64)
    finish(c, list(range(40)))
    first, second = c.drain_events(max_hashes=6), c.drain_events(max_hashes=6)
    assert (first.seq, second.seq) == (0, 1)
    assert len(first.inserted) == 6 and len(second.inserted) == 4


# -- the engine's PrefixCache interface ----------------------------------------------------------------


def test_engine_runs_token_exact_on_a_radix_cache(tiny_engine_pair):
    radix_engine, cold = tiny_engine_pair
    cache = RadixCache(radix_engine.allocator, radix_engine.block_size)
    radix_engine.blocks.prefix_cache = cache  # what BlockManager would construct
    base = list(range(3, 40))
    follow = base + list(range(60, 75))
    for prompt in (base, follow, follow):
        assert radix_engine.generate(prompt, 10, ignore_eos=True) == cold.generate(
            prompt, 10, ignore_eos=True
        )
        check_invariants(cache)
    assert cache.tokens_hit > 0 and cache.num_cached_blocks > 0
    res = radix_engine.reserve_kv(follow + [5], 4)  # MD's allocation path
    assert res.num_cached_tokens == (len(follow) // 4) * 4
    radix_engine.free_reservation(res)
    pinned = radix_engine.pin_prefix(base)
    assert pinned is not None and cache.is_pinned(pinned.block_ids[0])
    radix_engine.unpin_prefix(pinned)
    assert radix_engine.num_available_blocks == radix_engine.num_blocks
    assert radix_engine.blocks.claimed == 0
    cache.clear()
    assert radix_engine.allocator.num_free == radix_engine.num_blocks
    check_invariants(cache)


@pytest.fixture(scope="module")
def tiny_engine_pair():
    from pddnet.engine.engine import Engine
    from pddnet.model.loader import load_model

    model, tok = load_model("tiny")
    return (
        Engine(model, tok, num_blocks=48, block_size=4),
        Engine(model, tok, num_blocks=48, block_size=4, enable_prefix_cache=False),
    )


# -- invariants under random traffic (hypothesis) ---------------------------------------------------------


class RadixMachine(RuleBasedStateMachine):
    """Requests over a small alphabet (so prefixes collide a lot) against a small pool."""

    BS = 2

    @initialize()
    def setup(self) -> None:
        self.a = BlockAllocator(24)
        self.c = RadixCache(self.a, self.BS)
        self.live: dict[int, tuple[list[int], list[int]]] = {}  # id -> (tokens, block table)
        self.pins: list = []
        self.next_id = 0

    def locked_blocks(self) -> set[int]:
        out = {
            b for b in range(self.a.num_blocks) if self.c.is_cached(b) and self.a.refcount(b) > 1
        }
        return out | {b for m in self.pins for b in m.block_ids}

    @rule(tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def start(self, tokens: list[int]) -> None:
        m = self.c.match_prefix(tokens, max_blocks=(len(tokens) - 1) // self.BS)
        need = -(-len(tokens) // self.BS) - len(m.block_ids)
        before = self.locked_blocks()
        self.c.lock(m.handle)
        if need > self.c.num_available:
            with pytest.raises(OutOfBlocks):
                self.c.allocate(need)
            self.c.unlock(m.handle)
            return
        fresh = self.c.allocate(need)
        assert not (set(fresh) & before), "allocation evicted a locked block"
        self.live[self.next_id] = (tokens, list(m.block_ids) + fresh)
        self.next_id += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), generated=st.lists(st.integers(0, 1), max_size=4))
    def finish(self, data, generated: list[int]) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        tokens, table = self.live.pop(rid)
        # the request generated a few tokens into its own blocks (as decode does)
        full = tokens + generated
        extra = -(-len(full) // self.BS) - len(table)
        if extra > 0:
            if extra > self.c.num_available:
                self.c.release(table)
                return
            table += self.c.allocate(extra)
        res = self.c.insert_finished(full, table)
        got = self.c.match(full)
        assert got.num_blocks == len(full) // self.BS, "match after insert misses inserted blocks"
        for i, b in enumerate(got.block_ids):
            assert b == table[i] or table[i] in res.duplicates
        assert set(res.freed) <= set(table)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data) -> None:
        rid = data.draw(st.sampled_from(sorted(self.live)))
        _, table = self.live.pop(rid)
        self.c.release(table)

    @rule(tokens=st.lists(st.integers(0, 1), min_size=2, max_size=8))
    def pin(self, tokens: list[int]) -> None:
        m = self.c.match(tokens)
        if m.num_blocks:
            self.c.pin(m)
            self.pins.append(m)

    @precondition(lambda self: self.pins)
    @rule()
    def unpin(self) -> None:
        self.c.unpin(self.pins.pop(0))

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        # one block at a time, each checked against the least recently used evictable leaf
        for _ in range(n):
            candidates = [x for x in self.c._leaves if x.evictable]
            locked = self.locked_blocks()
            expected = (
                min(candidates, key=lambda x: (x.last_access, x.uid)).blocks[-1]
                if candidates
                else None
            )
            freed = self.c.evict(1)
            if expected is None:
                assert freed == [] and self.c.num_evictable == 0
                return
            assert freed == [expected], "not the tail of the LRU evictable leaf"
            assert expected not in locked, "evicted a locked block"
            assert not self.c.is_cached(expected) and self.a.refcount(expected) == 0

    @rule(n=st.integers(0, 8))
    def evict_batch(self, n: int) -> None:
        freed = self.c.evict(n)
        assert len(freed) == min(n, len(freed) + self.c.num_evictable)
        assert len(set(freed)) == len(freed)

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "c"):
            return
        check_invariants(self.c)
        owned = {b for b in range(self.a.num_blocks) if self.c.is_cached(b)}
        private = {b for _, t in self.live.values() for b in t} - owned
        assert len(owned) + len(private) + self.a.num_free == self.a.num_blocks
        assert self.c.num_available == self.a.num_free + self.c.num_evictable
        for m in self.pins:
            assert all(b in owned for b in m.block_ids), "a pinned block was evicted"
        for _, t in self.live.values():
            assert all(self.a.refcount(b) >= 1 for b in t), "a live request's block was freed"


def machine_settings(max_examples: int) -> settings:
    """Hypothesis settings for the radix state machines: `max_examples` runs of 40 steps."""
    return settings(
        max_examples=max_examples,
        stateful_step_count=40,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


RadixMachine.TestCase.settings = machine_settings(120)
TestRadixInvariants = RadixMachine.TestCase


class OneTokenBlockMachine(RadixMachine):
    """The same with one-token blocks (the simulator's units), keyed by the token itself."""

    BS = 1


OneTokenBlockMachine.TestCase.settings = machine_settings(60)
TestRadixInvariantsOneTokenBlocks = OneTokenBlockMachine.TestCase


def test_engine_can_run_on_the_radix_cache_and_counts_hits():
    """MD's engine uses the radix cache through the same calls; lookups land in its histogram."""
    from pddnet.engine.engine import Engine
    from pddnet.model import load_model

    model, tok = load_model("tiny")
    prompt = [256] + list(range(60))
    with (
        Engine(model, tok, num_blocks=64, block_size=8) as hashed,
        Engine(model, tok, num_blocks=64, block_size=8, prefix_cache_kind="radix") as radix,
    ):
        want = hashed.generate(prompt, 6)
        assert radix.generate(prompt, 6) == want
        assert radix.generate(prompt + [5, 6, 7], 6) == hashed.generate(prompt + [5, 6, 7], 6)
        cache = radix.prefix_cache
        assert isinstance(cache, RadixCache)
        assert cache.num_requests == 2 and cache.tokens_hit >= 56
        assert sum(cache.hit_histogram) == 2
    with pytest.raises(ValueError, match="unknown prefix cache kind"):
        Engine(model, tok, num_blocks=8, block_size=8, prefix_cache_kind="trie")


def test_insert_finished_with_the_callers_hashes_is_the_same_insert() -> None:
    rng = random.Random(5)
    a, b = RadixCache(BlockAllocator(64), BS), RadixCache(BlockAllocator(64), BS)
    for _ in range(12):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 5 * BS))]
        n = -(-len(tokens) // BS)
        ta, tb = a.allocate(n), b.allocate(n)
        extra = [rng.getrandbits(64)]  # trailing hashes beyond the full blocks: ignored
        ra = a.insert_finished(tokens, ta)
        rb = b.insert_finished(tokens, tb, chained_hashes(tokens, BS) + extra)
        assert ra == rb and a.drain_events() == b.drain_events()
    check_invariants(a)
    tokens = list(range(3 * BS))
    t = a.allocate(3)
    with pytest.raises(ValueError, match="2 hashes for 3 full blocks"):
        a.insert_finished(tokens, t, chained_hashes(tokens, BS)[:2])
    with pytest.raises(ValueError, match="not the chained hashes"):
        a.insert_finished(tokens, t, chained_hashes(tokens, BS)[1:] + [0])
    check_invariants(a)
    assert a.insert_finished(tokens, t, chained_hashes(tokens, BS)).adopted == tuple(t)
