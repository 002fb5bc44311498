"""Every action a request machine gives out: the vocabulary of effects the machines ask their
shells (the daemons) to carry out, in order.

Like h11's ``_events.py``, one module holds them all, so a reader sees in one place every effect
a request's life can have. One section per machine, each ending with its union: ``PrefillAction``
(P's request), ``HandoffAction`` (the handoff machines), ``DecodeAction`` (the decode side: the
handoff's actions and its own), ``RouterAction`` (the router's view). The handoff's section comes
before the decode side's because ``DecodeAction`` extends ``HandoffAction``.
"""

from __future__ import annotations

from dataclasses import dataclass

from pddnet.policy.pipeline import Pipeline
from pddnet.policy.planner import Plan
from pddnet.protocol import messages as m

# -- P's request (prefill_request.py) ------------------------------------------------------------
# What the prefill daemon carries out: allocations to ask, KV to ship, KV_DONE, aborts, the
# release of P's blocks, what the router and P's planner are told.


@dataclass(frozen=True)
class AskAllocation:
    """KV_ALLOC_REQUEST to ``target``, naming the request's current pipeline."""

    target: str
    pipeline: Pipeline
    expected_hit_tokens: int


@dataclass(frozen=True)
class StartPrefill:
    """Add the request to P's engine (prefill-only, keeping its blocks)."""


@dataclass(frozen=True)
class Transfer:
    """Ship KV positions [start, end) to ``target``."""

    target: str
    start: int
    end: int


@dataclass(frozen=True)
class SendKvDone:
    """All of ``target``'s KV is out: KV_DONE with the first token (then ``kv_done_out``)."""

    target: str
    first_token: int


@dataclass(frozen=True)
class AbortTarget:
    """KV_ABORT to ``target`` once the request's writes to it have stopped: it frees what it
    reserved."""

    target: str
    reason: str


@dataclass(frozen=True)
class StopWrites:
    """``target``'s peer is gone: stop the request's writes to it (no KV_ABORT can reach it)."""

    target: str
    reason: str


@dataclass(frozen=True)
class ReleaseBlocks:
    """Free P's own blocks for the request (or abort its prefill); the request is over."""


@dataclass(frozen=True)
class FailRequest:
    """Report the request as failed to the router (ERROR); counts as ``failed``."""

    code: str
    message: str


@dataclass(frozen=True)
class ReportPipelineChoice:
    """PIPELINE_CHOICE to the router: the planner's decision and its inputs."""

    plan: Plan


@dataclass(frozen=True)
class ReportPipelineChange:
    """PIPELINE_CHANGE to the router."""

    pipeline: Pipeline
    reason: str


@dataclass(frozen=True)
class Timeline:
    """A timeline event to the router."""

    event: str
    value: int | None = None
    detail: str = ""


@dataclass(frozen=True)
class Count:
    """Add one to P's counter ``name`` (its stats)."""

    name: str


@dataclass(frozen=True)
class CommitWan:
    """``num_tokens`` of the request's KV will cross to MD: P's WAN backlog grows."""

    num_tokens: int


@dataclass(frozen=True)
class ReleaseWan:
    """Nothing more of the request's KV will cross to MD: it leaves P's WAN backlog."""


@dataclass(frozen=True)
class ObserveWanTransfer:
    """A goodput sample: MD acknowledged ``num_bytes`` ``seconds`` after its allocation answer."""

    num_bytes: int
    seconds: float


PrefillAction = (
    AskAllocation
    | StartPrefill
    | Transfer
    | SendKvDone
    | AbortTarget
    | StopWrites
    | ReleaseBlocks
    | FailRequest
    | ReportPipelineChoice
    | ReportPipelineChange
    | Timeline
    | Count
    | CommitWan
    | ReleaseWan
    | ObserveWanTransfer
)


# -- the handoff (handoff.py) --------------------------------------------------------------------
# What RelayHandoff (RLD) and MainHandoff (MD) ask of the decode-side daemon.


@dataclass(frozen=True)
class EmitTokens:
    """Send TOKEN_EVENT(index, token_ids) to the router."""

    index: int
    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SendHandoff:
    """RLD -> MD: HANDOFF(start_index, token_ids, final, mode)."""

    start_index: int
    token_ids: tuple[int, ...]
    final: bool
    mode: str


@dataclass(frozen=True)
class StopSequence:
    """Abort the request's sequence in the local engine (frees its blocks)."""


@dataclass(frozen=True)
class FinishRequest:
    """This instance produced the request's last token: REQUEST_DONE to the router."""

    reason: str  # eos | length | stop
    num_output_tokens: int


@dataclass(frozen=True)
class CancelPeer:
    """Tell the other decode tier to drop the request (it will not be needed)."""

    reason: str


@dataclass(frozen=True)
class HandoffAbandoned:
    """RLD: the main decode tier was lost before the cut; RLD now finishes the request alone."""

    reason: str


@dataclass(frozen=True)
class HandoffStarted:
    """RLD chose how to hand over (for the timeline)."""

    mode: str
    backlog_tokens: int
    reason: str


@dataclass(frozen=True)
class StartSequence:
    """MD: the KV copy is complete; start the sequence on the reservation with the known tokens.
    ``hold``: compute but do not sample (a relay is still producing)."""

    output_token_ids: tuple[int, ...]
    hold: bool


@dataclass(frozen=True)
class SendTakeover:
    """MD -> RLD: TAKEOVER(ready_position, chunk_tokens): first the request, then progress."""

    ready_position: int
    chunk_tokens: int


@dataclass(frozen=True)
class AppendTokens:
    """MD: append handed-over token ids to the sequence (computed by extend, not sampled)."""

    token_ids: tuple[int, ...]


@dataclass(frozen=True)
class SetChunk:
    """MD: cap the tokens its sequence computes per step (None: no cap beyond the batch)."""

    max_chunk_tokens: int | None


@dataclass(frozen=True)
class ReleaseHold:
    """MD: the final cut arrived; the sequence may sample again."""


@dataclass(frozen=True)
class HandoffEnded:
    """MD applied the final HANDOFF (for the timeline): MD continues at ``next_index``."""

    mode: str
    next_index: int


@dataclass(frozen=True)
class FirstMainToken:
    """MD sampled its first token of the request (for the timeline)."""

    index: int


HandoffAction = (
    EmitTokens
    | SendHandoff
    | StopSequence
    | FinishRequest
    | CancelPeer
    | HandoffStarted
    | StartSequence
    | SendTakeover
    | AppendTokens
    | SetChunk
    | ReleaseHold
    | HandoffEnded
    | FirstMainToken
    | HandoffAbandoned
)

# MD's edits of its held sequence: a daemon applies one event's edits as ONE engine call.
SequenceEdit = AppendTokens | SetChunk | ReleaseHold


# -- the decode side (decode_request.py) ---------------------------------------------------------
# What a DecodeRequest adds to the handoff's actions: what the decode-side daemon carries out for
# one request, in order.


@dataclass(frozen=True)
class ImportChunk:
    """MD: the KV_CHUNK is this request's to import (the tcp sink checks it against the pool);
    report the bytes with ``chunk_imported``."""

    chunk_index: int


@dataclass(frozen=True)
class KvComplete:
    """The KV copy is complete (timeline rld_kv_complete / md_kv_complete)."""

    num_bytes: int


@dataclass(frozen=True)
class SendKvReceived:
    """MD -> P: KV_RECEIVED (P's goodput estimate of the WAN path)."""

    num_bytes: int
    span_bytes: int
    span_s: float


@dataclass(frozen=True)
class SendKvAbort:
    """-> P: KV_ABORT (stop sending this request's KV, free its blocks there)."""

    reason: str


@dataclass(frozen=True)
class ForwardDone:
    """MD -> RLD: the REQUEST_DONE just sent to the router (RLD drops its part)."""


@dataclass(frozen=True)
class Failed:
    """The request failed here: ERROR(code) to the router, or only a timeline note
    (md_dropped) when the router should not count it as failed (``tell_router`` False)."""

    code: str
    reason: str
    tell_router: bool = True


@dataclass(frozen=True)
class CancelParked:
    """RLD -> MD: CANCEL for a parked TAKEOVER whose request will not be allocated here."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class ArmTimer:
    """Call ``TakeoverHold.expire(request_id, token)`` after ``delay_s`` seconds."""

    request_id: str
    delay_s: float
    token: float


DecodeAction = (
    HandoffAction
    | ImportChunk
    | KvComplete
    | SendKvReceived
    | SendKvAbort
    | ForwardDone
    | Failed
    | CancelParked
    | ArmTimer
)


# -- the router's view (router_request.py) -------------------------------------------------------
# What RouterRequest asks of the router (pddnet/roles/router.py).


@dataclass(frozen=True)
class Replay:
    """Send `submit` (by token ids) to `target`; if that fails, call `replay_failed`."""

    target: str
    submit: m.Submit
    lost: str
    why: str


@dataclass(frozen=True)
class CancelAll:
    """Send CANCEL for the request to every daemon."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class TokenGaps:
    """Tokens went to the client: the gaps since the previous release (modelled seconds)."""

    gaps: tuple[float, ...]


@dataclass(frozen=True)
class Stalled:
    """The stall timer fired for the request (the last resort: counted, expected never)."""

    why: str


RouterAction = Replay | CancelAll | TokenGaps | Stalled
