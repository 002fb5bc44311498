"""The paged KV pool: one tensor holding every layer's keys and values in fixed-size blocks.

Layout of ``KVPool.data`` (C-contiguous)::

    data[layer, kv, block, offset, kv_head, dim]      kv: 0 = K, 1 = V
    shape [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]

A token's *slot* is ``block * block_size + offset``; a sequence's block table maps its token
index ``i`` to slot ``table[i // block_size] * block_size + i % block_size``.

Because ``block`` is the third axis, the bytes of one block for one (layer, K-or-V) pair are one
contiguous run of ``block_size * num_kv_heads * head_dim * itemsize`` bytes, and consecutive block
ids are adjacent: a block range is a handful of memcpy's.

A pool may live in POSIX shared memory (``shm_name=...``): the segment starts with a 4 KiB header
(magic + JSON of the spec and block count) so that ``KVPool.attach(name)`` needs nothing but the
name, and the tensor data starts at ``DATA_OFFSET`` (page aligned).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import torch

from pddnet.kv.shm import SharedMemoryError, SharedSegment

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.model.config import ModelConfig

_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_MAGIC = b"PDDKVPL1"
DATA_OFFSET = 4096
_HEADER = struct.Struct("<8sI")


def dtype_name(dtype: torch.dtype | str) -> str:
    """Canonical name ("float32", ...) of a KV dtype given as torch dtype or name."""
    if isinstance(dtype, str):
        name = dtype.removeprefix("torch.")
        if name not in _DTYPES:
            raise ValueError(f"unsupported KV dtype {dtype!r}; choose one of {sorted(_DTYPES)}")
        return name
    for name, dt in _DTYPES.items():
        if dt == dtype:
            return name
    raise ValueError(f"unsupported KV dtype {dtype!r}; choose one of {sorted(_DTYPES)}")


def torch_dtype(name: str | torch.dtype) -> torch.dtype:
    return _DTYPES[dtype_name(name)]


@dataclass(frozen=True)
class KVSpec:
    """Shape of one pool's KV: what a peer must know to read or write its blocks."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # canonical name, see dtype_name()

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVSpec.{field} must be a positive int, got {value!r}")
        object.__setattr__(self, "dtype", dtype_name(self.dtype))

    @classmethod
    def from_model_config(
        cls, config: ModelConfig, block_size: int = 16, dtype: str | torch.dtype | None = None
    ) -> KVSpec:
        return cls(
            num_layers=config.num_layers,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            dtype=dtype_name(dtype if dtype is not None else config.dtype),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def token_bytes_per_layer_kv(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def bytes_per_token(self) -> int:
        """All layers, K and V, of one token (the ``kv_bytes_per_token`` of the model)."""
        return self.num_layers * 2 * self.token_bytes_per_layer_kv

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.bytes_per_token

    def shape(self, num_blocks: int) -> tuple[int, int, int, int, int, int]:
        return (self.num_layers, 2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def num_blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size) if num_tokens > 0 else 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVSpec:
        try:
            return cls(
                **{
                    k: d[k]
                    for k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")
                }
            )
        except KeyError as e:
            raise ValueError(f"KV spec is missing field {e.args[0]!r}") from None


class KVPool:
    """Paged KV storage for ``num_blocks`` blocks; in-process or in a named shared segment."""

    def __init__(self, spec: KVSpec, num_blocks: int, shm_name: str | None = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.spec = spec
        self.num_blocks = num_blocks
        self._segment: SharedSegment | None = None
        nbytes = math.prod(spec.shape(num_blocks)) * spec.itemsize
        if shm_name is None:
            self.data: torch.Tensor = torch.zeros(spec.shape(num_blocks), dtype=spec.torch_dtype)
        else:
            segment = SharedSegment.create(shm_name, DATA_OFFSET + nbytes)
            try:
                _write_header(segment, spec, num_blocks)
                self.data = _map_tensor(segment, spec, num_blocks)
            except BaseException:
                segment.close()
                raise
            self._segment = segment
        self.nbytes = nbytes

    @classmethod
    def attach(cls, name: str) -> KVPool:
        """Map an existing shared pool by name (spec and block count come from its header)."""
        segment = SharedSegment.attach(name)
        try:
            spec, num_blocks = _read_header(segment)
            pool = cls.__new__(cls)
            pool.spec = spec
            pool.num_blocks = num_blocks
            pool.nbytes = math.prod(spec.shape(num_blocks)) * spec.itemsize
            if DATA_OFFSET + pool.nbytes > segment.size:
                raise SharedMemoryError(
                    f"segment {segment.name!r} holds {segment.size} bytes, header promises "
                    f"{DATA_OFFSET + pool.nbytes}"
                )
            pool.data = _map_tensor(segment, spec, num_blocks)
            pool._segment = segment
            return pool
        except BaseException:
            segment.close()
            raise

    # -- identity -----------------------------------------------------------------------------

    @property
    def shm_name(self) -> str | None:
        return self._segment.name if self._segment is not None else None

    @property
    def is_shared(self) -> bool:
        return self._segment is not None

    @property
    def owner(self) -> bool:
        return self._segment is None or self._segment.owner

    @property
    def closed(self) -> bool:
        return getattr(self, "data", None) is None

    def close(self) -> None:
        """Release this pool's storage; the creator of a shared pool unlinks its segment."""
        self.data = None  # type: ignore[assignment]
        if self._segment is not None:
            self._segment.close()

    def __enter__(self) -> KVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        where = f"shm={self.shm_name!r}" if self.is_shared else "local"
        return f"KVPool({self.spec}, num_blocks={self.num_blocks}, {where})"

    def _tensor(self) -> torch.Tensor:
        if self.data is None:
            raise RuntimeError("KV pool is closed")
        return self.data

    # -- addressing ---------------------------------------------------------------------------

    def slot_mapping(self, block_table: Sequence[int], start: int, end: int) -> torch.Tensor:
        """Slots of token indices ``start..end-1`` of a sequence with this block table."""
        if start < 0 or end < start:
            raise ValueError(f"bad token range [{start}, {end})")
        bs = self.spec.block_size
        needed = self.spec.num_blocks_for(end)
        if needed > len(block_table):
            raise ValueError(
                f"token range [{start}, {end}) needs {needed} blocks, "
                f"block table has {len(block_table)}"
            )
        # Only the blocks the range touches: a decode step at 64K context maps one slot, and
        # converting the whole table every step cost more than the step's attention.
        first = start // bs
        ids = list(block_table[first:needed])
        table = torch.as_tensor(ids, dtype=torch.long)
        if ids and (min(ids) < 0 or max(ids) >= self.num_blocks):
            raise ValueError(
                f"block table {list(block_table[:needed])} has ids outside 0..{self.num_blocks - 1}"
            )
        pos = torch.arange(start, end, dtype=torch.long)
        return table[pos // bs - first] * bs + pos % bs

    def _flat(self, layer: int, kv: int) -> torch.Tensor:
        data = self._tensor()
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.spec.num_layers - 1}")
        s = self.spec
        return data[layer, kv].view(self.num_blocks * s.block_size, s.num_kv_heads, s.head_dim)

    # -- per-layer access (the model runner's hot path) ----------------------------------------

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store rows ``k[i], v[i]`` ([T, Hkv, D]) of ``layer`` at ``slots[i]``."""
        s = self.spec
        expect = (slots.numel(), s.num_kv_heads, s.head_dim)
        if tuple(k.shape) != expect or tuple(v.shape) != expect:
            raise ValueError(
                f"k/v shapes {tuple(k.shape)}/{tuple(v.shape)} do not match "
                f"{expect} (slots, num_kv_heads, head_dim)"
            )
        self._flat(layer, 0).index_copy_(0, slots, k.to(s.torch_dtype))
        self._flat(layer, 1).index_copy_(0, slots, v.to(s.torch_dtype))

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views (no copy) of ``layer``'s K and V blocks, ``[num_blocks, block_size, Hkv, D]``
        each, for attention that reads the pool in place (pddnet/model/paged_attention.py)."""
        data = self._tensor()
        if not 0 <= layer < self.spec.num_layers:
            raise IndexError(f"layer {layer} out of range 0..{self.spec.num_layers - 1}")
        return data[layer, 0], data[layer, 1]

    def gather(
        self,
        layer: int,
        block_table: Sequence[int],
        num_tokens: int,
        dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[num_tokens, Hkv, D]`` of tokens ``0..num_tokens-1`` of a sequence."""
        slots = self.slot_mapping(block_table, 0, num_tokens)
        k = self._flat(layer, 0).index_select(0, slots)
        v = self._flat(layer, 1).index_select(0, slots)
        if dtype is not None and dtype != k.dtype:
            k, v = k.to(dtype), v.to(dtype)
        return k, v

    # -- whole-token access (export/import) ------------------------------------------------------

    def read_tokens(
        self, block_table: Sequence[int], start: int, end: int, layers: Iterable[int] | None = None
    ) -> torch.Tensor:
        """KV of tokens ``start..end-1`` as one contiguous ``[layers, 2, n, Hkv, D]`` tensor."""
        slots = self.slot_mapping(block_table, start, end)
        s = self.spec
        data = self._tensor()
        layer_ids = list(range(s.num_layers) if layers is None else layers)
        flat = data.view(
            s.num_layers, 2, self.num_blocks * s.block_size, s.num_kv_heads, s.head_dim
        )
        # One advanced-indexing gather: [layers, 1, 1] x [1, 2, 1] x [1, 1, n] -> [layers, 2, n].
        li = torch.as_tensor(layer_ids, dtype=torch.long).view(-1, 1, 1)
        kv = torch.arange(2).view(1, 2, 1)
        return flat[li, kv, slots.view(1, 1, -1)]

    def write_tokens(
        self,
        block_table: Sequence[int],
        start: int,
        kv: torch.Tensor,
        layers: Iterable[int] | None = None,
    ) -> None:
        """Store ``kv`` ([layers, 2, n, Hkv, D], any float dtype) at tokens ``start..start+n-1``."""
        s = self.spec
        layer_ids = list(range(s.num_layers) if layers is None else layers)
        expect = (
            len(layer_ids),
            2,
            kv.shape[2] if kv.dim() == 5 else -1,
            s.num_kv_heads,
            s.head_dim,
        )
        if kv.dim() != 5 or tuple(kv.shape) != expect:
            raise ValueError(
                f"KV tensor shape {tuple(kv.shape)} does not fit this pool: "
                f"expected [{len(layer_ids)}, 2, n, {s.num_kv_heads}, {s.head_dim}]"
            )
        slots = self.slot_mapping(block_table, start, start + kv.shape[2])
        src = kv.to(s.torch_dtype)
        for i, layer in enumerate(layer_ids):
            self._flat(layer, 0).index_copy_(0, slots, src[i, 0])
            self._flat(layer, 1).index_copy_(0, slots, src[i, 1])

    # -- raw bytes (the one-sided write path) ----------------------------------------------------

    def raw_bytes(self) -> torch.Tensor:
        """The pool's data as a flat uint8 tensor sharing its memory."""
        return self._tensor().view(-1).view(torch.uint8)


def _write_header(segment: SharedSegment, spec: KVSpec, num_blocks: int) -> None:
    meta = json.dumps({"spec": spec.to_dict(), "num_blocks": num_blocks}).encode()
    if _HEADER.size + len(meta) > DATA_OFFSET:
        raise SharedMemoryError("KV pool header does not fit its 4 KiB page")
    buf = segment.buffer
    buf[: _HEADER.size] = _HEADER.pack(_MAGIC, len(meta))
    buf[_HEADER.size : _HEADER.size + len(meta)] = meta


def _read_header(segment: SharedSegment) -> tuple[KVSpec, int]:
    buf = segment.buffer
    if segment.size < DATA_OFFSET:
        raise SharedMemoryError(f"segment {segment.name!r} is too small to be a KV pool")
    magic, length = _HEADER.unpack(bytes(buf[: _HEADER.size]))
    if magic != _MAGIC:
        raise SharedMemoryError(f"segment {segment.name!r} is not a pddnet KV pool (bad magic)")
    if length > DATA_OFFSET - _HEADER.size:
        raise SharedMemoryError(f"segment {segment.name!r} has a corrupt KV pool header")
    try:
        meta = json.loads(bytes(buf[_HEADER.size : _HEADER.size + length]))
        spec = KVSpec.from_dict(meta["spec"])
        num_blocks = int(meta["num_blocks"])
    except (ValueError, KeyError, TypeError) as e:
        raise SharedMemoryError(
            f"segment {segment.name!r} has a corrupt KV pool header: {e}"
        ) from e
    if num_blocks <= 0:
        raise SharedMemoryError(f"segment {segment.name!r} declares {num_blocks} blocks")
    return spec, num_blocks


def _map_tensor(segment: SharedSegment, spec: KVSpec, num_blocks: int) -> torch.Tensor:
    count = math.prod(spec.shape(num_blocks))
    flat = torch.frombuffer(segment.buffer, dtype=spec.torch_dtype, count=count, offset=DATA_OFFSET)
    return flat.view(spec.shape(num_blocks))
