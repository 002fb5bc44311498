"""The messages P sends for one request, built from its SUBMIT, its machine and the action
that asks for them: KV_ALLOC_REQUEST to a decode tier, KV_DONE after its last KV, and
PIPELINE_CHOICE / PIPELINE_CHANGE to the router. Sans-IO; the prefill daemon only posts them."""

from __future__ import annotations

from pddnet.engine.sampling import TokenLogprob
from pddnet.kv.pool import KVSpec
from pddnet.lifecycle.prefill_actions import AskAllocation
from pddnet.lifecycle.sampling import kv_done_logprob, sampling_fields
from pddnet.policy.pipeline import Pipeline
from pddnet.policy.planner import Plan
from pddnet.protocol import KvAllocRequest, KvDone, PipelineChange, PipelineChoice, Submit


def kv_alloc_request(
    sub: Submit, num_tokens: int, spec: KVSpec, ask: AskAllocation
) -> KvAllocRequest:
    """KV_ALLOC_REQUEST to ``ask.target``, naming the request's current pipeline; the
    request's sampling fields travel unchanged, so every tier samples alike."""
    return KvAllocRequest(
        request_id=sub.request_id,
        prompt_token_ids=sub.prompt_token_ids,
        num_tokens=num_tokens,
        block_size=spec.block_size,
        dtype=spec.dtype,
        num_layers=spec.num_layers,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
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
    d, x = plan.decision, plan.inputs
    return PipelineChoice(
        request_id=rid,
        pipeline=d.pipeline.wire,
        reason=d.reason[:1024],
        wan_transfer_s=d.wan_transfer_s,
        incremental_bytes=d.incremental_bytes,
        prompt_tokens=x.prompt_tokens,
        hit_tokens=x.hit_tokens,
        max_tokens=x.max_tokens,
        kv_bytes_per_token=x.kv_bytes_per_token,
        bandwidth_bps=x.bandwidth_bps,
        rtt_s=x.rtt_s,
        rld_s_per_token=x.rld_s_per_token,
        rld_admits=x.rld_admits,
        wan_backlog_bytes=x.wan_backlog_bytes,
        predicted_hit=plan.prediction.hit_tokens,
        view_stale=plan.prediction.stale,
        time=time,
    )


def pipeline_change(rid: str, pipeline: Pipeline, reason: str, time: float) -> PipelineChange:
    """PIPELINE_CHANGE to the router: the request's pipeline changed, and why."""
    return PipelineChange(request_id=rid, pipeline=pipeline.wire, reason=reason[:512], time=time)
