"""`pdd bench drc --quick` as a smoke test: it completes, writes its JSON, and its numbers agree
with each other (never with a clock)."""

from __future__ import annotations

import argparse
import json

import pytest

from pddnet.bench import drc
from pddnet.kv.radix import HIT_INTERVAL_LABELS


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
    assert data["byte_reduction"] > 2   # multi-turn traffic reuses most of each prompt
    assert sum(v["requests"] for v in data["per_interval"].values()) == data["requests"]
    assert data["md_drc_stats"]["lookups"] >= data["requests"]
