"""`pdd sim reproduce --quick`: the source report's shapes at small scale."""

import pytest

from pddnet.sim.reproduce import reproduce


@pytest.fixture(scope="module")
def quick():
    # two processes: the path `pdd sim reproduce` takes by default on this 2-core machine
    return reproduce(quick=True, jobs=2)


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
    assert pdd["prefix"]["p_hit_tokens"] == pytest.approx(base["prefix"]["p_hit_tokens"], rel=0.02)
    assert pdd["deferred_turns"] <= 0.1 * pdd["requests"]
    # the naive system is slower than the baseline, so some of its turns wait: it is offered
    # at most the baseline's load, which can only understate its blow-up
    assert s["cross-dc"]["offered_rps"] <= base["offered_rps"]


def test_quick_reproduce_prints_ours_beside_the_source(quick, capsys):
    from pddnet.sim.reproduce import print_report

    rows = {row["figure"]: row for row in quick["table"]}
    for fig in (
        "naive cross-DC TTFT",
        "PDD TTFT",
        "RLD share of output tokens",
        "DRC bandwidth cut",
        "cost table: planner's best BCR",
    ):
        row = rows[fig]
        assert row["ours"] and row["source"] and row["why"]
    # the "holds" column says what the checks say, never a fixed "yes"
    checks = quick["checks"]
    assert rows["naive cross-DC TTFT"]["holds"].startswith(
        "yes" if checks["naive cross-DC P99 TTFT >= 2x baseline"] else "NO"
    )
    assert rows["DRC bandwidth cut"]["holds"].startswith(
        "yes" if checks["DRC cuts WAN KV bytes >= 5x"] else "NO"
    )
    # the cost note derives the source's cost ratio from our chip prices (43 A + 32 B vs 88 A)
    chips = quick["ours"]["chips"]
    a, b = chips["gpu-a"]["price_per_hour"], chips["gpu-b"]["price_per_hour"]
    want = (43 * a + 32 * b) / (88 * a)
    assert f"{(want - 1) * 100:+.1f}%" in rows["cost table: planner's best BCR"]["why"]
    # the quick grid does not hold the source's sizes, so there is no like-for-like row
    assert quick["ours"]["cost_table"]["at_source_sizes"] is None
    print_report(quick)
    out = capsys.readouterr().out
    assert "ours" in out and "source" in out and "shape holds?" in out
    assert out.count("[ok]") + out.count("[FAIL]") == len(checks)


def test_capacity_search_rejects_a_bad_bracket():
    from pddnet.sim.plan import capacity
    from pddnet.sim.reproduce import plan_config

    cfg = plan_config(quick=True)
    with pytest.raises(ValueError, match="factor"):
        capacity(cfg, "same-dc", factor=1.0)
    with pytest.raises(ValueError, match="outside"):
        capacity(cfg, "same-dc", start=40.0)


def test_full_scenario_is_the_source_setting():
    # The full run's deployments are the source's GPU counts, its planner grid contains them,
    # and its workload is long-context agent traffic (checked without running it).
    from pddnet.sim.config import parse_config
    from pddnet.sim.reproduce import SOURCE, SOURCE_SIZES, plan_ranges, scenario

    cfg = parse_config(scenario(quick=False))
    assert cfg.baseline.gpus_by_chip() == SOURCE["pools"]["same-dc"]
    assert cfg.pdd.gpus_by_chip() == SOURCE["pools"]["pdd"]
    ranges = plan_ranges(quick=False)
    for system, sizes in SOURCE_SIZES.items():
        assert all(n in axis for n, axis in zip(sizes, ranges[system], strict=True))
    assert cfg.workload.agent["max_context"] >= 65536
    assert cfg.workload.agent["output_len"][1] >= 1024
