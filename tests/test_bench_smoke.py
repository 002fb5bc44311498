"""Every benchmark and the demo, run with --quick through the `pdd` argument tree: each
completes, writes its JSON (configuration + machine) and PNGs, and its numbers are consistent
with each other (never with wall-clock expectations)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pddnet.bench.cli import BENCHES, register
from pddnet.model.config import PRESETS
from pddnet.obs.metrics import registry_for, render


def pdd(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdd")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


def only_result(folder: Path) -> dict:
    (path,) = [p for p in folder.glob("*.json") if not p.name.endswith(".trace.json")]
    data = json.loads(path.read_text())
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"]
    assert data["threads_per_daemon"] == 1 and data["config"]["quick"] is True
    return data


def test_bench_listing_and_bad_names(capsys):
    assert pdd("bench") == 0
    out = capsys.readouterr().out
    assert all(name in out for name in BENCHES)
    assert pdd("bench", "nope") == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err


def test_ttft_quick(tmp_path, capsys):
    assert pdd("bench", "ttft", "--quick", "--no-progress", "--trace", "--out",
               str(tmp_path)) == 0
    data = only_result(tmp_path / "ttft")
    assert set(data["workloads"]) == {"long", "agent"}
    for workload, modes in data["workloads"].items():
        assert set(modes) == {"same-dc", "cross-dc", "pdd"}
        for mode, s in modes.items():
            assert s["completed"] == s["requests"] > 0, (workload, mode, s["errors"])
            assert sum(s["token_share"].values()) == pytest.approx(1.0)
            assert s["output_tokens"] == s["client_tokens"]       # every token attributed
            assert 0 <= s["sla"]["met"] <= s["requests"]
            assert s["ttft_s"]["p50"] <= s["ttft_s"]["p99"]
        assert modes["same-dc"]["token_share"]["main_decode"] == 0   # no MD in same-dc
        assert modes["cross-dc"]["token_share"]["relay"] == 0        # no RLD in cross-dc
        assert modes["same-dc"]["md_wan_bytes"] == 0
        assert modes["cross-dc"]["md_wan_bytes"] >= modes["cross-dc"]["wan_kv_bytes"] > 0
        assert set(data["ratios"][workload]) == {"pdd/same-dc", "cross-dc/same-dc",
                                                  "pdd/cross-dc"}
    pngs = sorted(p.name.split("-", 2)[-1] for p in (tmp_path / "ttft").glob("*.png"))
    assert pngs == ["agent-ttft-cdf.png", "long-ttft-cdf.png"]
    assert len(list((tmp_path / "ttft").glob("*.trace.json"))) == 6

    # `pdd trace` finds any request of the run by id, and the trace has the daemons' tracks
    row = next(r for r in data["requests"]["pdd"] if r["pdd"].get("relay_tokens"))
    rid = row["pdd"]["request_id"]
    out = tmp_path / "one.json"
    assert pdd("trace", rid, "--in", str(tmp_path), "-o", str(out)) == 0
    trace = json.loads(out.read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert {"router", "P", "RLD", "client"} <= tracks
    assert pdd("trace", "cmpl-missing", "--in", str(tmp_path)) == 1

    # the real daemons' stats() of this run translate into metrics for every daemon
    for mode, per_role in data["daemon_stats"].items():
        for role, stats in per_role.items():
            if role == "router":   # it has its own RouterMetrics; no KV pool
                continue
            text = render(registry_for(lambda s=stats: s))[0].decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            blocks = {s.labels["state"]: s.value for s in families["pdd_kv_blocks"].samples}
            assert blocks["used"] + blocks["free"] == stats["kv_blocks"]["total"], (mode, role)
            assert blocks["used"] == 0, (mode, role)    # nothing leaked after the run


def test_handoff_mode_quick(tmp_path):
    assert pdd("bench", "handoff-mode", "--quick", "--no-progress", "--out",
               str(tmp_path)) == 0
    data = only_result(tmp_path / "handoff-mode")
    c = data["consistency"]
    assert c["errors"] == [] and c["tokens_complete"]
    assert c["streaming_extend_within_chunk"]                  # MD never extends > chunk
    rows = [r for r in data["requests"] if r["handed_off"]]
    assert rows, "no request was handed over to MD"
    kv_per_token = PRESETS["tiny"].kv_bytes_per_token
    for r in rows:
        assert r["relay_tokens"] + r["main_tokens"] == r["max_tokens"]
        assert r["relay_tokens"] >= r["backlog"] >= 1
        if r["mode"] != "dynamic":
            assert r["mode_used"] == r["mode"]
        else:
            assert r["mode_used"] in ("one-shot", "streaming")
        # a token-id handoff is tiny next to the KV of the tokens it stands for
        assert 0 < r["handoff_bytes"] < r["relay_tokens"] * kv_per_token
        assert r["stall_s"] >= 0 and r["rld_occupancy_token_s"] > 0
    one_shot = [r for r in rows if r["mode_used"] == "one-shot"]
    if one_shot:   # one-shot hands everything over in one HANDOFF: MD extends it in one step
        assert c["md_max_extend_tokens"]["one-shot"] >= min(r["relay_tokens"] for r in one_shot)
    assert set(data["by_mode"]) == {"one-shot", "streaming", "dynamic"}
    assert len(list((tmp_path / "handoff-mode").glob("*.png"))) == 1


def test_transport_quick(tmp_path):
    assert pdd("bench", "transport", "--quick", "--no-progress", "--out", str(tmp_path)) == 0
    data = only_result(tmp_path / "transport")
    shm = data["shm"]
    assert shm["read_back_exact"]
    assert shm["bytes"] == shm["tokens"] * PRESETS["tiny"].kv_bytes_per_token
    for w in data["wan"]:
        assert 0 < w["bytes_received"] <= w["bytes_sent"]
    d = data["decode"]
    assert d["tokens_identical"]          # the daemon path yields the reference's tokens
    assert d["daemon"]["tokens"] == d["reference"]["tokens"] == d["requests"] * d["max_tokens"]
    assert len(list((tmp_path / "transport").glob("*.png"))) == 1
    assert not [p for p in Path("/dev/shm").glob("pdd-bench-*")]


def test_demo_quick(tmp_path, capsys):
    assert pdd("demo", "--quick", "--no-progress", "--out", str(tmp_path)) == 0
    out = capsys.readouterr().out
    (folder,) = (tmp_path / "demo").iterdir()
    assert f"results and plots in {folder}/" in out
    data = json.loads((folder / "result.json").read_text())
    assert data["machine"]["cores"] >= 1 and data["threads_per_daemon"] == 1
    assert set(data["modes"]) == {"pdd", "cross-dc", "same-dc"}
    for mode, s in data["modes"].items():
        assert s["completed"] == s["requests"] > 0, (mode, s["errors"])
        assert sum(s["token_share"].values()) == pytest.approx(1.0)
    assert data["config"]["wan_shell"]["same-dc"] in (None, "none")   # no WAN at all
    assert data["config"]["wan_shell"]["pdd"] in ("kernel", "packet", "proxy")
    assert {"ttft-cdf.png", "token-share.png", "wan-bytes.png"} <= {
        p.name for p in folder.glob("*.png")}


# -- the pure measurement functions the benchmarks rest on ----------------------------------


def record(times: list[float], pdd_obj: dict, sent_at: float = 0.0):
    from pddnet.bench.client import StreamRecord

    return StreamRecord(sent_at=sent_at, first_token_at=times[0], token_times=times,
                        token_ids=list(range(len(times))), pdd=pdd_obj)


def test_handoff_metrics_stall_occupancy_and_duration():
    from pddnet.bench.handoff_mode import handoff_metrics, rate_for_backlog

    # RLD makes tokens 0..3 every 10 ms from t=1.0, TAKEOVER at backlog 3, the cut after
    # token 3; MD's first token (index 4) comes 50 ms later, then every 10 ms.
    times = [1.00, 1.01, 1.02, 1.03, 1.08, 1.09, 1.10]
    pdd_obj = {"relay_tokens": 4, "main_tokens": 3, "handoff_mode": "one-shot",
               "timeline": [{"event": "rld_kv_complete", "time": 0.99, "producer": "relay"},
                            {"event": "handoff_start", "time": 1.025, "producer": "relay",
                             "detail": {"value": 3, "label": "one-shot"}},
                            {"event": "first_md_token", "time": 1.075,
                             "producer": "main_decode"}]}
    m = handoff_metrics(record(times, pdd_obj), prompt_len=100)
    assert m["backlog"] == 3 and m["handed_off"]
    assert m["stall_s"] == pytest.approx(0.05)
    assert m["handoff_s"] == pytest.approx(0.05)
    # held 100 tokens 0.99 -> 1.00, then 101, 102, 103 for 10 ms each
    assert m["rld_occupancy_token_s"] == pytest.approx(100 * 0.01 + (101 + 102 + 103) * 0.01)
    assert rate_for_backlog(8, 10, 0.01, 10**6, 1e4) is None       # reached anyway
    assert rate_for_backlog(110, 10, 0.01, 10**6, 1e4) == pytest.approx(8.0)   # 1 MB in 1 s
    assert rate_for_backlog(11, 10, 0.001, 10**9, 100.0) == 100.0  # capped


def test_mode_summary_shares_and_sla():
    from pddnet.bench.ttft import mode_summary, tpot_s

    fast = record([0.1, 0.11, 0.12], {"relay_tokens": 1, "main_tokens": 2})
    slow = record([2.0, 2.2], {"relay_tokens": 2})
    assert tpot_s(fast) == pytest.approx(0.01) and tpot_s(slow) == pytest.approx(0.2)
    s = mode_summary([fast, slow], sla_ttft_s=1.0, sla_tpot_s=0.05, makespan_s=4.0)
    assert s["token_share"] == {"prefill": 0.0, "relay": 0.6, "main_decode": 0.4}
    assert s["output_tokens"] == s["client_tokens"] == 5
    assert s["sla"]["met"] == 1 and s["sla"]["goodput_req_s"] == pytest.approx(0.25)
