"""The shell RLD and MD share: it moves messages, engine outputs and engine calls in and out of
each request's pddnet.lifecycle.decode_request.DecodeRequest, and carries out its actions.

What stays here is IO: the reservation (blocks of the pool, answered to P's KV_ALLOC_REQUEST),
the request's engine operations in order (Serial), which outbox a message goes to, fencing a
dropped reservation that one-sided writes may still reach, and replays (roles/replays.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from pddnet.config import ClusterConfig
from pddnet.engine.engine import KVReservation, StepOutput
from pddnet.lifecycle import actions as act
from pddnet.lifecycle.decode_messages import handoff, kv_received, takeover
from pddnet.lifecycle.decode_request import DecodeRequest, Role
from pddnet.lifecycle.decode_tokens import step_end_reasons
from pddnet.protocol import (
    Cancel,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvDone,
    Message,
    RequestDone,
    Submit,
)
from pddnet.transport import Connection

from .common import log
from .decode_slot import Slot
from .kv_receiver import KvReceiver
from .ordering import Serial
from .outbox import Outbox
from .replays import Replays


class DecodeTier(KvReceiver):
    """Base of RelayDaemon and MainDecodeDaemon. Subclasses implement
    ``_alloc``, ``handle_own`` (their own messages) and ``decode_peer`` (where CANCEL,
    HANDOFF / TAKEOVER and forwarded REQUEST_DONEs go)."""

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        self.requests: dict[str, Slot] = {}
        self.replays = Replays(self)
        self._p_boxes: dict[Connection, Outbox] = {}

    @property
    def decode_peer(self) -> Any:
        """The other decode tier's lane (``.post``), or None."""
        return None

    # -- messages ------------------------------------------------------------------------------

    async def handle(self, conn: Connection, msg: Message) -> None:
        rid = getattr(msg, "request_id", None)
        if conn.peer_role != "router" and rid in self.replays:
            # About the attempt that was lost (e.g. MD cancelling its half of a request the
            # router now replays here): the replay belongs to the router alone.
            self.counters["stale_messages_for_replays"] += 1
        elif isinstance(msg, Submit) and conn.peer_role == "router":
            old = self.requests.get(msg.request_id)
            if old is not None:  # its producer elsewhere was lost: stop our part first
                self.apply(old, old.machine.replaced())
            self.replays.start(msg, old.serial if old is not None else None)
        elif isinstance(msg, KvAllocRequest):
            await self._alloc(self._p_outbox(conn), msg)
        elif isinstance(msg, KvDone):
            if not self.unfence(msg.request_id):
                self.event(msg.request_id, lambda m: m.kv_done(msg, time.monotonic()))
        elif isinstance(msg, KvAbort) and self.unfence(msg.request_id):
            pass  # P's confirmation that no write of a dropped request is in flight
        elif isinstance(msg, Cancel) and conn.peer_role == "main_decode":
            self.main_dropped(msg.request_id, msg.reason)
        elif isinstance(msg, (Cancel, KvAbort)):
            self._drop(msg.request_id, msg.reason, writes_stopped=isinstance(msg, KvAbort))
        elif isinstance(msg, RequestDone):
            self._drop(msg.request_id, f"{msg.producer} finished the request")
        elif not await self.handle_own(conn, msg):
            log.warning(
                "%s: unexpected %s from %s", self.instance_id, msg.TYPE.name, conn.peer_role
            )

    async def handle_own(self, conn: Connection, msg: Message) -> bool:
        """A message only this tier takes; False if it is not one."""
        return False

    async def _alloc(self, p: Outbox, msg: KvAllocRequest) -> None:  # pragma: no cover
        raise NotImplementedError

    def _p_outbox(self, conn: Connection) -> Outbox:
        box = self._p_boxes.get(conn)
        if box is None:  # replies to P go back on the connection P dialled
            box = self._p_boxes[conn] = self.outbox(conn, f"{conn.peer_role} control")
        return box

    def event(self, rid: str, fn: Callable[[DecodeRequest], list[act.DecodeAction]]) -> None:
        """Feed an event to a request's machine (if it is held here) and carry out its actions."""
        slot = self.requests.get(rid)
        if slot is not None:
            self.apply(slot, fn(slot.machine))

    def _drop(self, rid: str, reason: str, writes_stopped: bool = False) -> None:
        """Router CANCEL, P's KV_ABORT or the other tier's REQUEST_DONE."""
        if self.replays.drop(rid):
            return
        self.ended.add(rid)
        if self.drop_unallocated(rid, reason):
            return
        slot = self.requests.get(rid)
        if slot is not None:
            self.counters["cancelled"] += 1
            self.apply(slot, slot.machine.cancel(writes_stopped))

    def drop_unallocated(self, rid: str, reason: str) -> bool:
        """A request dropped before its allocation was made (True: it was waiting here)."""
        return False

    def main_dropped(self, rid: str, reason: str) -> None:
        """RLD: MD's CANCEL, sent when MD failed its copy of the request. Before the cut RLD
        finishes the request alone, as when MD is lost; past it RLD no longer holds it."""
        self.event(rid, lambda m: m.peer_lost(f"main decode dropped it: {reason}"[:4096]))

    # -- allocation (the pool's reservations: KvReceiver) ----------------------------------------

    def accept(
        self, p: Outbox, msg: KvAllocRequest, res: KVReservation, machine: DecodeRequest, **extra
    ) -> Slot:
        """Hold the request (its machine) and answer P with the reserved blocks."""
        engine, sink = self.engine, self.sink
        assert engine is not None and sink is not None
        slot = Slot(machine, res, Serial(f"{self.role} {msg.request_id}", self._tasks), p)
        self.requests[msg.request_id] = slot
        self.counters["allocated"] += 1
        p.post(
            KvAllocResponse(
                request_id=msg.request_id,
                accepted=True,
                hit_tokens=res.num_cached_tokens,
                block_ids=tuple(res.block_ids),
                block_size=engine.block_size,
                dtype=engine.spec.dtype,
                region=sink.descriptor,
                **extra,
            )
        )
        return slot

    # -- engine progress -------------------------------------------------------------------------

    def on_step(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            if self.replays.step(out):
                continue
            slot = self.requests.get(out.request_id)
            if slot is None:
                continue
            reasons = step_end_reasons(out, slot.machine.alloc.stop_token_ids)
            if reasons is None:
                continue  # our own abort
            if out.finished:
                slot.started = False  # the engine freed the blocks itself
            self.observe_output(slot, out)
            self.apply(slot, slot.machine.engine_step(out, reasons))

    def observe_output(self, slot: Slot, out: StepOutput) -> None:
        """A step of a held request, before its machine sees it (for the tier's stats)."""

    def engine_failed(self, reason: str) -> None:
        self.replays.failed(reason)
        for slot in [s for s in self.requests.values() if s.started]:
            self.apply(slot, slot.machine.abort(reason, code="engine_failed"))

    # -- actions -------------------------------------------------------------------------------

    def apply(self, slot: Slot, actions: list[act.DecodeAction]) -> None:
        """Carry out a request's actions, in order (sequence edits of one event: one call)."""
        rid, m = slot.rid, slot.machine
        peer = self.decode_peer
        done: RequestDone | None = None
        for a in actions:
            if isinstance(a, act.SequenceEdit):
                slot.edits.append(a)
                continue
            slot.queue_edits(self)
            if isinstance(a, act.EmitTokens):
                self.emit_tokens(rid, a.index, a.token_ids, m.take_logprobs(a))
            elif isinstance(a, act.StartSequence):
                slot.started = True  # before the call: the engine may step (and fail) first
                slot.serial.submit(lambda a=a: slot.start(self, a))
            elif isinstance(a, act.StopSequence):
                self._stop(slot)
            elif isinstance(a, act.FinishRequest):
                self.counters["finished_here"] += 1
                done = self.request_done(rid, a.reason, m.alloc.num_tokens, a.num_output_tokens)
            elif isinstance(a, act.ForwardDone):
                if peer is not None and done is not None:
                    peer.post(done)
            elif isinstance(a, act.KvComplete):
                self.timeline(
                    rid, f"{'rld' if m.role is Role.RELAY else 'md'}_kv_complete", a.num_bytes
                )
            elif isinstance(a, act.SendKvReceived):
                self.before_p_answer()
                slot.p_conn.post(kv_received(rid, a))
            elif isinstance(a, act.SendKvAbort):
                slot.p_conn.post(KvAbort(request_id=rid, reason=a.reason))
            elif isinstance(a, act.CancelPeer):
                if peer is not None:
                    peer.post(Cancel(request_id=rid, reason=a.reason))
            elif isinstance(a, act.Failed):
                log.warning("%s: %s: %s", self.instance_id, rid, a.reason)
                if a.tell_router:
                    self.error(rid, a.code, a.reason)
                else:
                    self.timeline(rid, "md_dropped", None, a.reason[:128])
            elif isinstance(a, act.SendHandoff):
                assert peer is not None
                peer.post(handoff(rid, a))
                if a.final:
                    self.counters["handed_off"] += 1
            elif isinstance(a, act.SendTakeover):
                if peer is None or not peer.alive:
                    self.apply(slot, m.abort("no relay connected to hand over from"))
                    return
                peer.post(takeover(rid, a))
            elif isinstance(a, act.HandoffStarted):
                self.timeline(rid, "handoff_start", a.backlog_tokens, a.mode)
            elif isinstance(a, act.HandoffAbandoned):
                self.counters["handoffs_abandoned"] += 1
                self.timeline(rid, "handoff_abandoned", None, a.reason[:128])
            elif isinstance(a, act.FirstMainToken):
                self.timeline(rid, "first_md_token", a.index)
            elif isinstance(a, act.HandoffEnded):
                self.counters["handoffs"] += 1
                self.handoff_ended(a.mode)
                self.timeline(rid, "handoff_end", m.handoff_bytes, a.mode)
        slot.queue_edits(self)

    def before_p_answer(self) -> None:
        """Hook: a frame to P is about to go (MD piggy-backs its cache notices)."""

    def handoff_ended(self, mode: str) -> None:
        """Hook: MD applied a final HANDOFF of this mode (its stats)."""

    def _stop(self, slot: Slot) -> None:
        """Free the request's reservation or sequence (after its queued operations), forget it."""
        if self.requests.get(slot.rid) is not slot:
            return
        del self.requests[slot.rid]
        self.ended.add(slot.rid)
        self.forgotten(slot.rid)
        # P may still be writing into the reservation (one-sided, before KV_DONE / KV_ABORT).
        fence = slot.reservation is not None and self.writes_may_land(slot.machine.writes_ended)
        slot.serial.submit(lambda: slot.free(self, fence))

    def forgotten(self, rid: str) -> None:
        """Hook: a request is no longer held here (RLD releases its admission)."""

    async def request_stopped(self) -> None:
        """Hook: a request's blocks went back (MD tells P what its cache now holds)."""

    # -- stats ---------------------------------------------------------------------------------------

    def decode_request_stats(self, *counters: str) -> dict[str, int]:
        """Live requests plus the named counters."""
        return {
            "active": len(self.requests) + len(self.replays),
            **{name: self.counters[name] for name in counters},
        }

    def active_phases(self, limit: int = 16) -> dict[str, str]:
        """Where live requests stand (a few), so a leak report says which phase they are stuck in."""
        return {rid: s.machine.phase.value for rid, s in list(self.requests.items())[:limit]}
