"""P's pipeline planner (sans-IO): decisions from P's view of MD and its WAN estimates."""

from __future__ import annotations

import pytest

from pddnet.kv.block_hash import chained_hashes
from pddnet.policy.pipeline import Pipeline, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner
from pddnet.protocol import CacheEvents

KVB = 1024  # bytes per token
BW = 1_000_000.0  # 1 MB/s: 1000 tokens take 1 s


def planner(**policy) -> PipelinePlanner:
    return PipelinePlanner(
        PipelinePolicy(**policy), KVB, bandwidth_bps=BW, rtt_s=0.02, rld_step_s=0.01
    )


def teach(p: PipelinePlanner, tokens: list[int], bs: int = 16) -> None:
    p.view.apply(
        CacheEvents(
            seq=p.view.next_seq,
            block_size=bs,
            inserted=tuple(chained_hashes(tokens, bs)),
            evicted=(),
        )
    )


def test_high_hit_goes_direct_low_hit_through_the_relay_short_output_stays_on_rld():
    p = planner(direct_budget_s=0.2)
    prompt = list(range(1, 2001))
    teach(p, prompt[:1984])
    high = p.plan(prompt + [7] * 30, max_tokens=200)
    assert high.pipeline is Pipeline.P_MD and high.prediction.hit_tokens == 1984
    low = p.plan([9] * 2000, max_tokens=300)  # 2 s of KV, RLD needs 3 s for 300
    assert low.pipeline is Pipeline.P_RLD_MD
    short = p.plan([9] * 2000, max_tokens=4)  # RLD done in 40 ms
    assert short.pipeline is Pipeline.RLD_ONLY
    assert p.chosen == {"p_md": 1, "p_rld_md": 1, "p_rld": 1}
    rec = high.record()
    assert rec["pipeline"] == "p_md" and rec["predicted_hit_tokens"] == 1984
    assert rec["inputs"]["bandwidth_bps"] == BW


def test_forced_pipeline_is_recorded_as_configured():
    plan = planner().plan([1] * 50, 10, force=Pipeline.P_RLD_MD)
    assert plan.pipeline is Pipeline.P_RLD_MD and "configured" in plan.decision.reason


def test_mds_answer_repairs_the_view_and_may_make_the_request_singular():
    p = planner(direct_budget_s=0.2)
    prompt = list(range(1, 3001))
    teach(p, prompt)
    plan = p.plan(prompt + [5] * 40, max_tokens=150)  # believed cached: P->MD
    assert plan.pipeline is Pipeline.P_MD
    seen = p.md_answered(plan, 0, 16)  # MD evicted it all
    assert seen.wrong and seen.error_tokens == plan.prediction.hit_tokens
    assert p.view.predict(prompt + [5] * 40).hit_tokens == 0  # repaired
    assert p.recheck(plan, 0) is None  # P->MD never gains a relay
    relayed = p.plan([3] * 3000, max_tokens=400, force=Pipeline.P_RLD_MD)
    assert p.recheck(relayed, 0) is None  # same hit as planned: unchanged
    teach(p, [3] * 2992)
    believed = p.plan([3] * 3000, max_tokens=400)  # hit ~all: P->MD, not rechecked
    assert believed.pipeline is Pipeline.P_MD
    # planned through the relay on a believed hit; MD holds nothing: 3 s of KV vs 4 s of RLD
    # decode still needs MD, but a 100-token output (1 s on RLD) becomes RLD-only.
    plan2 = p.plan([3] * 2992 + [8] * 400, max_tokens=100, force=Pipeline.P_RLD_MD)
    changed = p.recheck(plan2, 0)
    assert changed is not None and changed.pipeline is Pipeline.RLD_ONLY
    assert p.changed_after_answer == 1


def test_estimators_feed_the_next_decision():
    p = planner(direct_budget_s=0.2)
    assert p.plan([1] * 500, 10).pipeline is not Pipeline.P_MD  # 0.5 s at 1 MB/s
    for _ in range(40):
        p.observe_transfer(8 << 20, 0.1)  # 80 MB/s observed
    assert p.plan([1] * 500, 10).pipeline is Pipeline.P_MD
    p.observe_rtt(0.5)
    assert p.rtt.srtt > 0.02
    p.observe_rld_step(0.0)  # unknown: ignored
    assert p.rld_step_s == 0.01
    counters = p.counters()
    assert counters["bandwidth_samples"] == 40 and counters["rtt_samples"] == 1


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        PipelinePlanner(PipelinePolicy(), 0, 1.0)
    with pytest.raises(ValueError, match="rld_step_s"):
        PipelinePlanner(PipelinePolicy(), 1, 1.0, rld_step_s=0)


def test_queueing_on_the_wan_does_not_inflate_the_transfer_estimate():
    p = planner(direct_budget_s=0.2)
    p.observe_rtt(0.02)
    for _ in range(5):
        p.observe_rtt(0.45)  # PINGs stuck behind a bulk transfer in the bottleneck queue
    assert p.rtt.srtt > 0.1 and p.rtt.min_s == 0.02
    assert p.plan([1] * 40, 10).pipeline is Pipeline.P_MD  # 40 KB: 20 ms + 40 ms


def test_the_planner_counts_ps_unacknowledged_wan_bytes():
    # 1000 tokens/s; budget 0.2 s. 150 uncached tokens: 20 ms + 150 ms alone -> direct.
    p = planner(direct_budget_s=0.2)
    assert p.plan([4] * 150, 10).pipeline is Pipeline.P_MD
    p.wan_committed("a", 40 * KVB)  # MD answered a: 40 tokens will cross
    p.wan_committed("b", 10 * KVB)
    assert p.backlog.bytes == 50 * KVB and p.counters()["wan_backlog_requests"] == 2
    behind = p.plan([4] * 150, 10)  # 20 + 50 + 150 ms = 220 ms
    assert behind.pipeline is not Pipeline.P_MD
    assert behind.inputs.wan_backlog_bytes == 50 * KVB
    assert behind.decision.wan_transfer_s == pytest.approx(0.02 + 200 * KVB / BW)
    assert behind.record()["wan_backlog_bytes"] == 50 * KVB
    assert p.wan_released("a") == 40 * KVB
    assert p.wan_released("a") == 0  # twice, or never committed: nothing
    assert p.wan_released("zzz") == 0
    p.wan_committed("b", 5 * KVB)  # a new commitment replaces the old one
    assert p.backlog.bytes == 5 * KVB
    assert p.plan([4] * 150, 10).pipeline is Pipeline.P_MD  # 175 ms
    p.wan_released("b")
    assert p.backlog.bytes == 0 and p.backlog.pending == 0
    p.wan_committed("c", 0)  # nothing to cross (all cached): not pending
    assert "c" not in p.backlog and p.backlog.pending == 0


def test_a_precomputed_prediction_plans_like_plan():
    p, q = planner(), planner()
    prompt = list(range(1, 2001))
    teach(p, prompt[:1984])
    teach(q, prompt[:1984])
    a = p.plan(prompt + [7] * 30, max_tokens=200)
    pred = q.view.predict(prompt + [7] * 30)
    b = q.plan_predicted(2030, pred, max_tokens=200)
    assert a.decision == b.decision and a.inputs == b.inputs and p.chosen == q.chosen
    # a hit given in tokens where the view counts in other units (the simulator's)
    c = q.plan_predicted(2030, pred, max_tokens=200, hit_tokens=0)
    assert c.inputs.hit_tokens == 0 and c.prediction is pred


def test_estimators_and_backlog_may_be_shared():
    from pddnet.policy.estimators import BandwidthEstimator, RttEstimator, WanBacklog

    bw, rtt, backlog = BandwidthEstimator(BW), RttEstimator(0.02), WanBacklog()
    one = PipelinePlanner(PipelinePolicy(), KVB, BW, bandwidth=bw, rtt=rtt, backlog=backlog)
    two = PipelinePlanner(PipelinePolicy(), KVB, BW, bandwidth=bw, rtt=rtt, backlog=backlog)
    one.observe_transfer(8 << 20, 1.0)
    one.observe_rtt(0.005)
    one.wan_committed("x", 1000)
    assert two.bandwidth.bytes_per_s == one.bandwidth.bytes_per_s != BW
    assert two.rtt.min_s == 0.005 and two.backlog.bytes == 1000
