"""The fast paths the simulator's scale relies on do exactly what the paths they replace do.

Each fast path (chained hashes, a prediction from kept hashes, a fused match-and-lock, the
allocator's counted-on-the-way checks, the eviction heap) is compared with the slow form on
the same inputs, so a speed-up can never change a result.
"""

from __future__ import annotations

import itertools
import random
import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.cache_events import CacheEventBatch
from pddnet.kv.radix import RadixCache
from pddnet.kv.radix_check import check_invariants
from pddnet.policy.cache_view import DecodeCacheView
from pddnet.sim.config import parse_config
from pddnet.sim.reproduce import scenario
from pddnet.sim.system import ReqState, SimulatedSystem
from pddnet.workload.units import SimRequest


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.lists(st.integers(-(1 << 40), 1 << 40), max_size=40),
    bs=st.integers(1, 5),
    parent=st.integers(0, (1 << 64) - 1),
)
def test_chained_hashes_are_the_streamed_definition(
    tokens: list[int], bs: int, parent: int
) -> None:
    """The one-shot digests per block equal the definition hashed block by block (xxh3 of the
    parent hash || the block's tokens, streamed): P's view and MD's cache name prefixes alike."""
    want, h = [], parent
    for i in range(len(tokens) // bs):
        x = xxhash.xxh3_64()
        x.update(struct.pack("<Q", h))
        x.update(struct.pack(f"<{bs}q", *tokens[i * bs : (i + 1) * bs]))
        h = x.intdigest()
        want.append(h)
    assert chained_hashes(tokens, bs, parent) == want


def _view_with(prefixes: list[list[int]], bs: int) -> DecodeCacheView:
    c = RadixCache(BlockAllocator(256), bs)
    for p in prefixes:
        c.insert_finished(p, c.allocate(-(-len(p) // bs)))
    v = DecodeCacheView(max_hashes=64)
    v.apply(c.drain_events())
    return v


def test_prediction_from_kept_hashes_equals_hashing_the_prompt() -> None:
    rng = random.Random(3)
    for bs in (1, 4):
        base = [rng.randrange(9) for _ in range(40)]
        a, b = (
            _view_with([base[:24], base[:9] + [99] * 8], bs),
            _view_with([base[:24], base[:9] + [99] * 8], bs),
        )
        for cut in (0, 1, 5, 9, 17, 24, 33, 40):
            prompt = base[:cut]
            slow = a.predict(prompt)
            fast = b.predict_from_hashes(len(prompt), chained_hashes(prompt, bs), bs)
            assert fast == slow
        assert list(a._hashes) == list(b._hashes)  # the same LRU order after
    v = _view_with([[1, 2, 3, 4]], 2)
    with pytest.raises(ValueError, match="block size 4, the view's is 2"):
        v.predict_from_hashes(8, [1, 2], 4)
    with pytest.raises(ValueError, match="needs its first 3"):
        v.predict_from_hashes(8, [1, 2], 2)


def _twin_caches(seed: int) -> tuple[RadixCache, RadixCache, list[list[int]]]:
    """Two caches fed the same random conversations, and prompts to look up."""
    rng = random.Random(seed)
    caches = (RadixCache(BlockAllocator(48), 2), RadixCache(BlockAllocator(48), 2))
    prompts = []
    for _ in range(30):
        p = [rng.randrange(3) for _ in range(rng.randrange(2, 14))]
        prompts.append(p)
        for c in caches:
            need = -(-len(p) // 2)
            if c.num_available >= need:
                c.insert_finished(p, c.allocate(need))
    return caches[0], caches[1], prompts


@pytest.mark.parametrize("seed", range(6))
def test_match_and_lock_is_match_prefix_then_lock(seed: int) -> None:
    slow, fast, prompts = _twin_caches(seed)
    held = []
    for p in prompts:
        m1 = slow.match_prefix(p, max_blocks=(len(p) - 1) // 2, record=False)
        slow.lock(m1.handle)
        m2 = fast.match_and_lock(p, max_blocks=(len(p) - 1) // 2)
        assert m1 == m2
        held.append((m1, m2))
        check_invariants(slow)
        check_invariants(fast)
    # the same state: the same evictions, in the same order, once the locks are gone
    for m1, m2 in held:
        slow.unlock(m1.handle)
        fast.unlock(m2.handle)
    assert slow.evict(1000) == fast.evict(1000)
    assert slow.drain_events() == fast.drain_events()


class _ReleaseAfterInsert(RadixCache):
    """insert_finished dropping the request's references the general way."""

    def _release_inserted(self, ids: list[int], owners: list, unchecked: list[int]) -> list[int]:
        return self.release(ids)


@pytest.mark.parametrize("seed", range(8))
def test_insert_finished_releases_as_release_does(seed: int) -> None:
    """Requests that locked a cached prefix, or did not (their copies are duplicates), with
    partial tails, splits and evictions between them: the same results and the same state."""
    rng = random.Random(seed)
    bs = 1 + seed % 2  # one-token blocks are keyed by the token itself
    slow, fast = _ReleaseAfterInsert(BlockAllocator(40), bs), RadixCache(BlockAllocator(40), bs)
    live: list[tuple[list[int], list[int], list[int]]] = []
    for _ in range(60):
        if live and (rng.random() < 0.5 or len(live) > 3):
            p, t1, t2 = live.pop(rng.randrange(len(live)))
            out = p + [rng.randrange(3) for _ in range(rng.randrange(0, 3))]
            r1, r2 = slow.insert_finished(out, t1), fast.insert_finished(out, t2)
            assert r1 == r2
        else:
            p = [rng.randrange(3) for _ in range(rng.randrange(2, 12))]
            need = -(-(len(p) + 2) // bs)
            lock = rng.random() < 0.7
            upto = rng.randrange((len(p) - 1) // bs + 1)  # may lock less than it could
            tables = []
            for c in (slow, fast):
                hit: tuple[int, ...] = ()
                if lock:
                    hit = c.match_and_lock(p, max_blocks=upto).block_ids
                if c.num_available < need - len(hit):
                    tables = []
                    if hit:
                        c.release(list(hit))
                    continue
                tables.append(list(hit) + c.allocate(need - len(hit)))
            if len(tables) == 2:
                assert tables[0] == tables[1]
                live.append((p, tables[0], tables[1]))
        for c in (slow, fast):
            check_invariants(c)
        assert slow.num_evictable == fast.num_evictable
        assert slow.drain_events() == fast.drain_events()
    for _p, t1, t2 in live:
        slow.release(t1)
        fast.release(t2)
    assert slow.evict(1000) == fast.evict(1000)
    assert slow.drain_events() == fast.drain_events()


def test_rejected_allocator_calls_change_nothing() -> None:
    a = BlockAllocator(6)
    x = a.allocate(3)
    before = [a.refcount(b) for b in range(6)], a.num_free
    with pytest.raises(ValueError, match="double free"):
        a.decref([x[0], x[1], x[1]])  # x[1] goes below zero after freeing x[0]
    with pytest.raises(ValueError, match="incref of free block 5"):
        a.incref([x[0], x[2], 5])
    with pytest.raises(ValueError, match="outside 0..5"):
        a.decref([x[0], -1])
    with pytest.raises(ValueError, match="outside 0..5"):
        a.incref([x[0], 1.0])  # not an int: rejected, as every non-int is
    assert ([a.refcount(b) for b in range(6)], a.num_free) == before
    assert a.decref([x[0], x[2]]) == [x[0], x[2]]
    assert a.allocate(3) == [3, 4, 5]  # FIFO reuse order unchanged by the fast path


def test_simulator_prompt_hashes_follow_a_conversation() -> None:
    cfg = parse_config({**scenario(quick=True), "tokens_per_unit": 4})
    sim = SimulatedSystem(cfg, "pdd")
    bs = sim.block_units
    assert bs == 4
    units: tuple[int, ...] = ()
    rng = random.Random(1)
    later: list[tuple[list[int], list[int]]] = []
    states: list[tuple[ReqState, tuple[int, ...]]] = []
    for turn in range(6):
        units = units + tuple(rng.randrange(50) for _ in range(rng.randrange(1, 11)))
        if turn == 4:
            units = (7,) + units[1:]  # not an extension: hashed from scratch
        req = SimRequest(turn, 42, 0.0, units, len(units) * 4, 4, (1,))
        held = sim._hashes_for(req.conversation, req.units)
        assert held == chained_hashes(units, bs)
        first = list(held)
        later.append((held, first))
        st = ReqState(req)
        st.prompt_hashes = held
        # MD's insert of prompt + output: the same hashes, the kept ones left as they were
        with_kv = units + tuple(rng.randrange(50) for _ in range(5))
        assert sim._with_kv_hashes(st, with_kv) == chained_hashes(with_kv, bs)
        assert sim._hash_memo[42] == (units, first)
        states.append((st, units))
    for held, first in later:  # a holder's hashes stayed what they were
        assert held[: len(first)] == first
    for st, units in states:  # and lists grown by later turns give the same
        assert sim._with_kv_hashes(st, units + (3,) * 9) == chained_hashes(units + (3,) * 9, bs)


@settings(max_examples=150, deadline=None)
@given(
    start=st.lists(st.integers(0, 30), max_size=25),
    batches=st.lists(
        st.tuples(
            st.sampled_from(["add", "evicted", "predict"]),
            st.lists(st.integers(0, 30), max_size=12),
        ),
        max_size=10,
    ),
    cap=st.integers(1, 40),
)
def test_view_keeps_the_lru_order_of_stamping_each_batch_newest(
    start: list[int], batches: list[tuple[str, list[int]]], cap: int
) -> None:
    """DecodeCacheView (one stamp per batch, the next to drop found from a heap when the cap is
    passed) against its definition: the hashes of one batch (a notice's inserts, an answer's
    matched prefix) become the newest together, evicted ones leave, predictions change nothing,
    and past the cap the oldest batch's go first, of one batch the one learned last first."""
    view = DecodeCacheView(block_size=1, max_hashes=cap)
    ref: dict[int, int] = {}  # hash -> batch number; insertion order: learned
    dropped = 0
    for number, (kind, batch) in enumerate([("add", start), *batches]):
        if kind == "evicted":
            view.apply(CacheEventBatch(view.next_seq, 1, (), tuple(batch)))
            for h in batch:
                ref.pop(h, None)
            continue
        if kind == "predict":  # a pure query: no change
            pred = view.predict_from_hashes(len(batch), batch, 1)
            hit = list(itertools.takewhile(ref.__contains__, batch[: len(batch) - 1]))
            assert pred.hit_tokens == len(hit)
            batch = []
        else:
            view._add(batch)
        for h in batch:
            ref[h] = number  # a known hash keeps its place in the order
        while len(ref) > cap:
            order = list(ref)
            del ref[min(order, key=lambda h: (ref[h], -order.index(h)))]
            dropped += 1
        assert set(view._hashes) == set(ref)
        assert view.dropped_by_cap == dropped
        # the order the next drops will take: by batch, then the last learned first
        mine = list(view._hashes)
        assert sorted(mine, key=lambda h: (view._hashes[h], -mine.index(h))) == sorted(
            ref, key=lambda h: (ref[h], -list(ref).index(h))
        )
