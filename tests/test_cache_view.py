"""P's view of MD's cache: fed by a real RadixCache's notices, corrected by MD's answers."""

from __future__ import annotations

import dataclasses

import pytest

from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.radix import RadixCache
from pddnet.policy.cache_view import DecodeCacheView
from pddnet.protocol.messages import CacheEvents

BS = 4


class MD:
    """MD's side, sans IO: a RadixCache answering allocations the way reserve_kv does."""

    def __init__(self, num_blocks: int = 64) -> None:
        self.cache = RadixCache(BlockAllocator(num_blocks), BS)

    def serve_and_finish(self, prompt: list[int], output: list[int]) -> int:
        m = self.cache.match_prefix(prompt, max_blocks=(len(prompt) - 1) // BS)
        self.cache.lock(m.handle)
        with_kv = prompt + output[:-1]
        table = list(m.block_ids) + self.cache.allocate(-(-len(with_kv) // BS) - len(m.block_ids))
        self.cache.insert_finished(with_kv, table)
        return m.hit_tokens

    def notice(self) -> CacheEvents:
        batch = self.cache.drain_events()
        assert batch is not None
        return CacheEvents(**dataclasses.asdict(batch))


def test_view_predicts_the_next_turn_from_md_notices():
    md, view = MD(), DecodeCacheView()
    turn1 = list(range(30))
    assert view.predict(turn1).hit_tokens == 0  # block size unknown yet: no claim
    md.serve_and_finish(turn1, [200, 201, 202])
    assert view.apply(md.notice())
    turn2 = turn1 + [200, 201, 202] + [7] * 9
    p = view.predict(turn2)
    actual = md.serve_and_finish(turn2, [9, 9])
    assert p.hit_tokens == actual == 32  # 33 tokens with KV -> 8 full blocks
    obs = view.observe(p, actual)
    assert not obs.wrong and view.predictions == 1 and view.wrong == 0


def test_prediction_never_claims_the_block_of_the_last_token():
    view = DecodeCacheView(BS)
    prompt = list(range(16))
    view.resync(BS, chained_hashes(prompt, BS), next_seq=0)
    assert view.predict(prompt).hit_tokens == 12  # like reserve_kv: (n - 1) // bs blocks
    assert view.predict(prompt + [1]).hit_tokens == 16


def test_eviction_misprediction_is_counted_and_the_view_repaired():
    md, view = MD(num_blocks=12), DecodeCacheView()
    convo = list(range(40))
    md.serve_and_finish(convo, [1, 2])
    view.apply(md.notice())
    # MD evicts under pressure but the notice has not reached P yet
    md.cache.evict(6)
    follow = convo + [1, 2] + [50] * 6
    p = view.predict(follow)
    actual = md.serve_and_finish(follow, [3])
    assert p.hit_tokens == 40 and actual == 16
    obs = view.observe(p, actual)
    assert obs.wrong and obs.error_tokens == 24
    assert (view.wrong, view.over_predicted, view.error_tokens, view.max_error_tokens) == (
        1,
        1,
        24,
        24,
    )
    hashes = chained_hashes(follow, BS)
    assert all(h not in view for h in hashes[4:11])  # MD lacks block 4, so all deeper
    assert all(h in view for h in hashes[:4])
    assert view.predict(follow).hit_tokens == 16  # repaired before the notice arrives
    view.apply(md.notice())  # ...which then agrees
    assert view.predict(follow + [0]).hit_tokens == len(follow) // BS * BS


def test_under_prediction_teaches_the_view_what_md_has():
    view = DecodeCacheView(BS)
    prompt = list(range(21))
    p = view.predict(prompt)
    assert p.hit_tokens == 0
    obs = view.observe(p, 20)
    assert obs.error_tokens == -20 and view.under_predicted == 1
    assert view.predict(prompt).hit_tokens == 20
    with pytest.raises(ValueError, match="outside"):
        view.observe(p, 99)


def test_seq_gaps_mark_the_view_stale_and_old_notices_are_ignored():
    md, view = MD(), DecodeCacheView()
    md.serve_and_finish(list(range(12)), [1])
    n0 = md.notice()
    md.serve_and_finish(list(range(50, 62)), [1])
    n1 = md.notice()
    md.serve_and_finish(list(range(80, 92)), [1])
    n2 = md.notice()
    assert view.apply(n0) and not view.stale
    assert view.apply(n2) and view.stale and view.gaps == 1  # n1 lost
    assert not view.apply(n1) and view.duplicates == 1  # late: ignored
    assert view.predict(list(range(50, 62))).stale
    view.resync(BS, md.cache.snapshot_hashes(), next_seq=3)
    assert not view.stale and view.predict(list(range(50, 62)) + [0]).hit_tokens == 12


def test_memory_is_bounded_by_an_lru_cap():
    view = DecodeCacheView(BS, max_hashes=10)
    hot = list(range(16))
    view.apply(
        CacheEvents(seq=0, block_size=BS, inserted=tuple(chained_hashes(hot, BS)), evicted=())
    )
    for i in range(1, 6):
        # MD's answers that it matched the hot chain keep it recent
        view.observe(view.predict(hot + [0]), 16)
        cold = [100 + i] * 8
        view.apply(
            CacheEvents(seq=i, block_size=BS, inserted=tuple(chained_hashes(cold, BS)), evicted=())
        )
    assert len(view) == 10 and view.dropped_by_cap == 4
    assert view.predict(hot + [0]).hit_tokens == 16
    # predictions alone (requests that never reached MD) do not: MD did not touch the chain.
    # Once the cold ones pushed it to the oldest, its deepest blocks go first (as MD evicts
    # leaves first), so what is left still predicts a shorter hit.
    hits = []
    for i in range(6, 10):
        view.predict(hot + [0])
        cold = [100 + i] * 8
        view.apply(
            CacheEvents(seq=i, block_size=BS, inserted=tuple(chained_hashes(cold, BS)), evicted=())
        )
        hits.append(view.predict(hot + [0]).hit_tokens)
    assert hits == [16, 16, 8, 0]


def test_block_size_change_resets_the_view():
    view = DecodeCacheView(BS)
    view.apply(
        CacheEvents(seq=0, block_size=BS, inserted=tuple(chained_hashes([1] * 8, BS)), evicted=())
    )
    view.apply(CacheEvents(seq=1, block_size=8, inserted=(), evicted=()))
    assert len(view) == 0 and view.stale and view.block_size == 8
    with pytest.raises(ValueError):
        DecodeCacheView(0)
