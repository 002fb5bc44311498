"""Moving KV between pools: export a token range as one contiguous tensor, import it elsewhere.

Export works on *tokens*, not blocks, so that the two sides may use different block sizes and
dtypes (heterogeneous P and D): the exported tensor is ``[layers, 2, n_tokens, Hkv, D]`` in the
source dtype, with metadata naming the token range, layer range and source block size; import
scatters it into the destination's blocks at any token offset, converting the dtype.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from pddnet.kv.pool import KVPool, dtype_name, torch_dtype


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
