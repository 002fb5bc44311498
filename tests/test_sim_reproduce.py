"""`pdd sim reproduce --quick`: the source report's shapes at small scale."""

import pytest

from pddnet.sim.reproduce import reproduce


@pytest.fixture(scope="module")
def quick():
    return reproduce(quick=True)


def test_quick_reproduce_shows_the_source_shapes(quick):
    r = quick
    o = r["ours"]
    # naive cross-DC: the P99 TTFT blows up against same-DC; PDD stays near the baseline
    assert o["naive_cross_dc_vs_baseline"]["ttft_p99_x"] >= 2.0
    assert o["pdd_vs_baseline"]["ttft_p99_x"] <= 1.2
    # the DRC: a skewed ~90% hit cuts the WAN bytes by >= 5x
    assert o["decode_side_hit_ratio"] > 0.8
    assert o["drc_bandwidth_cut"] >= 5.0
    # RLD makes a small share of the tokens, MD the rest
    assert 0 < o["rld_token_share"] < 0.2
    # the planner's mixed A+B PDD deployment beats the all-A baseline on goodput per dollar
    assert o["cost_table"]["bcr_x"] > 1.0
    assert set(o["cost_table"]["pdd"]["gpus"]) == {"gpu-a", "gpu-b"}
    assert set(o["cost_table"]["baseline"]["gpus"]) == {"gpu-a"}
    assert all(r["checks"].values())


def test_quick_reproduce_compares_at_equal_offered_load(quick):
    # Why the shapes above are not a knife edge: every system is offered the baseline's send
    # times, so P (the same pool in every system) sees the same requests at the same times and
    # computes the same prefills; PDD's first token differs from the baseline's only by what
    # happens after its prefill (RDMA to RLD, or a short direct WAN transfer). Only the few
    # turns PDD finished later than the baseline (and so had to wait) move P's schedule.
    s = quick["systems"]
    base, pdd = s["same-dc"], s["pdd"]
    assert base["arrivals"] == "baseline"
    assert pdd["offered_rps"] == base["offered_rps"]
    assert pdd["prefix"]["p_hit_tokens"] == pytest.approx(base["prefix"]["p_hit_tokens"],
                                                          rel=0.02)
    assert pdd["deferred_turns"] <= 0.1 * pdd["requests"]
    # the naive system is slower than the baseline, so some of its turns wait: it is offered
    # at most the baseline's load, which can only understate its blow-up
    assert s["cross-dc"]["offered_rps"] <= base["offered_rps"]
