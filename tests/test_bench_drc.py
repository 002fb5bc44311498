"""`pdd bench drc --quick` as a smoke test: it completes, writes its JSON, and its numbers agree
with each other (never with a clock)."""

from __future__ import annotations

import argparse
import json

import pytest

from pddnet.bench import drc
from pddnet.kv.hit_histogram import HIT_INTERVAL_LABELS


@pytest.mark.timeout(240)
async def test_drc_quick_run_is_consistent(tmp_path):
    p = argparse.ArgumentParser()
    drc.add_arguments(p)
    args = p.parse_args(["--quick", "--wan", "proxy", "--out", str(tmp_path), "--no-progress"])
    r = await drc.run(args)
    data = json.loads(open(r["path"]).read())
    assert data["machine"]["cores"] and data["config"]["pipeline"] == "p_md"
    assert set(data["hit_distribution_measured"]) == set(HIT_INTERVAL_LABELS)
    assert abs(sum(data["hit_distribution_measured"].values()) - 1) < 1e-9
    rows = data["rows"]
    kvb = 1024  # tiny model
    for row in rows:
        # without DRC every position crosses; with it, only those past MD's hit
        assert row["bytes_no_drc"] == row["prompt_tokens"] * kvb
        assert row["bytes_drc"] == (row["prompt_tokens"] - row["hit_tokens"]) * kvb
    assert data["wan_kv_bytes_no_drc"] == sum(r["bytes_no_drc"] for r in rows)
    assert data["byte_reduction"] > 2  # multi-turn traffic reuses most of each prompt
    assert sum(v["requests"] for v in data["per_interval"].values()) == data["requests"]
    assert data["md_drc_stats"]["lookups"] >= data["requests"]
    # vLLM's serving metrics of each run, over the same requests
    for run in ("drc", "no_drc"):
        s = data["serving"][run]
        assert s["completed"] == data["requests"] and s["failed"] == 0
        assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in rows)
        assert s["output_throughput"] == s["total_output_tokens"] / s["duration"]
        assert 0 < s["median_ttft_ms"] <= s["p99_ttft_ms"] and s["median_tpot_ms"] > 0
        assert s["goodput_slos_ms"] == {"ttft": 1000.0, "tpot": 50.0}
    assert (
        data["serving"]["drc"]["total_output_tokens"]
        == data["serving"]["no_drc"]["total_output_tokens"]
    )  # greedy: the same outputs
    assert data["serving"]["drc"]["median_ttft_ms"] == pytest.approx(
        sorted_median([r["ttft_ms_drc"] for r in rows])
    )


def sorted_median(xs):
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else (xs[mid - 1] + xs[mid]) / 2
