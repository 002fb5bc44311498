"""The `pdd` object: how one request was served, as typed fields, and its JSON.

The router's request machine (router_request.py) fills `Served` from the daemons' messages as they
come (each figure on the milestone it belongs to) and renders a `Pdd` at the end. The JSON of a
`Pdd` is what every completion carries under "pdd": tests, benchmarks and traces read it, so its
keys, their order and their values are a contract.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from pddnet.lifecycle.assembler import StreamAssembler
from pddnet.protocol import messages as m

# What P's PIPELINE_CHOICE reports as the inputs of its decision, by name.
DECISION_INPUTS = (
    "prompt_tokens",
    "hit_tokens",
    "max_tokens",
    "kv_bytes_per_token",
    "bandwidth_bps",
    "rtt_s",
    "rld_s_per_token",
    "rld_admits",
    "wan_backlog_bytes",
)


def pipeline_record(msg: m.PipelineChoice) -> dict[str, Any]:
    """P's decision and its inputs as the `pdd` object's `pipeline_decision`."""
    return {
        "pipeline": msg.pipeline,
        "reason": msg.reason,
        "estimated_wan_transfer_s": round(msg.wan_transfer_s, 6),
        "incremental_kv_bytes": msg.incremental_bytes,
        "wan_backlog_bytes": msg.wan_backlog_bytes,
        "inputs": {k: getattr(msg, k) for k in DECISION_INPUTS},
        "predicted_hit_tokens": msg.predicted_hit,
        "view_stale": msg.view_stale,
    }


@dataclass(frozen=True)
class Event:
    """One milestone of the request's timeline (`time` on the router's clock)."""

    event: str
    time: float
    producer: str
    detail: Any = None


@dataclass
class Served:
    """What the daemons reported about how the request is served (None: not reported yet)."""

    pipeline: str | None = None
    decision: m.PipelineChoice | None = None  # P's PIPELINE_CHOICE
    changes: list[m.PipelineChange] = field(default_factory=list)  # P's PIPELINE_CHANGEs
    handoff_mode: str | None = None
    transport: dict[str, str] = field(default_factory=dict)  # KV path -> backend
    wan_kv_bytes: int | None = None  # MD's count (authoritative) or else P's
    handoff_bytes: int = 0
    prefix_hit_tokens: int = 0

    def record(self, event: str, number: int | None, label: str | None) -> None:
        """The figures riding on a TIMELINE milestone (its detail_int and detail_str)."""
        if event == "prefill_start" and label and self.pipeline is None:
            self.pipeline = label  # P's PIPELINE_CHOICE, when it came first, stays
        elif event in ("handoff_start", "handoff_end") and label:
            self.handoff_mode = label
        elif event == "kv_transport" and label and "=" in label:
            path, _, backend = label.partition("=")  # e.g. "relay=mooncake"
            self.transport[path] = backend
        if number is None:
            return
        if event == "handoff_end":
            self.handoff_bytes = number
        elif event == "md_kv_complete":
            self.wan_kv_bytes = number  # what MD received: authoritative
        elif event == "wan_kv_sent" and self.wan_kv_bytes is None:
            self.wan_kv_bytes = number
        elif event == "prefix_hit_tokens":
            self.prefix_hit_tokens = number


@dataclass(frozen=True)
class RouterFacts:
    """What the pdd object reports of the router itself (the same for every request)."""

    mode: str
    default_pipeline: str  # the mode's pipeline, until P reports its choice
    dilation: float = 1.0  # reported times are the modelled world's: router times / dilation
    wire_scale: float = 1.0  # real WAN bytes per byte of the target model's KV
    emulation: dict[str, Any] | None = None


@dataclass
class Pdd:
    """The `pdd` object. Field order is the JSON key order."""

    request_id: str
    mode: str
    seed: int | None
    ttft_s: float | None
    emulation: dict[str, Any] | None
    pipeline: str
    handoff_mode: str | None
    relay_tokens: int
    main_tokens: int
    prefill_tokens: int
    wan_kv_bytes: int
    target_wan_kv_bytes: int  # the target model's KV bytes those real bytes stand for
    handoff_bytes: int
    prefix_hit_tokens: int
    replays: int
    transport: dict[str, str]
    pipeline_decision: dict[str, Any] | None
    pipeline_changes: list[dict[str, str]]
    finish_reason: str | None
    warnings: list[str]
    timeline: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_pdd(
    facts: RouterFacts,
    request_id: str,
    seed: int | None,
    arrival: float,
    served: Served,
    assembler: StreamAssembler,
    replays: int,
    timeline: list[Event],
) -> Pdd:
    k = facts.dilation
    wan = served.wan_kv_bytes or 0
    first_token_time = assembler.first_token_time
    tokens_by_producer = assembler.counts_by_producer()
    return Pdd(
        request_id=request_id,
        mode=facts.mode,
        seed=seed,
        ttft_s=None if first_token_time is None else (first_token_time - arrival) / k,
        emulation=facts.emulation,
        pipeline=facts.default_pipeline if served.pipeline is None else served.pipeline,
        handoff_mode=served.handoff_mode,
        relay_tokens=tokens_by_producer.get("relay", 0),
        main_tokens=tokens_by_producer.get("main_decode", 0),
        prefill_tokens=tokens_by_producer.get("prefill", 0),
        wan_kv_bytes=wan,
        target_wan_kv_bytes=round(wan / facts.wire_scale),
        handoff_bytes=served.handoff_bytes,
        prefix_hit_tokens=served.prefix_hit_tokens,
        replays=replays,
        transport=dict(served.transport),
        pipeline_decision=None if served.decision is None else pipeline_record(served.decision),
        pipeline_changes=[{"pipeline": c.pipeline, "reason": c.reason} for c in served.changes],
        finish_reason=assembler.finish_reason,
        warnings=list(assembler.warnings),
        timeline=[
            {**dataclasses.asdict(e), "t_s": (e.time - arrival) / k}
            for e in sorted(timeline, key=lambda e: e.time)
        ],
    )
