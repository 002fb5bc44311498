"""`pdd sim reproduce --quick`: the source report's shapes at small scale."""

from pddnet.sim.reproduce import reproduce


def test_quick_reproduce_shows_the_source_shapes():
    r = reproduce(quick=True)
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
