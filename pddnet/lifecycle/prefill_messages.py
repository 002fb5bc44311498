"""The messages P sends for one request, built from its SUBMIT, its machine and the action
that asks for them: KV_ALLOC_REQUEST to a decode tier, KV_DONE after its last KV, and
PIPELINE_CHOICE / PIPELINE_CHANGE to the router. Sans-IO; the prefill daemon only posts them."""

from __future__ import annotations

import dataclasses

from pddnet.engine.sampling import TokenLogprob
from pddnet.kv.pool import KVSpec
from pddnet.lifecycle.actions import AskAllocation
from pddnet.lifecycle.sampling import kv_done_logprob, sampling_fields
from pddnet.policy.pipeline import Pipeline
from pddnet.policy.planner import Plan
from pddnet.protocol import KvAllocRequest, KvDone, PipelineChange, PipelineChoice, Submit


def kv_alloc_request(
    sub: Submit, num_tokens: int, spec: KVSpec, ask: AskAllocation
) -> KvAllocRequest:
    """KV_ALLOC_REQUEST to ``ask.target``, naming the request's current pipeline, with P's
    KVSpec as it is; the request's sampling fields travel unchanged, so every tier samples
    alike."""
    return KvAllocRequest(
        request_id=sub.request_id,
        prompt_token_ids=sub.prompt_token_ids,
        num_tokens=num_tokens,
        **dataclasses.asdict(spec),
        expected_hit_tokens=ask.expected_hit_tokens,
        pipeline=ask.pipeline.wire,
        handoff_mode=sub.handoff_mode,
        **sampling_fields(sub),
    )


def kv_done(
    rid: str,
    num_tokens: int,
    num_chunks: int,
    num_bytes: int,
    first_token: int,
    first_logprob: TokenLogprob | None,
    time: float,
) -> KvDone:
    """KV_DONE: what went to the target (0 chunks and bytes when all of it was cached there)
    and the first token P sampled, with its logprobs when the request asks for them."""
    return KvDone(
        request_id=rid,
        num_tokens=num_tokens,
        num_chunks=num_chunks,
        num_bytes=num_bytes,
        first_token_id=first_token,
        time=time,
        **kv_done_logprob(first_logprob),
    )


def pipeline_choice(rid: str, plan: Plan, time: float) -> PipelineChoice:
    """P's decision and every input of it, as the router's `pdd` object shows them."""
    d = plan.decision
    return PipelineChoice(
        request_id=rid,
        pipeline=d.pipeline.wire,
        reason=d.reason[:1024],
        wan_transfer_s=d.wan_transfer_s,
        incremental_bytes=d.incremental_bytes,
        **dataclasses.asdict(plan.inputs),  # every PipelineInputs field, under its own name
        predicted_hit=plan.prediction.hit_tokens,
        view_stale=plan.prediction.stale,
        time=time,
    )


def pipeline_change(rid: str, pipeline: Pipeline, reason: str, time: float) -> PipelineChange:
    """PIPELINE_CHANGE to the router: the request's pipeline changed, and why."""
    return PipelineChange(request_id=rid, pipeline=pipeline.wire, reason=reason[:512], time=time)
