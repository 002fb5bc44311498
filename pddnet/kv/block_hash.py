"""Chained block hashes: the names of KV prefixes that caches and views exchange.

``hash_i = xxh3_64(hash_{i-1} as 8 bytes LE || token ids of block i as int64 LE)``, with
``hash_{-1} = parent_hash`` (0 for a sequence's first block). The hash of block i names the
*whole* prefix up to it, so two instances compare what they hold by exchanging 64-bit numbers:
MD's radix cache announces its blocks by these hashes and P's view of it
(pddnet/policy/cache_view.py) predicts hits with the same function, so the two always agree.
Caches store the tokens too and compare them on a match: a collision never hands out wrong KV.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import Any

import xxhash

_PARENT = struct.Struct("<Q")
_PARENT_TOKEN = struct.Struct("<Qq")  # (parent hash, one token): a one-token block's bytes
_digest = xxhash.xxh3_64_intdigest


def chained_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``token_ids`` (a partial last block has none).

    The token ids are packed once and each block is one one-shot digest of (parent hash ||
    block): the simulator hashes every block of every turn, so this is its hot path."""
    full = len(token_ids) // block_size
    if full <= 0:
        return []
    out: list[Any] = []
    h: Any = parent_hash  # (Any: compiled, an int variable would re-box each hash)
    if block_size == 1:  # (the simulator's units: one pack and one digest a block)
        pair = _PARENT_TOKEN.pack
        tokens: Sequence[Any] = token_ids
        for t in tokens:
            h = _digest(pair(h, t))
            out.append(h)
        return out
    step = 8 * block_size
    buf = struct.pack(f"<{full * block_size}q", *token_ids[: full * block_size])
    pack = _PARENT.pack
    for off in range(0, full * step, step):
        h = _digest(pack(h) + buf[off : off + step])
        out.append(h)
    return out
