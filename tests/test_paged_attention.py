"""Paged attention (reads the KV pool in place, online softmax) against the reference
`causal_attention` over gathered keys, its tiling plan, and the runner's two paths."""

from __future__ import annotations

import random

import pytest
import torch

import pddnet.model.paged_attention as pa
from pddnet.engine.runner import Chunk, ModelRunner
from pddnet.kv.pool import KVPool, KVSpec
from pddnet.model.attention import causal_attention
from pddnet.model.loader import load_model
from pddnet.model.paged_attention import paged_attention, plan_chunk


def _table(rng: random.Random, kind: str, needed: int, num_blocks: int) -> list[int]:
    if kind == "consecutive":
        first = rng.randrange(num_blocks - needed + 1)
        return list(range(first, first + needed))
    if kind == "scattered":
        return rng.sample(range(num_blocks), needed)
    # runs of random lengths at random places: some long enough to be views, some gathered
    table: list[int] = []
    used: set[int] = set()
    while len(table) < needed:
        start = rng.randrange(num_blocks)
        for b in range(start, min(num_blocks, start + rng.choice([1, 2, 5, 40]))):
            if b not in used and len(table) < needed:
                table.append(b)
                used.add(b)
    return table


def _case(
    rng: random.Random,
    n: int,
    t: int,
    block_size: int,
    kv_heads: int,
    group: int,
    head_dim: int,
    kind: str,
    dtype: torch.dtype = torch.float64,
):
    needed = -(-n // block_size)
    num_blocks = 2 * needed + 3
    table = _table(rng, kind, needed, num_blocks)
    k_blocks = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=torch.float64)
    v_blocks = torch.randn_like(k_blocks)
    q = 3 * torch.randn(t, kv_heads * group, head_dim, dtype=torch.float64)
    slots = torch.tensor([table[i // block_size] * block_size + i % block_size for i in range(n)])
    keys, values = k_blocks.flatten(0, 1)[slots], v_blocks.flatten(0, 1)[slots]
    # a longer table than needed, as the engine's tables are (room for later tokens)
    return (
        q.to(dtype),
        k_blocks.to(dtype),
        v_blocks.to(dtype),
        table + [0, 1],
        keys.to(dtype),
        values.to(dtype),
    )


@pytest.mark.parametrize("windowed", [False, True])
@pytest.mark.parametrize("tiles", ["default", "small"])
def test_paged_attention_equals_causal_attention(tiles, windowed, monkeypatch):
    if tiles == "small":  # many query and key tiles, partial ones, masks on several of them
        monkeypatch.setattr(pa, "SCORE_TILE_ELEMENTS", 64)
        monkeypatch.setattr(pa, "QUERY_TILE_ROWS", 8)
        monkeypatch.setattr(pa, "MIN_TILE_KEYS", 4)
    seed = 17 if windowed else 7
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cases = 0
    for kind in ("consecutive", "scattered", "mixed"):
        for mode in ("decode", "extend", "prefill", "chunk"):
            for _ in range(4):
                n = rng.randint(1, 700 if tiles == "default" else 150)
                t = {
                    "decode": 1,
                    "extend": rng.randint(1, min(n, 9)),
                    "prefill": n,
                    "chunk": rng.randint(1, n),
                }[mode]
                # sliding windows: W = 1, smaller than the chunk, about it, past the context
                window = (
                    rng.choice([1, 2, max(1, t // 3), t, t + 5, rng.randint(1, n), n + 9])
                    if windowed
                    else None
                )
                block_size = rng.choice([1, 3, 4, 16])
                kv_heads, group = rng.choice([(1, 1), (1, 2), (2, 2), (2, 4), (4, 1)])
                q, kb, vb, table, keys, values = _case(
                    rng, n, t, block_size, kv_heads, group, rng.choice([8, 16]), kind
                )
                heads = kv_heads * group
                plan = plan_chunk(table, n, block_size, t, heads, kv_heads, window)
                out = paged_attention(q, kb, vb, plan, q_offset=n - t)
                ref = causal_attention(q, keys, values, q_offset=n - t, window=window)
                assert out.dtype == torch.float64 and out.shape == ref.shape
                assert torch.isfinite(out).all()
                err = (out - ref).abs().max().item()
                assert err < 1e-10, (kind, mode, n, t, window, block_size, kv_heads, group, err)
                cases += 1
    assert cases == 48


def test_several_chunks_of_one_sequence_each_equal_the_reference():
    # a prompt computed in chunks: chunk i attends over everything before it plus itself
    rng = random.Random(3)
    q, kb, vb, table, keys, values = _case(rng, 1000, 1000, 16, 2, 2, 16, "mixed")
    out = torch.cat(
        [
            paged_attention(q[s:e], kb, vb, plan_chunk(table, e, 16, e - s, 4, 2), s)
            for s, e in ((0, 300), (300, 301), (301, 777), (777, 1000))
        ]
    )
    ref = causal_attention(q, keys, values, q_offset=0)
    assert (out - ref).abs().max().item() < 1e-10


@pytest.mark.parametrize(
    "pool_dtype, q_dtype, tol",
    [
        (torch.bfloat16, torch.float64, 1e-10),
        (torch.float32, torch.float64, 1e-10),
        (torch.float32, torch.bfloat16, 2e-4),
        (torch.float64, torch.bfloat16, 2e-4),
        (torch.bfloat16, torch.float32, 1e-6),
    ],
)
def test_narrow_pool_dtype_is_read_as_gather_then_reference_would(pool_dtype, q_dtype, tol):
    # gather(dtype=q.dtype) cast the stored K/V to q's dtype; paged attention must see the same
    rng = random.Random(5)
    q, kb, vb, table, keys, values = _case(rng, 300, 20, 4, 2, 2, 16, "mixed")
    q, kb, vb = q.to(q_dtype), kb.to(pool_dtype), vb.to(pool_dtype)
    keys, values = keys.to(pool_dtype).to(q_dtype), values.to(pool_dtype).to(q_dtype)
    out = paged_attention(q, kb, vb, plan_chunk(table, 300, 4, 20, 4, 2), q_offset=280)
    ref = causal_attention(q, keys, values, q_offset=280)
    assert out.dtype == q_dtype
    # the mean, not the max: a bfloat16 output may round one ulp apart now and then, while
    # skipping the cast to q's dtype moves most outputs (mean ~1e-3)
    diff = (out.double() - ref.double()).abs()
    assert diff.mean().item() < tol and diff.max().item() < 2e-2


def test_plan_reads_runs_in_place_gathers_only_scattered_blocks_and_bounds_tiles():
    bs = 16
    # decode over 64K keys in one run of consecutive blocks: a few long view tiles, no copy
    plan = plan_chunk(list(range(10, 10 + 4096)), 65536, bs, 1, 2, 1)
    assert all(tile.index is None for tile in plan.tiles)
    assert max(tile.end - tile.start for tile in plan.tiles) == pa.MAX_TILE_KEYS
    assert all(a.end == b.start for a, b in zip(plan.tiles, plan.tiles[1:], strict=False))
    assert plan.tiles[0].start == 0 and plan.tiles[-1].end == 65536
    # a prefill chunk's score tile (query rows x keys) stays within the budget
    chunk = plan_chunk(list(range(4096)), 65536, bs, 2048, 2, 1)
    rows = min(2048, chunk.query_tile) * 2
    assert all(rows * (t.end - t.start) <= pa.SCORE_TILE_ELEMENTS for t in chunk.tiles)
    # a long run is viewed in place; the scattered rest is gathered in bounded tiles
    tile_blocks = pa.MAX_TILE_KEYS // bs  # a decode's tile
    long = tile_blocks // pa.MIN_VIEW_SHARE + 3  # just long enough to be read in place
    scattered = list(range(90_000, 80_000, -2))[: 2 * tile_blocks + 7]
    table = list(range(100, 100 + long)) + scattered + list(range(50_000, 50_010))
    plan = plan_chunk(table, len(table) * bs - 5, bs, 1, 2, 1)
    views = [t for t in plan.tiles if t.index is None]
    gathers = [t for t in plan.tiles if t.index is not None]
    assert [(t.first_block, t.num_blocks) for t in views] == [(100, long)]
    assert len(gathers) == 3 and sum(t.num_blocks for t in gathers) == len(scattered) + 10
    assert all(t.num_blocks <= pa.MAX_TILE_KEYS // bs for t in plan.tiles)
    assert all(a.end == b.start for a, b in zip(plan.tiles, plan.tiles[1:], strict=False))
    assert torch.cat([t.index for t in gathers]).tolist() == scattered + list(range(50_000, 50_010))
    assert plan.tiles[-1].end == len(table) * bs - 5


def test_view_tiles_share_the_pools_memory():
    spec = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=4, dtype="float64")
    pool = KVPool(spec, num_blocks=8)
    k_blocks, _ = pool.layer_blocks(0)
    tile = plan_chunk([2, 3, 4], 10, 4, 1, 2, 1).tiles[0]
    assert tile.index is None
    view = pa._tile_kv(k_blocks, tile, 10)
    assert view.data_ptr() == pool.data[0, 0, 2].data_ptr()  # no copy
    view[9].fill_(1.0)
    assert pool.data[0, 0, 4, 1].eq(1.0).all()


def test_bad_plans_are_refused():
    with pytest.raises(ValueError, match="need 3 blocks, block table has 2"):
        plan_chunk([0, 1], 40, 16, 1, 2, 1)
    with pytest.raises(ValueError, match="negative ids"):
        plan_chunk([0, -1], 20, 16, 1, 2, 1)
    kb = torch.zeros(4, 16, 1, 8, dtype=torch.float64)
    q = torch.zeros(2, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="plan covers 40 keys"):
        paged_attention(q, kb, kb, plan_chunk([0, 1, 2], 40, 16, 2, 2, 1), q_offset=10)
    with pytest.raises(ValueError, match="reads block 4, outside the pool's 4 blocks"):
        paged_attention(q, kb, kb, plan_chunk([2, 3, 4], 40, 16, 2, 2, 1), q_offset=38)


def test_runner_paged_and_gather_paths_agree_on_a_mixed_batch():
    model, _ = load_model("tiny")
    spec = KVSpec.from_model_config(model.config, block_size=4)
    rng = random.Random(11)
    ids = [rng.randrange(256) for _ in range(90)]
    logits = {}
    for path in ("paged", "gather"):
        pool = KVPool(spec, num_blocks=64)
        runner = ModelRunner(model, pool, attention=path)
        a = [5, 9, 2, 30, 31, 32, 33, 7, 8, 40, 41, 42, 43, 44, 45, 46]  # runs and jumps
        b = list(range(50, 64))
        first = runner.run([Chunk(ids[:37], 0, a, "none"), Chunk(ids[:50], 0, b, "all")])
        # then: a decode, an extend of several tokens, and a prefill chunk, batched together
        second = runner.run([Chunk(ids[37:38], 37, a), Chunk(ids[50:56], 50, b, "all")])
        logits[path] = [first[1], *second]
    for paged, gathered in zip(logits["paged"], logits["gather"], strict=True):
        assert (paged - gathered).abs().max().item() < 1e-10
    with pytest.raises(ValueError, match="attention must be 'paged' or 'gather'"):
        ModelRunner(model, KVPool(spec, num_blocks=4), attention="flash")
