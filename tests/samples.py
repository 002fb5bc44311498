"""Sample inputs and wire messages, written once for every test that needs one.

Each builder returns a valid value; a test passes as overrides the fields it asserts on, so
those stay visible where they are checked.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pddnet.kv.pool import KVSpec
from pddnet.lifecycle import prefill_messages
from pddnet.policy.cache_view import HitPrediction
from pddnet.policy.pipeline import PipelineInputs, PipelinePolicy
from pddnet.policy.planner import Plan
from pddnet.protocol import KvAllocRequest, KvDone, PipelineChoice, Submit

KV_SPEC = KVSpec(num_layers=4, num_kv_heads=2, head_dim=8, block_size=16, dtype="float64")


def pipeline_inputs(**over: Any) -> PipelineInputs:
    """A 4k-token uncached prompt over a 1 Gbit/s, 30 ms WAN; RLD admits."""
    fields = dict(
        prompt_tokens=4096,
        hit_tokens=0,
        max_tokens=256,
        kv_bytes_per_token=16384,
        bandwidth_bps=125e6,
        rtt_s=0.03,
        rld_s_per_token=0.02,
        rld_admits=True,
    )
    return PipelineInputs(**{**fields, **over})


def pipeline_choice(**over: Any) -> PipelineChoice:
    """PIPELINE_CHOICE as P builds it (pddnet.lifecycle.prefill_messages) for the default
    policy's decision on ``pipeline_inputs()``, P's view of MD predicting no hit."""
    inputs = pipeline_inputs()
    prediction = HitPrediction(inputs.prompt_tokens, inputs.hit_tokens, (), 16, stale=False)
    plan = Plan(PipelinePolicy().decide(inputs), inputs, prediction)
    return dataclasses.replace(prefill_messages.pipeline_choice("req-1", plan, 1.25), **over)


def kv_alloc_request(prompt: int = 40, spec: KVSpec = KV_SPEC, **over: Any) -> KvAllocRequest:
    """KV_ALLOC_REQUEST for a ``prompt``-token prompt into a pool of shape ``spec``."""
    fields = dict(
        request_id="req-1",
        prompt_token_ids=[5] * prompt,
        num_tokens=prompt,
        **dataclasses.asdict(spec),
        expected_hit_tokens=0,
        max_tokens=10,
    )
    return KvAllocRequest(**{**fields, **over})


def kv_done() -> KvDone:
    """KV_DONE as P builds it (pddnet.lifecycle.prefill_messages) after 40 positions in 3
    chunks, its first token 11 without logprobs."""
    return prefill_messages.kv_done("req-1", 40, 3, 123456, 11, None, 4.0)


def sampled_submit(**over: Any) -> Submit:
    """A SUBMIT that sets every sampling field away from its default, so a test sees each one
    travel."""
    fields = dict(
        request_id="cmpl-abc",
        prompt_token_ids=list(range(300)),
        max_tokens=64,
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        seed=2**63,
        stop_token_ids=[2, 5],
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        logprobs=3,
        handoff_mode="streaming",
    )
    return Submit(**{**fields, **over})
