"""MD: the main decode pool in datacenter B, reached only over the WAN (it never dials).

KV_ALLOC_REQUEST -> reserve_kv at MD's own block size (P's may differ; import_kv re-blocks and
converts the dtype); KV_CHUNK frames are imported into the reservation as they arrive, in any
order over the stripes; when KV_DONE and every chunk are in, the copy is complete. With a relay
(pipeline p_rld_md) MD then sends TAKEOVER, stays held until RLD's final HANDOFF, extends the
handed-over token ids (at most `chunk` per step when streaming) and decodes from the cut on;
without one (p_md, the cross-dc baseline) it decodes and emits from index 0. The per-request
decisions are each request's pddnet.lifecycle.decode_request.DecodeRequest's (driving
pddnet.lifecycle.handoff.MainHandoff).

The decode-side RadixCache (DRC, main_decode.prefix_cache = "radix"): reserve_kv matches and pins
the prompt's cached prefix, so P sends only positions past MD's hit; every computed full block
(prompt and generated tokens) is inserted as the engine steps, so a conversation's next turn hits
it. What the tree inserted and evicted goes to P as CACHE_EVENTS, drained in the engine thread
within the calls MD makes anyway (reserve, import) and sent just before MD's next KV_ALLOC_RESPONSE
or KV_RECEIVED -- a new P connection first gets a snapshot (reset=True).

The KV path P -> MD is `[transport] wan`: `tcp` (the KV_CHUNK import above; KV_DONE counts
chunks and bytes) or `mooncake` (MD's pool is registered with the Transfer Engine and P writes
straight into the reserved blocks; the copy is complete on KV_DONE, which P sends after the
engine acknowledged every write). A mooncake write may still be in flight when MD drops a
request before its KV_DONE: the reservation is fenced (kept) until P's KV_ABORT says the writes
stopped, or a bound passes (see RelayDaemon).
"""

from __future__ import annotations

import time
from typing import Any

from pddnet.config import ClusterConfig
from pddnet.engine.engine import KVReservation, StepOutput
from pddnet.lifecycle.actions import ImportChunk
from pddnet.lifecycle.decode_request import DecodeRequest, Phase, Role
from pddnet.protocol import Handoff, KvAllocRequest, KvChunk, Message, encode_bytes
from pddnet.transport import Connection
from pddnet.transport.backends.tcp import TcpSink
from pddnet.transport.kv_backend import TransferError, WriteTarget

from .cache_notices import CacheNotices
from .decode_slot import Slot
from .decode_tier import DecodeTier
from .outbox import Outbox
from .waiting_allocs import WaitingAllocs


class MainDecodeDaemon(DecodeTier):
    role = "main_decode"
    kv_path = "wan"

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        self.chunk_tokens = config.policy.handoff_chunk
        self.rld: Outbox | None = None
        # Most tokens one step computed for a request after its first HANDOFF, by handoff mode:
        # the one-shot stall vs streaming's `chunk` cap, as measured.
        self.max_extend_tokens: dict[str, int] = {}
        self.handoffs_by_mode: dict[str, int] = {}
        self.notices = CacheNotices(lambda: self.engine)
        self.waiting = WaitingAllocs(
            lambda p, msg, on_short: self.reserve_for(p, msg, self.requests, on_short=on_short),
            self._accept,
            self.spawn,
            self.timeline,
            self.counters,
            report_every_s=config.router.stall_timeout_s / 3,
        )

    async def dial_peers(self) -> None:
        await self.register_sink()

    @property
    def decode_peer(self) -> Outbox | None:
        return self.rld

    async def _on_connection(self, conn: Connection) -> None:
        if conn.lane == "control" and conn.peer_role == "relay":
            self.rld = self.outbox(conn, "relay control")
        elif conn.lane == "control" and conn.peer_role == "prefill":
            box = self._p_boxes[conn] = self.outbox(conn, "prefill control")
            if self.notices.radix is not None:  # P's view starts from what the tree holds now
                box.post(await self.compute(self.notices.snapshot))
        await super()._on_connection(conn)

    # -- the decode-side cache's notices to P (CacheNotices) -------------------------------------

    def before_p_answer(self) -> None:
        self.notices.post(self._p_boxes.values())

    async def request_stopped(self) -> None:
        if self.notices.radix is not None:
            # What this request left in the tree (its prompt and reply blocks) is what the
            # conversation's next turn will hit: tell P now, not with MD's next answer.
            await self.compute(self.notices.drain)
            self.notices.post(self._p_boxes.values())

    def after_step_in_engine(self, outputs: list[StepOutput]) -> None:
        if any(out.finished for out in outputs):
            self.notices.drain()  # what the ending requests left in the tree (see on_step)

    def reserve_in_engine(self, token_ids: tuple[int, ...], max_tokens: int) -> KVReservation:
        res = super().reserve_in_engine(token_ids, max_tokens)
        self.notices.drain()
        return res

    # -- messages ------------------------------------------------------------------------------

    async def handle_own(self, conn: Connection, msg: Message) -> bool:
        if isinstance(msg, KvChunk):
            await self._chunk(msg)
        elif isinstance(msg, Handoff):
            nbytes = len(encode_bytes(msg))
            self.event(
                msg.request_id,
                lambda m: m.handoff(msg.start_index, msg.token_ids, msg.final, msg.mode, nbytes),
            )
        else:
            return False
        return True

    async def _alloc(self, p: Outbox, msg: KvAllocRequest) -> None:
        assert self.engine is not None
        await self._sink_ready.wait()  # P may ask while the pool is being registered
        assert self.sink is not None
        if self.waiting:  # strict FIFO: no overtaking a request already waiting
            self.waiting.wait(p, msg)
            return
        res = await self.reserve_for(
            p, msg, self.requests, on_short=lambda: self.waiting.wait(p, msg)
        )
        if res is not None:
            self._accept(p, msg, res)

    def _accept(self, p: Outbox, msg: KvAllocRequest, res: KVReservation) -> None:
        machine = DecodeRequest(
            Role.MAIN,
            msg,
            hit_tokens=res.num_cached_tokens,
            eos_token_id=self.engine.eos_token_id,
            one_sided=self.one_sided,
            chunk_tokens=self.chunk_tokens,
        )
        self.before_p_answer()
        self.accept(p, msg, res, machine)

    def drop_unallocated(self, rid: str, reason: str) -> bool:
        if self.waiting.drop(rid):  # it never got blocks: nothing else to free
            self.counters["cancelled"] += 1
            return True
        return False

    # -- P's KV over tcp: KV_CHUNK frames, checked and imported by the sink ----------------------

    async def _chunk(self, msg: KvChunk) -> None:
        slot = self.requests.get(msg.request_id)
        if slot is None:
            return  # cancelled or unknown: the bytes are simply dropped
        res = slot.reservation
        nbytes = msg.payload.nbytes
        actions = slot.machine.kv_chunk(
            msg.chunk_index, msg.token_start, msg.token_end, nbytes, time.monotonic()
        )
        if actions != [ImportChunk(msg.chunk_index)]:
            self.apply(slot, actions)
            return
        assert res is not None
        target = WriteTarget(tuple(res.block_ids), self.engine.block_size, res.num_cached_tokens)
        try:
            nbytes = await self.compute(self._import_in_engine, msg, target)
        except TransferError as exc:
            if slot.reservation is res:
                self.apply(slot, slot.machine.abort(f"bad KV_CHUNK {msg.chunk_index}: {exc}"))
            return
        if slot.reservation is res:  # not dropped meanwhile
            self.apply(slot, slot.machine.chunk_imported(nbytes))

    def _import_in_engine(self, msg: KvChunk, target: WriteTarget) -> int:
        """In the engine thread: the tcp sink checks and imports the chunk (its payload bytes)."""
        sink = self.sink
        assert isinstance(sink, TcpSink)
        nbytes = sink.receive(msg, target)
        self.notices.drain()
        return nbytes

    # -- engine progress -------------------------------------------------------------------------

    def on_step(self, outputs: list[StepOutput]) -> None:
        if any(out.finished for out in outputs):
            # Before the last tokens go: a conversation's next turn, sent the moment the client
            # has this one's last token, must find P already knowing what this turn left in
            # MD's tree (request_stopped's notice comes a step or two later, after the free).
            self.notices.post(self._p_boxes.values())
            self.blocks_freed()  # (the waiting allocations are asked after this step)
        super().on_step(outputs)

    def observe_output(self, slot: Slot, out: StepOutput) -> None:
        mode = slot.machine.fsm.mode
        if mode is not None:
            self.max_extend_tokens[mode] = max(
                self.max_extend_tokens.get(mode, 0), out.num_computed_this_step
            )

    def handoff_ended(self, mode: str) -> None:
        self.handoffs_by_mode[mode] = self.handoffs_by_mode.get(mode, 0) + 1

    def blocks_freed(self) -> None:
        self.waiting.kick()

    def connection_lost(self, conn: Connection) -> None:
        box = self._p_boxes.pop(conn, None)
        if box is not None:
            self.waiting.drop_lane(box)
            for slot in [s for s in self.requests.values() if s.p_conn is box]:
                if slot.machine.phase is Phase.RECEIVING_KV:
                    reason = "prefill control connection closed before the KV was complete"
                    self.apply(slot, slot.machine.abort(reason))
        if self.rld is not None and conn is self.rld.conn:
            self.rld = None
            # Without the relay there will be no cut: the requests before their final HANDOFF
            # are dropped (not an error for the client: RLD finishes them alone, or the router
            # replays them); one past it no longer needs RLD and carries on here.
            for slot in list(self.requests.values()):
                self.apply(slot, slot.machine.peer_lost())

    # -- stats ---------------------------------------------------------------------------------------

    def request_stats(self) -> dict[str, int]:
        out = self.decode_request_stats(
            "allocated",
            "finished_here",
            "handoffs",
            "cancelled",
            "refused",
            "alloc_waits",
        )
        out["waiting_for_room"] = len(self.waiting)
        out["active"] += len(self.waiting)
        return out

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["max_extend_tokens"] = dict(self.max_extend_tokens)
        out["handoffs"] = dict(self.handoffs_by_mode)
        out["active_phases"] = self.active_phases()
        if self.kv_paths is not None:
            out["transport"] = {
                "wan": {
                    **self.kv_paths.stats()["wan"],
                    "descriptor": self.sink.descriptor if self.sink else None,
                    "fenced_reservations": len(self.fenced),
                }
            }
        drc = self.notices.stats()
        if drc is not None:
            out["drc"] = drc
        return out
