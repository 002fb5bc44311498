"""The `shm` backend: one-sided writes into a receiver's KV pool in POSIX shared memory.

The emulated RDMA write of one machine: the receiver's pool already lives in a named segment
(RLD creates it with the engine), its name is the descriptor, and the sender maps it and writes
the KV straight into the request's blocks (pddnet.transport.shm_region does the checked write,
dtype and block-size conversion included). The copy runs in the writer's own thread so the
sender's event loop keeps answering while large prefills land.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pddnet.kv.shm import SharedMemoryError
from pddnet.transport.kv_backend import (
    BadRegion,
    KVSink,
    KVTransfer,
    KVWriter,
    PeerUnreachable,
    RegionLayout,
    TrackingBackend,
    TransferAborted,
    TransferTimeout,
    WriteRefused,
    check_descriptor_for,
)
from pddnet.transport.shm_region import RemoteKVRegion

from .call_thread import CallThread, CallTimedOut

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.kv.pool import KVPool
    from pddnet.kv.transfer import ExportedKV

NAME = "shm"


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


class ShmWriter(KVWriter):
    backend = NAME

    def __init__(self, region: RemoteKVRegion, deadline_s: float, abort_grace_s: float) -> None:
        super().__init__(region.name, deadline_s, abort_grace_s)
        self.region = region
        self.layout = RegionLayout(region.spec, region.num_blocks)
        self._thread = CallThread(f"shm-writer-{region.name}")

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
        try:
            return await self._thread.call(
                self._copy,
                transfer,
                exported,
                timeout=deadline_s,
                what=f"shm write of {transfer.request_id}",
            )
        except CallTimedOut as exc:
            transfer.lingering.append(exc.future)
            raise self._error(TransferTimeout, str(exc)) from None

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
