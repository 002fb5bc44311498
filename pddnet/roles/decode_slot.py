"""The decode daemons' side of one request (RLD and MD): its machine, its reservation, P's lane,
and the operations on its engine sequence, run in order on its Serial -- start it, apply one
event's HANDOFF edits as ONE engine call, free it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pddnet.engine.engine import Engine, KVReservation
from pddnet.engine.sequence import FinishReason
from pddnet.lifecycle.actions import (
    AppendTokens,
    SequenceEdit,
    SetChunk,
    StartSequence,
)
from pddnet.lifecycle.decode_request import DecodeRequest

from .ordering import Serial
from .outbox import Outbox


class SlotHost(Protocol):
    """What a slot needs from its daemon (the DecodeTier of pddnet.roles.decode_tier)."""

    engine: Engine | None

    async def compute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
    async def add_sequence(self, req: Any, **options: Any) -> None: ...
    def wake(self) -> None: ...
    def apply(self, slot: Slot, actions: list[Any]) -> None: ...
    def fence(self, rid: str, res: KVReservation) -> None: ...
    async def request_stopped(self) -> None: ...
    def blocks_freed(self) -> None: ...


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

    def queue_edits(self, tier: SlotHost) -> None:
        """Queue one event's sequence edits as ONE engine call. Applied one call each, the
        engine could step between them: e.g. between a one-shot HANDOFF's append and its
        release it would extend all but the last handed-over token while still held, then
        that one -- two steps where the one-shot handoff is one extend."""
        if self.edits:
            batch = tuple(self.edits)
            self.edits.clear()
            self.serial.submit(lambda: self.edit(tier, batch))

    async def start(self, tier: SlotHost, a: StartSequence) -> None:
        """Add the engine sequence on the reservation (the machine's StartSequence)."""
        res, self.reservation = self.reservation, None
        if res is None:  # stopped before it started
            return
        alloc = self.machine.alloc
        try:
            await tier.add_sequence(
                alloc, output_token_ids=list(a.output_token_ids), kv=res, hold=a.hold
            )
        except ValueError as exc:
            self.started = False
            await tier.compute(tier.engine.free_reservation, res)
            tier.apply(
                self, self.machine.abort(f"could not start decoding: {exc}", code="decode_failed")
            )
            return
        tier.wake()

    async def edit(self, tier: SlotHost, edits: tuple[SequenceEdit, ...]) -> None:
        """Apply one event's HANDOFF edits to the held sequence, in the engine thread."""
        if not self.started:
            return
        try:
            reason = await tier.compute(edit_sequence, tier.engine, self.rid, edits)
        except ValueError as exc:  # a handover the engine cannot take (a relay bug)
            tier.apply(self, self.machine.abort(f"could not apply the handoff: {exc}"))
            return
        if reason is not None:  # cannot happen with a sane relay (it would have finished)
            self.started = False
            tier.apply(self, self.machine.abort(f"handed-over tokens end the request ({reason})"))
            return
        tier.wake()

    async def free(self, tier: SlotHost, fence: bool) -> None:
        """Free the reservation (or fence it: one-sided writes may still land) and abort the
        sequence, after the request's queued operations."""
        if self.reservation is not None:
            res, self.reservation = self.reservation, None
            if fence:
                tier.fence(self.rid, res)
            else:
                await tier.compute(tier.engine.free_reservation, res)
        if self.started:
            self.started = False
            await tier.compute(tier.engine.abort, self.rid)
        await tier.request_stopped()
        tier.blocks_freed()
