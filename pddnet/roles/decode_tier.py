"""The shell RLD and MD share: it moves messages, engine outputs and engine calls in and out of
each request's pddnet.lifecycle.decode_request.DecodeRequest, and carries out its actions.

What stays here is IO: the reservation (blocks of the pool, answered to P's KV_ALLOC_REQUEST),
the request's engine operations in order (Serial), which outbox a message goes to, fencing a
dropped reservation that one-sided writes may still reach, and replays (roles/replays.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pddnet.config import ClusterConfig
from pddnet.engine.engine import Engine, KVReservation, StepOutput
from pddnet.engine.sequence import FinishReason
from pddnet.lifecycle.decode_actions import (
    DecodeAction,
    Failed,
    ForwardDone,
    KvComplete,
    SendKvAbort,
    SendKvReceived,
)
from pddnet.lifecycle.decode_request import DecodeRequest, Role
from pddnet.lifecycle.decode_tokens import step_end_reasons
from pddnet.lifecycle.handoff import (
    AppendTokens,
    CancelPeer,
    EmitTokens,
    FinishRequest,
    FirstMainToken,
    HandoffAbandoned,
    HandoffEnded,
    HandoffStarted,
    ReleaseHold,
    SendHandoff,
    SendTakeover,
    SetChunk,
    StartSequence,
    StopSequence,
)
from pddnet.lifecycle.sampling import sampling_of
from pddnet.protocol import (
    Cancel,
    Handoff,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvDone,
    KvReceived,
    Message,
    RequestDone,
    Submit,
    Takeover,
)
from pddnet.transport import Connection

from .common import log
from .kv_receiver import KvReceiver
from .ordering import Serial
from .outbox import Outbox
from .replays import Replays

SequenceEdit = AppendTokens | SetChunk | ReleaseHold


def edit_sequence(engine: Engine, rid: str, edits: tuple[SequenceEdit, ...]) -> FinishReason | None:
    """In the engine thread, between two steps: apply a HANDOFF's edits in order. Returns the
    finish reason if appended tokens end the request (the engine then freed it)."""
    for e in edits:
        if isinstance(e, SetChunk):
            engine.set_max_chunk_tokens(rid, e.max_chunk_tokens)
        elif isinstance(e, AppendTokens):
            reason = engine.append_tokens(rid, e.token_ids)
            if reason is not None:
                return reason
        else:
            engine.set_hold(rid, False)
    return None


@dataclass
class Slot:
    """The daemon's side of one request: its machine and the IO the machine does not see."""

    machine: DecodeRequest
    reservation: KVReservation | None
    serial: Serial
    p_conn: Outbox  # P's control lane (KV_ABORT, KV_RECEIVED)
    started: bool = False  # the engine sequence exists (or is being added)
    edits: list[SequenceEdit] = field(default_factory=list)  # this event's, not yet queued

    @property
    def rid(self) -> str:
        return self.machine.rid


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
                self._apply(old, old.machine.replaced())
            self.replays.start(msg, old.serial if old is not None else None)
        elif isinstance(msg, KvAllocRequest):
            await self._alloc(self._p_outbox(conn), msg)
        elif isinstance(msg, KvDone):
            if not self.unfence(msg.request_id):
                self.event(msg.request_id, lambda m: m.kv_done(msg, time.monotonic()))
        elif isinstance(msg, KvAbort) and self.unfence(msg.request_id):
            pass  # P's confirmation that no write of a dropped request is in flight
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

    def event(self, rid: str, fn: Callable[[DecodeRequest], list[DecodeAction]]) -> None:
        """Feed an event to a request's machine (if it is held here) and carry out its actions."""
        slot = self.requests.get(rid)
        if slot is not None:
            self._apply(slot, fn(slot.machine))

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
            self._apply(slot, slot.machine.cancel(writes_stopped))

    def drop_unallocated(self, rid: str, reason: str) -> bool:
        """A request dropped before its allocation was made (True: it was waiting here)."""
        return False

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
            self._apply(slot, slot.machine.engine_step(out, reasons))

    def observe_output(self, slot: Slot, out: StepOutput) -> None:
        """A step of a held request, before its machine sees it (for the tier's stats)."""

    def engine_failed(self, reason: str) -> None:
        self.replays.failed(reason)
        for slot in [s for s in self.requests.values() if s.started]:
            self._apply(slot, slot.machine.abort(reason, code="engine_failed"))

    # -- actions -------------------------------------------------------------------------------

    def _apply(self, slot: Slot, actions: list[DecodeAction]) -> None:
        rid, m = slot.rid, slot.machine
        peer = self.decode_peer
        done: RequestDone | None = None
        for a in actions:
            if isinstance(a, (AppendTokens, SetChunk, ReleaseHold)):
                slot.edits.append(a)
                continue
            self._flush_edits(slot)
            if isinstance(a, EmitTokens):
                self.emit_tokens(rid, a.index, a.token_ids, m.take_logprobs(a))
            elif isinstance(a, StartSequence):
                slot.started = True  # before the call: the engine may step (and fail) first
                slot.serial.submit(lambda a=a: self._start(slot, a))
            elif isinstance(a, StopSequence):
                self._stop(slot)
            elif isinstance(a, FinishRequest):
                self.counters["finished_here"] += 1
                done = self.request_done(rid, a.reason, m.alloc.num_tokens, a.num_output_tokens)
            elif isinstance(a, ForwardDone):
                if peer is not None and done is not None:
                    peer.post(done)
            elif isinstance(a, KvComplete):
                self.timeline(
                    rid, f"{'rld' if m.role is Role.RELAY else 'md'}_kv_complete", a.num_bytes
                )
            elif isinstance(a, SendKvReceived):
                self.before_p_answer()
                slot.p_conn.post(
                    KvReceived(
                        request_id=rid,
                        num_bytes=a.num_bytes,
                        span_bytes=a.span_bytes,
                        span_s=a.span_s,
                    )
                )
            elif isinstance(a, SendKvAbort):
                slot.p_conn.post(KvAbort(request_id=rid, reason=a.reason))
            elif isinstance(a, CancelPeer):
                if peer is not None:
                    peer.post(Cancel(request_id=rid, reason=a.reason))
            elif isinstance(a, Failed):
                log.warning("%s: %s: %s", self.instance_id, rid, a.reason)
                if a.tell_router:
                    self.error(rid, a.code, a.reason)
                else:
                    self.timeline(rid, "md_dropped", None, a.reason[:128])
            elif isinstance(a, SendHandoff):
                assert peer is not None
                peer.post(
                    Handoff(
                        request_id=rid,
                        start_index=a.start_index,
                        token_ids=a.token_ids,
                        final=a.final,
                        mode=a.mode,
                    )
                )
                if a.final:
                    self.counters["handed_off"] += 1
            elif isinstance(a, SendTakeover):
                if peer is None or not peer.alive:
                    self._apply(slot, m.abort("no relay connected to hand over from"))
                    return
                peer.post(
                    Takeover(
                        request_id=rid, ready_position=a.ready_position, chunk_tokens=a.chunk_tokens
                    )
                )
            elif isinstance(a, HandoffStarted):
                self.timeline(rid, "handoff_start", a.backlog_tokens, a.mode)
            elif isinstance(a, HandoffAbandoned):
                self.counters["handoffs_abandoned"] += 1
                self.timeline(rid, "handoff_abandoned", None, a.reason[:128])
            elif isinstance(a, FirstMainToken):
                self.timeline(rid, "first_md_token", a.index)
            elif isinstance(a, HandoffEnded):
                self.counters["handoffs"] += 1
                self.handoff_ended(a.mode)
                self.timeline(rid, "handoff_end", m.handoff_bytes, a.mode)
        self._flush_edits(slot)

    def before_p_answer(self) -> None:
        """Hook: a frame to P is about to go (MD piggy-backs its cache notices)."""

    def handoff_ended(self, mode: str) -> None:
        """Hook: MD applied a final HANDOFF of this mode (its stats)."""

    def _flush_edits(self, slot: Slot) -> None:
        """Queue one event's sequence edits as ONE engine call. Applied one call each, the
        engine could step between them: e.g. between a one-shot HANDOFF's append and its
        release it would extend all but the last handed-over token while still held, then
        that one -- two steps where the one-shot handoff is one extend."""
        if slot.edits:
            batch = tuple(slot.edits)
            slot.edits.clear()
            slot.serial.submit(lambda: self._edit(slot, batch))

    async def _start(self, slot: Slot, a: StartSequence) -> None:
        res, slot.reservation = slot.reservation, None
        if res is None:  # stopped before it started
            return
        alloc = slot.machine.alloc
        try:
            await self.compute(
                self.engine.add_request,
                alloc.prompt_token_ids,
                alloc.max_tokens,
                sampling_of(alloc),
                alloc.request_id,
                ignore_eos=alloc.ignore_eos,
                output_token_ids=list(a.output_token_ids),
                kv=res,
                hold=a.hold,
            )
        except ValueError as exc:
            slot.started = False
            await self.compute(self.engine.free_reservation, res)
            self._apply(
                slot, slot.machine.abort(f"could not start decoding: {exc}", code="decode_failed")
            )
            return
        self.wake()

    async def _edit(self, slot: Slot, edits: tuple[SequenceEdit, ...]) -> None:
        if not slot.started:
            return
        try:
            reason = await self.compute(edit_sequence, self.engine, slot.rid, edits)
        except ValueError as exc:  # a handover the engine cannot take (a relay bug)
            self._apply(slot, slot.machine.abort(f"could not apply the handoff: {exc}"))
            return
        if reason is not None:  # cannot happen with a sane relay (it would have finished)
            slot.started = False
            self._apply(slot, slot.machine.abort(f"handed-over tokens end the request ({reason})"))
            return
        self.wake()

    def _stop(self, slot: Slot) -> None:
        """Free the request's reservation or sequence (after its queued operations), forget it."""
        if self.requests.get(slot.rid) is not slot:
            return
        del self.requests[slot.rid]
        self.ended.add(slot.rid)
        self.forgotten(slot.rid)
        # P may still be writing into the reservation (one-sided, before KV_DONE / KV_ABORT).
        fence = slot.reservation is not None and self.writes_may_land(slot.machine.writes_ended)

        async def stop() -> None:
            if slot.reservation is not None:
                res, slot.reservation = slot.reservation, None
                if fence:
                    self.fence(slot.rid, res)
                else:
                    await self.compute(self.engine.free_reservation, res)
            if slot.started:
                slot.started = False
                await self.compute(self.engine.abort, slot.rid)
            await self.request_stopped()
            self.blocks_freed()

        slot.serial.submit(stop)

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
