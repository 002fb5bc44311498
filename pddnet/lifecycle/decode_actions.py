"""The actions a DecodeRequest adds to pddnet.lifecycle.handoff's (EmitTokens, StartSequence,
FinishRequest...): what the decode-side daemon carries out for one request, in order."""

from __future__ import annotations

from dataclasses import dataclass

from pddnet.lifecycle.handoff import Action


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
    Action
    | ImportChunk
    | KvComplete
    | SendKvReceived
    | SendKvAbort
    | ForwardDone
    | Failed
    | CancelParked
    | ArmTimer
)
