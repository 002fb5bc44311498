"""The `shm` backend: one-sided writes into a receiver's KV pool in POSIX shared memory.

The emulated RDMA write of one machine: the receiver's pool already lives in a named segment
(RLD creates it with the engine; the segments themselves are pddnet/kv/shm.py's), its name is
the descriptor (KV_ALLOC_RESPONSE.region), and the sender maps it (``RemoteKVRegion``: the
emulated RDMA-registered region) and writes the KV straight into the request's blocks -- no KV
byte crosses the receiver's socket -- then posts KV_DONE as the completion. Like an RDMA memory
key scoped to one request, every write is checked against that request's own blocks first, so a
buggy or hostile writer cannot touch another request's blocks or the receiver's shared prefix
blocks. Dtype and block-size conversion is pddnet.kv.transfer.import_kv's job. The copy runs in
the writer's own thread so the sender's event loop keeps answering while large prefills land.
"""

from __future__ import annotations

from collections.abc import Sequence

from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.shm import SharedMemoryError
from pddnet.kv.transfer import ExportedKV, import_kv
from pddnet.transport.kv_backend import (
    BadRegion,
    KVSink,
    KVTransfer,
    PeerUnreachable,
    RegionLayout,
    TrackingBackend,
    TransferAborted,
    WriteRefused,
    check_descriptor_for,
)

from .call_thread import ThreadedWriter

NAME = "shm"


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
        size. Returns the bytes written into the region.

        Checked first, a refused write changes nothing: a precise ValueError unless the positions
        [token_start, token_start + n) fit `dest_block_table`, lie at or after `min_position`
        (the receiver's prefix hit: those blocks may be shared) and land only in blocks listed in
        `allowed_block_ids`."""
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
            return 0
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


class ShmSink(KVSink):
    backend = NAME
    one_sided = True

    def __init__(self, pool: KVPool) -> None:
        if not pool.is_shared or not pool.shm_name:
            raise BadRegion(
                "the shm backend needs a KV pool in shared memory (create the "
                "engine with kv_shm_name=...)",
                backend=NAME,
            )
        super().__init__(pool)
        self._name = pool.shm_name

    @property
    def descriptor(self) -> str:
        return self._name

    async def close(self) -> None:
        # Nothing is registered beyond the segment itself, which its creator unlinks.
        self.closed = True


class ShmWriter(ThreadedWriter):
    backend = NAME

    def __init__(self, region: RemoteKVRegion, deadline_s: float, abort_grace_s: float) -> None:
        super().__init__(region.name, deadline_s, abort_grace_s)
        self.region = region
        self.layout = RegionLayout(region.spec, region.num_blocks)

    def _copy(self, transfer: KVTransfer, exported: ExportedKV) -> int:
        if self.region.closed or transfer.aborted is not None:
            raise TransferAborted(
                f"write to {self.peer} aborted before it started", backend=NAME, peer=self.peer
            )
        t = transfer.target
        try:
            return self.region.write(
                t.own_blocks,
                t.block_table,
                exported,
                exported.meta.token_start,
                min_position=t.writable_from,
            )
        except ValueError as exc:
            raise WriteRefused(str(exc), backend=NAME, peer=self.peer) from None

    async def _write(self, transfer: KVTransfer, exported: ExportedKV, deadline_s: float) -> int:
        if transfer.target.block_size != self.layout.spec.block_size:
            raise self._error(
                BadRegion,
                f"the request's block size {transfer.target.block_size}"
                f" differs from region {self.peer}'s "
                f"{self.layout.spec.block_size}",
            )
        return await self._in_thread(self._copy, transfer, exported, deadline_s)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # The detach runs after any queued copy, so no copy touches an unmapped region.
        self._thread.submit(self.region.close)
        self._thread.stop()


class ShmBackend(TrackingBackend):
    name = NAME
    sink_class = ShmSink

    async def open(self, descriptor: str) -> ShmWriter:
        check_descriptor_for(NAME, descriptor)
        try:
            region = RemoteKVRegion.attach(descriptor)
        except SharedMemoryError as exc:
            # The segment lives as long as the receiver's pool: gone means the receiver is.
            raise PeerUnreachable(
                f"cannot map shared KV region {descriptor!r}: {exc}", backend=NAME, peer=descriptor
            ) from None
        except ValueError as exc:
            raise BadRegion(str(exc), backend=NAME, peer=descriptor) from None
        return self.track(ShmWriter(region, self.deadline_s, self.abort_grace_s))
