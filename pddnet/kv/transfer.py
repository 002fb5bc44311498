"""Moving KV between pools: export a token range as one contiguous tensor, import it elsewhere.

Export works on *tokens*, not blocks, so that the two sides may use different block sizes and
dtypes (heterogeneous P and D): the exported tensor is ``[layers, 2, n_tokens, Hkv, D]`` in the
source dtype, with metadata naming the token range, layer range and source block size; import
scatters it into the destination's blocks at any token offset, converting the dtype.

For the shared-memory "one-sided write" (same block size and dtype on both sides) the raw helpers
give the byte ranges of a block list inside a pool's data, merged into contiguous runs:
one run per (layer, K/V, run of consecutive block ids). See pool.py for the layout.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pddnet.kv.pool import KVPool, KVSpec, dtype_name, torch_dtype


@dataclass(frozen=True)
class KVExportMeta:
    """What a receiver needs to validate and place an exported KV tensor."""

    dtype: str
    shape: tuple[int, int, int, int, int]  # [layers, 2, n_tokens, num_kv_heads, head_dim]
    token_start: int
    token_end: int
    block_size: int  # of the source pool (informational: import does not need it to match)
    layer_start: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_name(self.dtype))
        object.__setattr__(self, "shape", tuple(int(x) for x in self.shape))
        if len(self.shape) != 5 or self.shape[1] != 2:
            raise ValueError(
                f"KV export shape must be [layers, 2, n, heads, dim], got {self.shape}"
            )
        if any(x < 0 for x in self.shape) or self.shape[0] == 0:
            raise ValueError(f"KV export shape has bad dimensions: {self.shape}")
        if self.token_end - self.token_start != self.shape[2] or self.token_start < 0:
            raise ValueError(
                f"token range [{self.token_start}, {self.token_end}) does not match "
                f"{self.shape[2]} tokens in the shape"
            )
        if self.layer_start < 0 or self.block_size <= 0:
            raise ValueError("layer_start must be >= 0 and block_size > 0")

    @property
    def num_tokens(self) -> int:
        return self.shape[2]

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.shape[0]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=torch_dtype(self.dtype)).element_size()

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "token_start": self.token_start,
            "token_end": self.token_end,
            "block_size": self.block_size,
            "layer_start": self.layer_start,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVExportMeta:
        try:
            return cls(
                dtype=d["dtype"],
                shape=tuple(d["shape"]),
                token_start=int(d["token_start"]),
                token_end=int(d["token_end"]),
                block_size=int(d["block_size"]),
                layer_start=int(d.get("layer_start", 0)),
            )
        except KeyError as e:
            raise ValueError(f"KV export metadata is missing {e.args[0]!r}") from None
        except TypeError as e:
            raise ValueError(f"KV export metadata is malformed: {e}") from None


@dataclass(frozen=True)
class ExportedKV:
    kv: torch.Tensor
    meta: KVExportMeta

    def payload(self) -> memoryview:
        """The tensor's bytes without a copy (for a zero-copy send)."""
        flat = self.kv.contiguous().view(-1)
        return memoryview(flat.view(torch.uint8).numpy()).cast("B")

    @classmethod
    def from_payload(
        cls, meta: KVExportMeta, payload: bytes | bytearray | memoryview
    ) -> ExportedKV:
        """Rebuild from bytes received elsewhere; the length must match the metadata exactly."""
        mv = memoryview(payload).cast("B")
        if mv.nbytes != meta.nbytes:
            raise ValueError(
                f"KV payload has {mv.nbytes} bytes, metadata {meta.shape} "
                f"{meta.dtype} needs {meta.nbytes}"
            )
        if mv.readonly:
            mv = memoryview(bytearray(mv))
        if mv.nbytes == 0:
            kv = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype))
        else:
            kv = torch.frombuffer(mv, dtype=torch_dtype(meta.dtype)).view(meta.shape)
        return cls(kv, meta)


def export_kv(
    pool: KVPool,
    block_table: Sequence[int],
    start: int,
    end: int,
    layer_start: int = 0,
    layer_end: int | None = None,
) -> ExportedKV:
    """KV of tokens ``start..end-1`` (layers ``layer_start..layer_end-1``) of one sequence."""
    spec = pool.spec
    layer_end = spec.num_layers if layer_end is None else layer_end
    if not 0 <= layer_start < layer_end <= spec.num_layers:
        raise ValueError(
            f"bad layer range [{layer_start}, {layer_end}) for {spec.num_layers} layers"
        )
    kv = pool.read_tokens(block_table, start, end, range(layer_start, layer_end))
    meta = KVExportMeta(
        dtype=spec.dtype,
        shape=tuple(kv.shape),
        token_start=start,
        token_end=end,
        block_size=spec.block_size,
        layer_start=layer_start,
    )
    return ExportedKV(kv, meta)


def import_kv(
    pool: KVPool, exported: ExportedKV, block_table: Sequence[int], dest_start: int | None = None
) -> None:
    """Write an export into ``pool`` at tokens ``dest_start..`` (default: the same token range)
    of a sequence with ``block_table`` in that pool, converting dtype and re-blocking."""
    meta, spec = exported.meta, pool.spec
    layers, _, _, heads, dim = meta.shape
    if (heads, dim) != (spec.num_kv_heads, spec.head_dim):
        raise ValueError(
            f"KV export has {heads} kv heads x {dim} dims, pool expects "
            f"{spec.num_kv_heads} x {spec.head_dim}"
        )
    if meta.layer_end > spec.num_layers:
        raise ValueError(
            f"KV export covers layers up to {meta.layer_end}, pool has {spec.num_layers}"
        )
    if tuple(exported.kv.shape) != meta.shape:
        raise ValueError(f"KV tensor shape {tuple(exported.kv.shape)} != metadata {meta.shape}")
    start = meta.token_start if dest_start is None else dest_start
    pool.write_tokens(block_table, start, exported.kv, range(meta.layer_start, meta.layer_end))


# -- raw byte ranges for one-sided writes ------------------------------------------------------


def block_byte_ranges(
    spec: KVSpec, num_blocks: int, block_ids: Sequence[int], layers: Iterable[int] | None = None
) -> list[tuple[int, int]]:
    """(offset, length) byte runs, relative to the pool's data, covering ``block_ids``.

    Order: layer, then K before V, then the blocks in the given order (runs of consecutive ids
    merged). Reading these runs in order from one pool and writing them in the same order to
    another pool with an equal spec and the same number of runs moves those blocks' KV.
    """
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise ValueError(f"block id {b} outside 0..{num_blocks - 1}")
    runs: list[tuple[int, int]] = []  # (first block, count) in the given order
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    per_block = spec.block_bytes_per_layer_kv
    out = []
    for layer in range(spec.num_layers) if layers is None else layers:
        if not 0 <= layer < spec.num_layers:
            raise ValueError(f"layer {layer} outside 0..{spec.num_layers - 1}")
        for kv in (0, 1):
            base = (layer * 2 + kv) * num_blocks * per_block
            out += [(base + first * per_block, count * per_block) for first, count in runs]
    return out


def read_byte_ranges(pool: KVPool, ranges: Sequence[tuple[int, int]]) -> bytes:
    raw = pool.raw_bytes()
    _check_ranges(raw.numel(), ranges)
    return b"".join(raw[o : o + n].numpy().tobytes() for o, n in ranges)


def write_byte_ranges(
    pool: KVPool, ranges: Sequence[tuple[int, int]], data: bytes | bytearray | memoryview
) -> None:
    """Copy ``data`` into the pool's bytes at ``ranges`` (in order): the one-sided write."""
    raw = pool.raw_bytes()
    _check_ranges(raw.numel(), ranges)
    mv = memoryview(data).cast("B")
    total = sum(n for _, n in ranges)
    if mv.nbytes != total:
        raise ValueError(f"{mv.nbytes} bytes given for byte ranges totalling {total}")
    if mv.readonly:
        mv = memoryview(bytearray(mv))
    src = torch.frombuffer(mv, dtype=torch.uint8) if total else torch.empty(0, dtype=torch.uint8)
    pos = 0
    for o, n in ranges:
        raw[o : o + n].copy_(src[pos : pos + n])
        pos += n


def copy_blocks_between(
    src: KVPool,
    src_blocks: Sequence[int],
    dst: KVPool,
    dst_blocks: Sequence[int],
    layers: Iterable[int] | None = None,
) -> int:
    """Block-for-block byte copy between two pools of equal spec; returns bytes copied."""
    if src.spec != dst.spec:
        raise ValueError(f"byte copy needs equal specs: {src.spec} vs {dst.spec}")
    if len(src_blocks) != len(dst_blocks):
        raise ValueError("byte copy needs as many source as destination blocks")
    for pool, blocks in ((src, src_blocks), (dst, dst_blocks)):
        bad = [b for b in blocks if not 0 <= b < pool.num_blocks]
        if bad:
            raise ValueError(f"block ids {bad} outside 0..{pool.num_blocks - 1}")
    layer_list = list(range(src.spec.num_layers) if layers is None else layers)
    src_raw, dst_raw = src.raw_bytes(), dst.raw_bytes()
    per_block = src.spec.block_bytes_per_layer_kv
    total = 0
    for layer in layer_list:
        for kv in (0, 1):
            s_base = (layer * 2 + kv) * src.num_blocks * per_block
            d_base = (layer * 2 + kv) * dst.num_blocks * per_block
            for sb, db in zip(src_blocks, dst_blocks, strict=True):
                so, do = s_base + sb * per_block, d_base + db * per_block
                dst_raw[do : do + per_block].copy_(src_raw[so : so + per_block])
                total += per_block
    return total


def _check_ranges(size: int, ranges: Sequence[tuple[int, int]]) -> None:
    for o, n in ranges:
        if o < 0 or n < 0 or o + n > size:
            raise ValueError(f"byte range ({o}, {n}) outside the pool's {size} bytes")
