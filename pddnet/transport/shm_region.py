"""P's mapping of RLD's shared-memory KV pool: the emulated RDMA-registered region.

RLD allocates a request's destination blocks and tells P their ids (KV_ALLOC_RESPONSE.block_ids)
and the pool's name (`region`); P writes its KV straight into those blocks — a one-sided write,
no KV byte crosses RLD's socket — then posts KV_DONE as the completion. Like an RDMA memory key
scoped to one request, every write is checked against that request's own blocks first, so a
buggy or hostile writer cannot touch another request's blocks or RLD's shared prefix blocks.

Dtype and block-size conversion is pddnet.kv.transfer.import_kv's job (reused, not repeated).
"""

from __future__ import annotations

from collections.abc import Sequence

from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.transfer import ExportedKV, import_kv


class RemoteKVRegion:
    """A peer's shared KV pool mapped for one-sided writes. Attach by name; close() detaches
    (the owner, RLD, unlinks the segment)."""

    def __init__(self, pool: KVPool) -> None:
        self._pool: KVPool | None = pool
        self.name = pool.shm_name or ""
        self.bytes_written = 0

    @classmethod
    def attach(cls, name: str) -> RemoteKVRegion:
        """Map the shared pool `name` (as in KV_ALLOC_RESPONSE.region); raises SharedMemoryError
        when there is no such pool."""
        if not name:
            raise ValueError("the peer sent no shared-memory region name (empty 'region')")
        return cls(KVPool.attach(name))

    @property
    def pool(self) -> KVPool:
        if self._pool is None:
            raise RuntimeError(f"shared KV region {self.name!r} is closed")
        return self._pool

    @property
    def spec(self) -> KVSpec:
        return self.pool.spec

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def closed(self) -> bool:
        return self._pool is None

    def check_write(
        self,
        allowed_block_ids: Sequence[int],
        dest_block_table: Sequence[int],
        exported: ExportedKV,
        token_start: int,
        *,
        min_position: int = 0,
    ) -> None:
        """Raise a precise ValueError unless positions [token_start, token_start + n) of the
        export fit `dest_block_table`, lie at or after `min_position` (the receiver's prefix
        hit: those blocks may be shared) and land only in blocks listed in `allowed_block_ids`."""
        spec = self.pool.spec
        n = exported.meta.num_tokens
        end = token_start + n
        if token_start < 0:
            raise ValueError(f"one-sided write starts at negative position {token_start}")
        if token_start < min_position:
            raise ValueError(
                f"one-sided write of positions [{token_start}, {end}) reaches below "
                f"position {min_position}: the receiver's cached prefix is not "
                "writable"
            )
        capacity = len(dest_block_table) * spec.block_size
        if end > capacity:
            raise ValueError(
                f"one-sided write of positions [{token_start}, {end}) does not fit "
                f"the destination block table: {len(dest_block_table)} blocks of "
                f"{spec.block_size} hold positions [0, {capacity})"
            )
        if n == 0:
            return
        touched = list(
            dest_block_table[token_start // spec.block_size : (end - 1) // spec.block_size + 1]
        )
        allowed = set(allowed_block_ids)
        foreign = sorted({b for b in touched if b not in allowed})
        if foreign:
            raise ValueError(
                f"one-sided write of positions [{token_start}, {end}) would touch "
                f"block(s) {foreign} that are not this request's (allowed: "
                f"{sorted(allowed)[:16]}{'...' if len(allowed) > 16 else ''})"
            )
        outside = sorted({b for b in touched if not 0 <= b < self.pool.num_blocks})
        if outside:
            raise ValueError(
                f"one-sided write would touch block(s) {outside} outside the "
                f"region's {self.pool.num_blocks} blocks"
            )

    def write(
        self,
        allowed_block_ids: Sequence[int],
        dest_block_table: Sequence[int],
        exported: ExportedKV,
        token_start: int,
        *,
        min_position: int = 0,
    ) -> int:
        """Write `exported` into the region at positions token_start.. of a sequence whose block
        table (at the region's block size) is `dest_block_table`, converting dtype and block
        size. Checked first (see check_write): a refused write changes nothing. Returns the
        bytes written into the region."""
        self.check_write(
            allowed_block_ids, dest_block_table, exported, token_start, min_position=min_position
        )
        pool = self.pool
        import_kv(pool, exported, dest_block_table, dest_start=token_start)
        layers, _, n, heads, dim = exported.meta.shape
        written = layers * 2 * n * heads * dim * pool.spec.itemsize
        self.bytes_written += written
        return written

    def close(self) -> None:
        """Detach (idempotent). Never unlinks: the segment belongs to its creator."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> RemoteKVRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteKVRegion({self.name!r}{', closed' if self.closed else ''})"
