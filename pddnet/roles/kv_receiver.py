"""Base of RLD and MD: a daemon whose KV pool receives P's KV over one path.

It owns that path's backend (created before the engine, so a backend that cannot run here
fails the start, not the first request), the pool's registration as the path's sink (its
descriptor goes into KV_ALLOC_RESPONSE), the reservation of blocks for a request's KV (or the
refusal P is answered with), and the fencing of dropped requests whose one-sided
writes may still land: such a reservation is kept until P's KV_ABORT / KV_DONE says its writes
have ended, or until they must have (deadline + abort grace).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Container

from pddnet.config import ClusterConfig
from pddnet.engine.engine import KVReservation
from pddnet.kv.allocator import OutOfBlocks
from pddnet.protocol import KvAllocRequest, KvAllocResponse
from pddnet.transport.kv_backend import KVSink
from pddnet.transport.kv_paths import KVPaths

from .common import Daemon
from .outbox import Outbox


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
        self.kv_paths = await KVPaths.create(self.config, self.section, self.role, (self.kv_path,))
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

    # -- reservations: the pool's blocks for one request's KV ----------------------------------

    def refuse_alloc(self, p: Outbox, rid: str, error: str) -> None:
        engine = self.engine
        assert engine is not None
        self.counters["refused"] += 1
        p.post(
            KvAllocResponse(
                request_id=rid,
                accepted=False,
                hit_tokens=0,
                block_ids=(),
                block_size=engine.block_size,
                dtype=engine.spec.dtype,
                error=error[:4096],
            )
        )

    async def reserve_for(
        self,
        p: Outbox,
        msg: KvAllocRequest,
        known: Container[str],
        on_refuse: Callable[[], None] | None = None,
        on_short: Callable[[], None] | None = None,
    ) -> KVReservation | None:
        """On KV_ALLOC_REQUEST: check the id and the model shape, reserve blocks (reusing the
        prefix cache), and recheck for a cancel that came meanwhile. Returns the reservation, or
        None after sending P the refusal (`on_refuse` runs first). With `on_short`, a pool that
        is only short *now* (the request fits in it once others free their blocks) calls
        `on_short()` instead of refusing: the caller keeps the request waiting."""
        rid, engine = msg.request_id, self.engine
        assert engine is not None
        spec = engine.spec

        def refuse(error: str) -> None:
            if on_refuse is not None:
                on_refuse()
            self.refuse_alloc(p, rid, error)

        if rid in known or rid in self.ended:
            refuse(f"request id {rid!r} is already known here (duplicate or cancelled)")
            return None
        shape = (msg.num_layers, msg.num_kv_heads, msg.head_dim)
        if shape != (spec.num_layers, spec.num_kv_heads, spec.head_dim):
            refuse(
                f"model shape {shape} (layers, kv heads, head dim) does not match this "
                f"{self.role}'s {(spec.num_layers, spec.num_kv_heads, spec.head_dim)}"
            )
            return None
        try:
            res = await self.compute(self.reserve_in_engine, msg.prompt_token_ids, msg.max_tokens)
        except OutOfBlocks as exc:
            if on_short is not None and exc.requested <= exc.total and rid not in self.ended:
                on_short()
            else:
                refuse(f"cannot reserve KV: {exc}")
            return None
        except ValueError as exc:
            refuse(f"cannot reserve KV: {exc}")
            return None
        if rid in self.ended:  # cancelled while the reservation was being made
            await self.compute(engine.free_reservation, res)
            refuse("request was cancelled")
            return None
        return res

    def reserve_in_engine(self, token_ids: tuple[int, ...], max_tokens: int) -> KVReservation:
        """In the engine thread: the reservation (MD also drains its cache events here, in the
        same call, so that the notice it sends with its answer is current)."""
        return self.engine.reserve_kv(token_ids, max_tokens)

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
