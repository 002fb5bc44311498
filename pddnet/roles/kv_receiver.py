"""Base of RLD and MD: a daemon whose KV pool receives P's KV over one path.

It owns that path's backend (created before the engine, so a backend that cannot run here
fails the start, not the first request), the pool's registration as the path's sink (its
descriptor goes into KV_ALLOC_RESPONSE), and the fencing of dropped requests whose one-sided
writes may still land: such a reservation is kept until P's KV_ABORT / KV_DONE says its writes
have ended, or until they must have (deadline + abort grace).
"""

from __future__ import annotations

import asyncio

from pddnet.config import ClusterConfig
from pddnet.engine.engine import KVReservation
from pddnet.transport.kv_backend import KVSink
from pddnet.transport.kv_paths import KVPaths

from .common import Daemon


class KvReceiver(Daemon):
    """Subclasses set ``kv_path`` ("intra_dc" for RLD, "wan" for MD) and call
    ``register_sink()`` from ``dial_peers()``."""

    kv_path: str = ""

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        self.kv_paths: KVPaths | None = None
        self.sink: KVSink | None = None
        self._sink_ready = asyncio.Event()  # P may ask for blocks while the pool registers
        # Reservations of dropped requests whose one-sided writes may still land (`fence`)
        self.fenced: dict[str, KVReservation] = {}

    async def start(self) -> None:
        self.kv_paths = await KVPaths.create(
            self.config, self.section, self.section_name, (self.kv_path,)
        )
        try:
            await super().start()
        except BaseException:
            await self.kv_paths.close()
            raise

    async def register_sink(self) -> None:
        assert self.kv_paths is not None and self.engine is not None
        self.sink = await self.kv_paths.backend(self.kv_path).register(self.engine.pool)
        self._sink_ready.set()

    async def close_extra(self) -> None:
        # Deregister the pool before the engine frees it, then the backend.
        self._sink_ready.set()
        if self.sink is not None:
            await self.sink.close()
        if self.kv_paths is not None:
            await self.kv_paths.close()

    @property
    def one_sided(self) -> bool:
        return self.sink is not None and self.sink.one_sided

    def writes_may_land(self, writes_stopped: bool) -> bool:
        """Whether P may still be writing into a dropped request's reservation: one-sided writes
        that have not ended (no KV_DONE / KV_ABORT yet). shm writes are local copies bounded by
        P's engine thread; Mooncake's cross the network and may land late."""
        sink = self.sink
        return not writes_stopped and sink is not None and sink.one_sided and sink.backend != "shm"

    def fence(self, rid: str, res: KVReservation) -> None:
        """Keep a dropped request's blocks out of reuse until P confirms its writes have ended
        (KV_ABORT / KV_DONE), or until they must have (deadline + abort grace)."""
        self.fenced[rid] = res
        self.counters["fenced"] += 1
        t = self.config.transport
        bound = t.deadline_s + (
            t.abort_grace_s if t.abort_grace_s is not None else 2 * t.progress_timeout_s + 1
        )
        self.spawn(self._unfence_later(rid, res, bound), f"fence {rid}")

    async def _unfence_later(self, rid: str, res: KVReservation, after_s: float) -> None:
        await asyncio.sleep(after_s)  # P never confirmed (lost): its writes have ended by now
        if self.fenced.get(rid) is res:
            self.counters["fence_expired"] += 1
            self.unfence(rid)

    def unfence(self, rid: str) -> bool:
        """Free a fenced reservation (P's KV_ABORT / KV_DONE came). False if none is fenced."""
        res = self.fenced.pop(rid, None)
        if res is None:
            return False
        engine = self.engine
        assert engine is not None

        async def free() -> None:
            await self.compute(engine.free_reservation, res)
            self.blocks_freed()

        self.spawn(free(), f"unfence {rid}")
        return True

    def blocks_freed(self) -> None:
        """Hook: blocks of the pool went back (MD then serves allocations waiting for room)."""
