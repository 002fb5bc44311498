"""Causal grouped-query attention that reads K/V from paged blocks in place (online softmax).

The caller hands over one layer's key and value blocks, ``[num_blocks, block_size, Hkv, D]``
each (views of the engine's pool, never copies), and a ``ChunkPlan`` that cuts the sequence's
block table into *key tiles*. A tile whose block ids are consecutive is a plain slice of the
blocks tensor; only tiles made of short, scattered runs are gathered, and those copies are
bounded by the tile size. Attention then runs tile by tile with a running max and sum per query
row (FlashAttention's online softmax), so the temporary memory -- one tile of keys and values,
one tile of scores per query tile -- does not grow with the context, and the full ``[t, n]``
score matrix of ``causal_attention`` is never built.

Queries are cut into tiles too, which bounds the scores of a long prefill chunk and lets a
(query tile, key tile) pair that lies wholly in the queries' future be skipped; the causal
mask is built only for pairs that straddle the diagonal. Key tiles are the outer loop, so a
gathered or dtype-converted tile is made once per layer, not once per query tile.

With a sliding window W (ModelConfig.sliding_window) the plan starts at the block holding the
chunk's first query's oldest visible key: blocks wholly older are never read, so a chunk's cost
is bounded by W plus the chunk, not by the context. Pairs of tiles that straddle a query's
window edge get that edge in their mask too, and a query row that sees no key of a tile adds
nothing to its running sums.

``causal_attention`` (attention.py) stays the reference this is tested against.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

# Sizes of the tiles, chosen on a 2-core CPU (float64, tiny-long): a tile of scores of ~256K
# elements (2 MiB in float64) stays in cache and keeps the per-tile Python overhead (about ten
# torch calls, ~0.1 ms) small against its arithmetic. Decode (few query rows) gets long key
# tiles -- 16K keys: a decode at 64K context is 4 tiles per layer, ~25% faster than 8 tiles of
# 8K --, a prefill chunk short ones (512 keys for 256 tokens x 2 query heads).
SCORE_TILE_ELEMENTS = 1 << 18
QUERY_TILE_ROWS = 512  # query rows (tokens x group) per query tile and kv head
MIN_TILE_KEYS = 256
MAX_TILE_KEYS = 16384
# A run of consecutive block ids at least this share of a tile long is read in place; shorter
# runs are packed together into one gathered tile (many tiny views would cost more in calls).
MIN_VIEW_SHARE = 4


@dataclass(frozen=True)
class KeyTile:
    """Keys ``start..end-1`` of a sequence: blocks ``first_block..first_block+num_blocks-1``
    of the pool (a view) when ``index`` is None, else the blocks listed in ``index`` (a gather).
    """

    start: int
    end: int
    first_block: int
    num_blocks: int
    index: torch.Tensor | None = None


@dataclass(frozen=True)
class ChunkPlan:
    """How one chunk's attention walks its sequence: key tiles in position order, and the
    number of query tokens per query tile."""

    tiles: tuple[KeyTile, ...]
    query_tile: int
    num_keys: int
    max_block: int  # the largest block id read, checked against the pool once per call
    window: int | None = None  # sliding window: a query at p sees keys p-window+1..p


def plan_chunk(
    block_table: Sequence[int],
    num_keys: int,
    block_size: int,
    num_queries: int,
    num_heads: int,
    num_kv_heads: int,
    window: int | None = None,
) -> ChunkPlan:
    """Plan the attention of ``num_queries`` queries over keys ``0..num_keys-1`` stored in
    ``block_table`` (computed once per chunk and step, used by every layer). With a sliding
    ``window`` the tiles start at the block of key ``num_keys - num_queries - window + 1``, the
    oldest one the chunk's first query sees."""
    if num_keys <= 0 or num_queries <= 0:
        raise ValueError(f"need keys and queries, got {num_keys} keys, {num_queries} queries")
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")
    needed = -(-num_keys // block_size)
    if needed > len(block_table):
        raise ValueError(
            f"{num_keys} keys need {needed} blocks, block table has {len(block_table)}"
        )
    group = num_heads // num_kv_heads
    query_tile = max(1, QUERY_TILE_ROWS // group)
    rows = min(num_queries, query_tile) * group * num_kv_heads
    tile_keys = min(MAX_TILE_KEYS, max(MIN_TILE_KEYS, SCORE_TILE_ELEMENTS // rows))
    tile_blocks = max(1, tile_keys // block_size)
    oldest = 0 if window is None else max(0, num_keys - num_queries - window + 1)
    skip = oldest // block_size  # blocks every query's window has left behind: never read
    ids = list(block_table[skip:needed])
    if min(ids) < 0:  # a negative start would slice the pool from its end
        raise ValueError(f"block table {ids} has negative ids")
    tiles = _key_tiles(ids, skip, num_keys, block_size, tile_blocks)
    return ChunkPlan(tuple(tiles), query_tile, num_keys, max(ids), window)


def _key_tiles(
    ids: list[int], skip: int, num_keys: int, block_size: int, tile_blocks: int
) -> list[KeyTile]:
    """Tiles over ``ids``, the block table from its entry ``skip`` on: runs of consecutive ids
    become views (split at ``tile_blocks``); short runs are packed into gathered tiles of at
    most ``tile_blocks`` blocks. A table that is one run is all views, however short."""
    table = torch.tensor(ids, dtype=torch.long)
    # Where a run of consecutive ids starts: index 0 and wherever the id does not follow on.
    breaks = (table[1:] != table[:-1] + 1).nonzero().flatten().add_(1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, len(ids)]
    min_view = max(1, tile_blocks // MIN_VIEW_SHARE) if len(starts) > 1 else 1
    tiles: list[KeyTile] = []
    pending: list[int] = []  # table indices of short runs waiting to fill a gather tile

    def add(first: int, count: int, index: torch.Tensor | None) -> None:
        tiles.append(
            KeyTile(
                (skip + first) * block_size,
                min(num_keys, (skip + first + count) * block_size),
                ids[first],
                count,
                index,
            )
        )

    def flush() -> None:
        if pending:
            add(pending[0], len(pending), table[pending[0] : pending[0] + len(pending)].clone())
            pending.clear()

    for s, e in zip(starts, ends, strict=True):
        if e - s >= min_view:
            flush()
            for first in range(s, e, tile_blocks):
                add(first, min(tile_blocks, e - first), None)
            continue
        for i in range(s, e):
            pending.append(i)
            if len(pending) == tile_blocks:
                flush()
    flush()
    return tiles


def _tile_kv(blocks: torch.Tensor, tile: KeyTile, num_keys: int) -> torch.Tensor:
    """The tile's first ``num_keys`` keys (or values) as ``[num_keys, Hkv, D]``."""
    count = -(-num_keys // blocks.shape[1])
    if tile.index is None:
        x = blocks[tile.first_block : tile.first_block + count]
    else:
        x = blocks.index_select(0, tile.index[:count])
    return x.flatten(0, 1)[:num_keys]


def paged_attention(
    q: torch.Tensor, k_blocks: torch.Tensor, v_blocks: torch.Tensor, plan: ChunkPlan, q_offset: int
) -> torch.Tensor:
    """Attention of queries at positions ``q_offset..`` over the plan's keys ``0..n-1``.

    q [t, Hq, D]; k_blocks, v_blocks [num_blocks, block_size, Hkv, D] in the pool's dtype;
    query i sees keys ``0..q_offset+i`` (only the last ``plan.window`` of them with a window),
    so n must be ``q_offset + t`` (the chunk's own keys already written). Returns [t, Hq, D]
    in q's dtype. As with ``causal_attention`` after ``KVPool.gather(dtype=q.dtype)``, stored
    K/V are first cast to q's dtype, then low-precision values are computed in float32.
    """
    t, num_heads, head_dim = q.shape
    num_kv_heads = k_blocks.shape[2]
    if k_blocks.shape != v_blocks.shape or k_blocks.dim() != 4 or k_blocks.shape[3] != head_dim:
        raise ValueError(
            f"k/v blocks {tuple(k_blocks.shape)}/{tuple(v_blocks.shape)} must be "
            f"[num_blocks, block_size, kv_heads, {head_dim}] alike"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
        )
    if q_offset < 0 or plan.num_keys != q_offset + t:
        raise ValueError(
            f"plan covers {plan.num_keys} keys, queries at positions {q_offset}.."
            f"{q_offset + t - 1} need {q_offset + t}"
        )
    window = plan.window
    if window is not None and plan.tiles[0].start > max(0, q_offset - window + 1):
        raise ValueError(
            f"plan starts at key {plan.tiles[0].start}, the query at position {q_offset} sees "
            f"keys from {max(0, q_offset - window + 1)} (a plan made for fewer queries)"
        )
    if plan.max_block >= k_blocks.shape[0]:
        raise ValueError(
            f"plan reads block {plan.max_block}, outside the pool's {k_blocks.shape[0]} blocks"
        )
    compute = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    group = num_heads // num_kv_heads
    # Rows ordered (token, group) inside each kv head, so a query tile is a contiguous range of
    # rows; the scale is folded into q once instead of into every tile of scores.
    qf = (
        (q.to(compute) * (1.0 / math.sqrt(head_dim)))
        .view(t, num_kv_heads, group, head_dim)
        .transpose(0, 1)
        .reshape(num_kv_heads, t * group, head_dim)
    )
    bounds = [(q0, min(t, q0 + plan.query_tile)) for q0 in range(0, t, plan.query_tile)]
    # Per query tile: running max, running sum, unnormalised output (None until its first tile).
    state: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * len(bounds)
    for tile in plan.tiles:
        # The query tiles that see some key of this tile: from the first one not wholly before
        # it (causality) up to the first one whose oldest query's window starts after it.
        first = next((i for i, (_, q1) in enumerate(bounds) if q_offset + q1 > tile.start), None)
        if first is None:
            break  # this and every later tile lies in all queries' future
        last = len(bounds)
        if window is not None:
            last = next(
                (i for i in range(first, last) if q_offset + bounds[i][0] - window + 1 >= tile.end),
                last,
            )
            if first == last:
                continue  # older than every window (a plan made for more queries than these)
        n = tile.end - tile.start
        k = _tile_kv(k_blocks, tile, n)
        v = _tile_kv(v_blocks, tile, n)
        if k.dtype != q.dtype:  # what gather(dtype=q.dtype) did: round to q's dtype first
            k, v = k.to(q.dtype), v.to(q.dtype)
        if k.dtype != compute:
            k, v = k.to(compute), v.to(compute)
        for i in range(first, last):
            q0, q1 = bounds[i]
            p0, p1 = q_offset + q0, q_offset + q1  # positions of this query tile
            # keys older than the first query's window are in no query's window; keys after
            # p1-1 are in every query's future
            lo = 0 if window is None else max(0, p0 - window + 1 - tile.start)
            hi = min(tile.end, p1) - tile.start
            kt, vt = k[lo:hi].permute(1, 2, 0), v[lo:hi].permute(1, 0, 2)  # [Hkv, D, nk], ...
            s = torch.bmm(qf[:, q0 * group : q1 * group], kt)  # [Hkv, rows, nk]
            k0, nk = tile.start + lo, hi - lo  # position of the first key in s, keys in s
            future = k0 + nk - 1 > p0  # some key is in some query's future
            old = window is not None and k0 < p1 - window  # some key left some query's window
            if future or old:
                keys, positions = torch.arange(k0, k0 + nk)[None, :], torch.arange(p0, p1)[:, None]
                hidden = keys > positions
                if old:
                    hidden |= keys <= positions - window
                s.view(num_kv_heads, q1 - q0, group, nk).masked_fill_(
                    hidden[None, :, None, :], float("-inf")
                )
            tile_max = s.amax(-1)
            prev = state[i]
            new_max = tile_max if prev is None else torch.maximum(prev[0], tile_max)
            # Without a window the first tile holds key 0, visible to every query: the max is
            # finite. With one, a row may not have seen any key yet (max -inf): shifting it by
            # 0 makes its exp(-inf) terms 0 instead of NaN.
            shift = new_max if window is None else new_max.nan_to_num(neginf=0.0)
            s.sub_(shift.unsqueeze(-1)).exp_()
            if prev is None:
                state[i] = (new_max, s.sum(-1), torch.bmm(s, vt))
                continue
            m, total, acc = prev
            scale = (m - shift).exp_()
            total.mul_(scale).add_(s.sum(-1))
            acc.mul_(scale.unsqueeze(-1)).baddbmm_(s, vt)
            state[i] = (new_max, total, acc)
    out = torch.empty(num_kv_heads, t * group, head_dim, dtype=compute)
    for (q0, q1), st in zip(bounds, state, strict=True):
        assert st is not None  # every query sees itself, in the tile of its own position
        _, total, acc = st
        out[:, q0 * group : q1 * group] = acc.div_(total.unsqueeze(-1))
    return (
        out.view(num_kv_heads, t, group, head_dim)
        .transpose(0, 1)
        .reshape(t, num_heads, head_dim)
        .to(q.dtype)
    )
