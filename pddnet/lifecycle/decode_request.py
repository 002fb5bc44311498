"""The decode side of one request, on RLD or MD: sans-IO, h11's shape.

A ``DecodeRequest`` is made when the daemon accepted P's KV_ALLOC_REQUEST (the reservation is
the daemon's: blocks are IO). From then on every message and engine step about the request goes
in as a method call and comes out as typed actions, in order, for the daemon to carry out: KV
chunk accounting (MD over tcp), KV_DONE and the completion of the copy, the start of decoding,
the one-shot and streaming handoff (driving pddnet.lifecycle.handoff's RelayHandoff on RLD and
MainHandoff on MD), cancel, abort, peer loss and the router's replay. Its actions are in
actions.py, the end and logprob rules of its tokens in decode_tokens.py, MD's counts of
the copy in kv_copy.py; two small
companions have their own files: takeover_hold.py (RLD parks a TAKEOVER that overtook its
request's allocation) and replay_request.py (a request the router replays here by token ids).

The machine never touches a socket, the engine or the clock: times come in as arguments.
``TRANSITIONS`` is the table: for each role, phase and event, the phases the event may lead to.
An event outside the table is stale (a late message about a request that moved on) and does
nothing; tests/test_decode_request.py checks every move it makes against the table.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pddnet.engine.engine import StepOutput
from pddnet.engine.sampling import TokenLogprob
from pddnet.lifecycle.actions import (
    CancelPeer,
    DecodeAction,
    EmitTokens,
    Failed,
    FinishRequest,
    ForwardDone,
    HandoffAction,
    ImportChunk,
    KvComplete,
    SendKvAbort,
    SendKvReceived,
    StartSequence,
    StopSequence,
)
from pddnet.lifecycle.decode_tokens import first_token_ends, first_token_logprob, take_logprobs
from pddnet.lifecycle.handoff import HandoffError, MainHandoff, MainPhase, RelayHandoff, RelayPhase
from pddnet.lifecycle.kv_copy import KvCopy
from pddnet.policy.handoff import HandoffPolicy
from pddnet.protocol import KvAllocRequest, KvDone

# Pipelines in which MD's copy is completed by a handoff from RLD (p_md: MD decodes alone).
WITH_RELAY_PIPELINES = ("p_rld_md",)


class Role(enum.Enum):
    RELAY = "relay"
    MAIN = "main_decode"


class Phase(enum.Enum):
    RECEIVING_KV = "receiving_kv"  # allocated; P's KV (and KV_DONE) still coming
    DECODING = "decoding"  # RLD: emitting (MD may ask for it); MD: emitting from the cut on
    STREAMING = "streaming"  # RLD: streaming handoff under way, still emitting
    WAITING_CUT = "waiting_cut"  # MD: TAKEOVER sent, sequence held until the final HANDOFF
    ENDED = "ended"  # finished, cut (RLD), cancelled, aborted or replaced by a replay


R, M = Role.RELAY, Role.MAIN
RX, DEC, STR, WAIT, END = (
    Phase.RECEIVING_KV,
    Phase.DECODING,
    Phase.STREAMING,
    Phase.WAITING_CUT,
    Phase.ENDED,
)
_ANY_LIVE = {RX, DEC, STR, WAIT}

# (role, phase, event) -> phases the event may lead to. Anything not here is a stale event.
# cancel (router CANCEL, P's KV_ABORT, the other tier's REQUEST_DONE), replaced and abort end
# a live request in any phase (added below the table).
TRANSITIONS: dict[tuple[Role, Phase, str], frozenset[Phase]] = {
    k: frozenset(v)
    for k, v in {
        # RLD: P writes into its pool; KV_DONE starts decoding at once (P's first token).
        (R, RX, "kv_done"): {DEC, END},  # END: P's token ends it, or a bad KV_DONE
        (R, RX, "takeover"): {RX, END},  # MD was faster than P's KV_DONE: kept until index 0
        (R, DEC, "takeover"): {STR, END},  # the handoff: streaming, or the cut (one-shot)
        (R, STR, "takeover"): {STR, END},  # MD's progress; the cut when it keeps pace
        (R, DEC, "engine_step"): {DEC, END},
        (R, STR, "engine_step"): {STR, END},
        (R, RX, "peer_lost"): {RX},  # MD gone, or dropped its copy: RLD decodes alone
        (R, DEC, "peer_lost"): {DEC},
        (R, STR, "peer_lost"): {DEC},
        # MD: chunks (tcp) or one-sided writes, KV_DONE, then TAKEOVER and the held sequence.
        (M, RX, "kv_chunk"): {RX, END},
        (M, RX, "chunk_imported"): {RX, WAIT, DEC, END},
        (M, RX, "kv_done"): {RX, WAIT, DEC, END},  # RX: chunks still on the bulk lanes
        (M, RX, "handoff"): {END},  # a HANDOFF before MD asked: a protocol error
        (M, WAIT, "handoff"): {WAIT, DEC, END},  # DEC: the final one
        (M, DEC, "handoff"): {END},
        (M, RX, "engine_step"): {END},
        (M, WAIT, "engine_step"): {WAIT, END},  # digesting handed-over tokens, reporting
        (M, DEC, "engine_step"): {DEC, END},
        # RLD's lane closed: no cut will come, free the copy (RLD finishes the request or the
        # router replays it); past the cut MD carries on. RX stays: p_md has no relay.
        (M, RX, "peer_lost"): {RX, END},
        (M, WAIT, "peer_lost"): {END},
    }.items()
}
for _role in Role:
    for _phase in _ANY_LIVE:
        for _event in ("cancel", "replaced", "abort"):
            TRANSITIONS[(_role, _phase, _event)] = frozenset({END})


# -- the machine ------------------------------------------------------------------------------------


class DecodeRequest:
    """One request on RLD (``Role.RELAY``) or MD (``Role.MAIN``), from its allocation on.

    ``hit_tokens``: the prefix-cache hit of the reservation (P sends positions past it).
    ``one_sided``: P writes into the pool itself (KV_DONE alone completes the copy; no chunks).
    ``hands_off`` (RLD): MD may take the request over. ``chunk_tokens`` (MD): streaming's cap.
    """

    def __init__(
        self,
        role: Role,
        alloc: KvAllocRequest,
        *,
        hit_tokens: int,
        eos_token_id: int | None,
        one_sided: bool,
        policy: HandoffPolicy | None = None,
        hands_off: bool = False,
        chunk_tokens: int = 1,
    ) -> None:
        self.role = role
        self.alloc = alloc
        self.hit_tokens = hit_tokens
        self.eos_token_id = eos_token_id
        self.one_sided = one_sided
        self.fsm: RelayHandoff | MainHandoff
        if role is Role.RELAY:
            assert policy is not None
            self.fsm = RelayHandoff(alloc.num_tokens, policy, hands_off)
        else:
            self.fsm = MainHandoff(
                alloc.num_tokens, chunk_tokens, with_relay=alloc.pipeline in WITH_RELAY_PIPELINES
            )
        self.kv = KvCopy(hit_tokens, alloc.num_tokens)
        self.done: KvDone | None = None  # P's KV_DONE
        self.writes_stopped = False  # P's KV_ABORT came: no write of it is in flight
        self.handoff_bytes = 0  # MD: HANDOFF frames received (timeline handoff_end)
        # output index -> logprobs of a token sampled for it, until emitted (requests asking them)
        self.logprobs: dict[int, TokenLogprob] = {}
        self._ended = False

    @property
    def rid(self) -> str:
        return self.alloc.request_id

    @property
    def has_peer(self) -> bool:
        """The other decode tier takes part in this request (CANCEL goes to it on failure)."""
        fsm = self.fsm
        return fsm.hands_off if isinstance(fsm, RelayHandoff) else fsm.with_relay

    @property
    def num_tokens(self) -> int:
        """Output tokens known here (RLD's load signal)."""
        fsm = self.fsm
        return fsm.num_tokens if isinstance(fsm, RelayHandoff) else len(fsm.known)

    @property
    def writes_ended(self) -> bool:
        """No one-sided write of P's can still land in the reservation (KV_DONE or KV_ABORT)."""
        return self.done is not None or self.writes_stopped

    @property
    def phase(self) -> Phase:
        fsm = self.fsm
        if self._ended:
            return Phase.ENDED
        if isinstance(fsm, RelayHandoff):
            if fsm.phase in (RelayPhase.CUT, RelayPhase.FINISHED):
                return Phase.ENDED
            if self.done is None:
                return Phase.RECEIVING_KV
            return Phase.STREAMING if fsm.phase is RelayPhase.STREAMING else Phase.DECODING
        return {
            MainPhase.RECEIVING_KV: Phase.RECEIVING_KV,
            MainPhase.WAITING_CUT: Phase.WAITING_CUT,
            MainPhase.DECODING: Phase.DECODING,
            MainPhase.DONE: Phase.ENDED,
        }[fsm.phase]

    def accepts(self, event: str) -> bool:
        return (self.role, self.phase, event) in TRANSITIONS

    # -- P's KV ---------------------------------------------------------------------------------

    def kv_chunk(
        self, chunk_index: int, token_start: int, token_end: int, nbytes: int, now_s: float
    ) -> list[DecodeAction]:
        """MD: a KV_CHUNK arrived (tcp path). Checks this request's accounting only."""
        if not self.accepts("kv_chunk"):
            return []  # cancelled: the bytes are simply dropped
        if self.one_sided:
            return self.abort(
                f"KV_CHUNK {chunk_index} on a one-sided path (P writes into the pool itself): "
                "P and MD disagree on [transport] wan"
            )
        fault = self.kv.chunk_arrived(chunk_index, token_start, token_end, nbytes, now_s)
        if fault is not None:
            return self.abort(f"bad KV_CHUNK {chunk_index}: {fault}")
        return [ImportChunk(chunk_index)]

    def chunk_imported(self, nbytes: int) -> list[DecodeAction]:
        """MD: an ImportChunk is in the pool (``nbytes`` payload bytes)."""
        self.kv.chunk_imported(nbytes)
        if not self.accepts("chunk_imported"):
            return []
        return self._maybe_complete()

    def kv_done(self, msg: KvDone, now_s: float) -> list[DecodeAction]:
        """P's KV_DONE: every write is out (one-sided: landed); chunks may still be in flight."""
        if not self.accepts("kv_done"):
            return []
        if self.role is Role.RELAY:
            self.done = msg
            if msg.num_tokens != self.alloc.num_tokens:
                return self.abort(
                    f"KV_DONE covers {msg.num_tokens} positions, expected {self.alloc.num_tokens}"
                )
            return self._kv_complete(msg.num_bytes)
        if self.done is not None or msg.num_tokens != self.alloc.num_tokens:
            return self.abort(
                f"bad KV_DONE: {msg.num_tokens} positions (expected "
                f"{self.alloc.num_tokens}), repeated={self.done is not None}"
            )
        if self.one_sided and msg.num_chunks:
            return self.abort(
                f"KV_DONE counts {msg.num_chunks} KV_CHUNK frames on a one-sided path: "
                "P and MD disagree on [transport] wan"
            )
        self.done = msg
        if self.one_sided:  # every write landed before P sent KV_DONE (acknowledged)
            self.kv.landed(msg.num_bytes, now_s)
        return self._maybe_complete()

    def _maybe_complete(self) -> list[DecodeAction]:
        """MD: complete when KV_DONE and every chunk it counts are in."""
        done, kv = self.done, self.kv
        if done is None or kv.imports_pending:
            return []
        if not self.one_sided:
            excess = kv.more_than(done)
            if excess is not None:
                return self.abort(excess)
            if kv.short_of(done):
                return []  # KV_DONE overtook chunks still on the bulk lanes
        return self._kv_complete(kv.bytes_in, kv.received())

    def _kv_complete(
        self, num_bytes: int, received: SendKvReceived | None = None
    ) -> list[DecodeAction]:
        """The copy is complete: decode from P's first token (or end with it)."""
        done = self.done
        assert done is not None
        first = done.first_token_id
        entry = first_token_logprob(done)
        emits_first = self.role is Role.RELAY or not self.has_peer  # who emits index 0
        if entry is not None and emits_first:
            self.logprobs[0] = entry
        ends = first_token_ends(first, self.alloc, self.eos_token_id)
        out: list[DecodeAction] = [KvComplete(num_bytes)]
        if received is not None:
            out.append(received)
        if isinstance(self.fsm, RelayHandoff):
            if ends is None:
                out.append(StartSequence((first,), hold=False))
            return out + self._follow(self.fsm.rld_token(0, first, ends))
        if ends is not None:  # P's token ended the request: nothing to decode here
            self.fsm.cancel()
            if emits_first:
                out += [EmitTokens(0, (first,)), FinishRequest(ends, 1)]
            return [*out, StopSequence()]
        return out + self._follow(self.fsm.kv_complete(first))

    # -- the handoff ----------------------------------------------------------------------------

    def takeover(self, ready_position: int, chunk_tokens: int, load: float) -> list[DecodeAction]:
        """RLD: MD's TAKEOVER (the first asks for the handoff, later ones report progress)."""
        if not self.accepts("takeover"):
            return []
        assert isinstance(self.fsm, RelayHandoff)
        try:
            return self._follow(self.fsm.takeover(ready_position, chunk_tokens, load))
        except HandoffError as exc:
            return self.abort(f"bad TAKEOVER: {exc}")

    def handoff(
        self, start_index: int, token_ids: Sequence[int], final: bool, mode: str, nbytes: int
    ) -> list[DecodeAction]:
        """MD: RLD's HANDOFF (``nbytes`` on the wire)."""
        if not self.accepts("handoff"):
            return []
        assert isinstance(self.fsm, MainHandoff)
        self.handoff_bytes += nbytes
        try:
            return self._follow(self.fsm.handoff(start_index, token_ids, final, mode))
        except HandoffError as exc:
            return self.abort(f"bad HANDOFF: {exc}")

    def engine_step(self, out: StepOutput, reasons: list[str | None]) -> list[DecodeAction]:
        """The engine ran a step of this request's sequence (``reasons``: step_end_reasons)."""
        if not self.accepts("engine_step"):
            return []
        for i, entry in enumerate(out.logprobs or ()):
            self.logprobs[out.output_index + i] = entry
        fsm = self.fsm
        try:
            if isinstance(fsm, RelayHandoff):
                actions: list[HandoffAction] = []
                for i, (tok, reason) in enumerate(zip(out.new_token_ids, reasons, strict=False)):
                    actions += fsm.rld_token(out.output_index + i, tok, reason)
                return self._follow(actions)
            new_tokens = out.new_token_ids[: len(reasons)]
            reason = reasons[-1] if reasons else None
            return self._follow(
                fsm.md_step(out.num_computed_tokens, out.output_index, new_tokens, reason)
            )
        except HandoffError as exc:
            return self.abort(str(exc))

    def take_logprobs(self, emit: EmitTokens) -> list[TokenLogprob | None] | None:
        """The logprobs of an EmitTokens' tokens (None: the request does not ask for them)."""
        return take_logprobs(self.logprobs, self.alloc, emit.index, len(emit.token_ids))

    # -- ends -------------------------------------------------------------------------------------

    def peer_lost(self, why: str | None = None) -> list[DecodeAction]:
        """The other decode tier's lane closed, or (RLD) MD dropped its copy of the request
        (MD's CANCEL: ``why``). RLD: MD will not take over, RLD finishes alone. MD: before the
        final HANDOFF there will be no cut: free the copy quietly (RLD finishes the request
        alone, or the router replays it); past it MD carries the request on."""
        if not self.accepts("peer_lost") or not self.has_peer:
            return []
        if isinstance(self.fsm, RelayHandoff):
            return self._follow(self.fsm.peer_lost(why or "main decode lost"))
        return self.abort(
            why or "relay connection closed before the final handoff", tell_router=False
        )

    def cancel(self, writes_stopped: bool = False) -> list[DecodeAction]:
        """Router CANCEL, REQUEST_DONE from the other tier, or P's KV_ABORT (``writes_stopped``:
        P sends it after its writes ended)."""
        self.writes_stopped = self.writes_stopped or writes_stopped
        if not self.accepts("cancel"):
            return []
        return self._end([StopSequence()])

    def replaced(self) -> list[DecodeAction]:
        """The router replays the request here by token ids: this attempt's part stops. MD tells
        P, which may still be copying KV for it: the replay recomputes what it needs, and P's
        KV_DONE would now be ignored here (stale), leaving P holding its blocks for good."""
        if not self.accepts("replaced"):
            return []
        out: list[DecodeAction] = []
        if self.role is Role.MAIN:
            out.append(SendKvAbort("replayed on main decode by the router"))
        return self._end([*out, StopSequence()])

    def abort(
        self, reason: str, code: str | None = None, tell_router: bool = True
    ) -> list[DecodeAction]:
        """The request fails here: tell the router (or note it), stop P, stop the other tier.

        MD before its TAKEOVER (with a relay) fails only its copy: RLD cannot have cut yet, so
        it still carries the request and, told by the CANCEL, finishes it alone as when MD is
        lost; the router only notes it (md_dropped), P drops MD's copy on the KV_ABORT. From
        the TAKEOVER on RLD may have cut: the router hears of it and decides (router_request)."""
        if not self.accepts("abort"):
            return []
        if code is None:
            code = "relay_failed" if self.role is Role.RELAY else "main_decode_failed"
        if self.role is Role.MAIN and self.has_peer and self.phase is Phase.RECEIVING_KV:
            tell_router = False
        out: list[DecodeAction] = [Failed(code, reason, tell_router), SendKvAbort(reason[:4096])]
        if self.has_peer:
            out.append(CancelPeer(reason[:4096]))
        return self._end([*out, StopSequence()])

    def _end(self, actions: list[DecodeAction]) -> list[DecodeAction]:
        self.fsm.cancel()
        self._ended = True
        return actions

    def _follow(self, actions: list[HandoffAction]) -> list[DecodeAction]:
        """The handoff machine's actions, each with what this role does right after it."""
        out: list[DecodeAction] = []
        for a in actions:
            out.append(a)
            if isinstance(a, FinishRequest):
                if self.role is Role.RELAY and self.has_peer:
                    # P may still be shipping the WAN copy: stop it
                    out.append(SendKvAbort("relay finished the request"))
                elif self.role is Role.MAIN and self.has_peer:
                    out.append(ForwardDone())
                out.append(StopSequence())
        return out
