"""The actions P's request machine (prefill_request.py) gives out, for the prefill daemon to carry
out in order: allocations to ask, KV to ship, KV_DONE, aborts, the release of P's blocks, what
the router and P's planner are told."""

from __future__ import annotations

from dataclasses import dataclass

from pddnet.policy.pipeline import Pipeline
from pddnet.policy.planner import Plan


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


Action = (
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
