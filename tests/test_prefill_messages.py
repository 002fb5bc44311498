"""The messages P builds for one request (pddnet.lifecycle.prefill_messages), sans-IO: what the
decode tiers and the router receive, checked through the wire codec."""

from __future__ import annotations

import dataclasses

from pddnet.engine.sampling import TokenLogprob
from pddnet.kv.pool import KVSpec
from pddnet.lifecycle.actions import AskAllocation
from pddnet.lifecycle.prefill_messages import (
    kv_alloc_request,
    kv_done,
    pipeline_change,
    pipeline_choice,
)
from pddnet.lifecycle.sampling import sampling_of
from pddnet.policy.pipeline import Pipeline, PipelineInputs, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner
from pddnet.protocol import decode_bytes, encode_bytes
from pddnet.protocol.messages import SAMPLING_FIELD_NAMES
from tests.samples import sampled_submit


def wire(msg):
    """The message as its receiver decodes it."""
    return decode_bytes(encode_bytes(msg))


def test_kv_alloc_request_carries_the_submit_sampling_and_the_pool_shape():
    sub = sampled_submit(
        request_id="r1", prompt_token_ids=list(range(5, 45)), handoff_mode="streaming"
    )
    spec = KVSpec(num_layers=2, num_kv_heads=3, head_dim=8, block_size=16, dtype="float32")
    ask = AskAllocation("main_decode", Pipeline.P_RLD_MD, expected_hit_tokens=16)
    got = wire(kv_alloc_request(sub, 40, spec, ask))
    assert (got.request_id, tuple(got.prompt_token_ids)) == ("r1", tuple(range(5, 45)))
    assert got.num_tokens == 40
    assert (got.num_layers, got.num_kv_heads, got.head_dim, got.block_size) == (2, 3, 8, 16)
    assert got.dtype == "float32"
    assert (got.expected_hit_tokens, got.pipeline) == (16, "p_rld_md")
    assert got.handoff_mode == "streaming"
    defaults = {f.name: f.default for f in dataclasses.fields(sub)}
    for name in SAMPLING_FIELD_NAMES:  # every tier samples alike
        assert getattr(sub, name) != defaults[name], f"the sample leaves {name} at its default"
        assert getattr(got, name) == getattr(sub, name), name
    assert sampling_of(got) == sampling_of(sub)


def test_kv_done_carries_the_first_token_and_its_logprobs_only_when_asked():
    plain = wire(kv_done("r1", 40, 3, 4096, 17, None, 12.5))
    assert (plain.num_tokens, plain.num_chunks, plain.num_bytes) == (40, 3, 4096)
    assert (plain.first_token_id, plain.time) == (17, 12.5)
    assert plain.first_logprob is None
    entry = TokenLogprob(17, -0.25, (17, 4), (-0.25, -1.5))
    with_lp = wire(kv_done("r1", 40, 0, 0, 17, entry, 12.5))
    assert with_lp.first_logprob == -0.25
    assert tuple(with_lp.first_top_ids) == (17, 4)
    assert tuple(with_lp.first_top_logprobs) == (-0.25, -1.5)


def test_pipeline_change_names_the_new_pipeline_and_bounds_the_reason():
    got = wire(pipeline_change("r1", Pipeline.RLD_ONLY, "x" * 2000, 3.0))
    assert got.pipeline == Pipeline.RLD_ONLY.wire
    assert got.reason == "x" * 512


def test_pipeline_choice_carries_the_decision_and_every_input_of_it():
    planner = PipelinePlanner(PipelinePolicy(), 1024, bandwidth_bps=1e6, rtt_s=0.02)
    plan = planner.plan([1] * 40, 10, force=Pipeline.P_RLD_MD)
    got = wire(pipeline_choice("r1", plan, 2.5))
    assert (got.request_id, got.pipeline, got.time) == ("r1", "p_rld_md", 2.5)
    assert got.reason == plan.decision.reason
    for f in dataclasses.fields(PipelineInputs):
        assert getattr(got, f.name) == getattr(plan.inputs, f.name), f.name
    assert (got.predicted_hit, got.view_stale) == (plan.prediction.hit_tokens, False)
