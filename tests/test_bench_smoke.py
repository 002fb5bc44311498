"""Every benchmark and the demo, run with --quick through the `pdd` argument tree: each
completes, writes its JSON (configuration + machine) and PNGs, and its numbers are consistent
with each other (never with wall-clock expectations)."""

from __future__ import annotations

import argparse
import copy
import json
import os
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
    assert pdd("bench", "ttft", "--quick", "--no-progress", "--trace", "--out", str(tmp_path)) == 0
    data = only_result(tmp_path / "ttft")
    assert set(data["workloads"]) == {"long", "agent"}
    for workload, modes in data["workloads"].items():
        assert set(modes) == {"same-dc", "cross-dc", "pdd"}
        for mode, s in modes.items():
            assert s["completed"] > 0 and s["failed"] == 0, (workload, mode, s["errors"])
            assert_serving_summary(s, percentiles=(90, 99))
            assert sum(s["token_share"].values()) == pytest.approx(1.0)
            # every token the client received is attributed to a producer
            assert sum(s["tokens_by_producer"].values()) == s["total_output_tokens"]
            assert s["goodput_slos_ms"] == {"ttft": 1000.0, "tpot": 50.0}  # the default
            assert 0 <= s["good_completed"] <= s["completed"]
            assert s["request_goodput"] <= s["request_throughput"]
            assert sum(s["pipeline_split"].values()) == s["completed"]
            # a handoff is a P->RLD->MD request MD took over, with a measured latency
            assert (
                s["handoff_count"]
                == s["pipeline_split"].get("p_rld_md", 0) - s["p_rld_md_finished_on_rld"]
            )
            assert s["cluster_mode"] == mode
        assert modes["same-dc"]["token_share"]["main_decode"] == 0  # no MD in same-dc
        assert modes["cross-dc"]["token_share"]["relay"] == 0  # no RLD in cross-dc
        assert modes["cross-dc"]["pipeline_split"] == {"p_md": modes["cross-dc"]["completed"]}
        assert modes["same-dc"]["md_wan_bytes_received"] == 0
        assert modes["cross-dc"]["md_wan_bytes_received"] >= modes["cross-dc"]["wan_kv_bytes"] > 0
        assert modes["cross-dc"]["target_wan_kv_bytes"] == modes["cross-dc"]["wan_kv_bytes"]
        assert set(data["ratios"][workload]) == {"pdd/same-dc", "cross-dc/same-dc", "pdd/cross-dc"}
        assert set(data["ratios"][workload]["pdd/same-dc"]) == {
            "median_ttft_ms",
            "p90_ttft_ms",
            "p99_ttft_ms",
        }
    for row in data["requests"]["pdd"]:
        n = row["output_len"]
        assert row["ok"] and n == len(row["token_times"]) and row["input_len"] > 0
        assert row["e2el_ms"] >= row["ttft_ms"] > 0
        assert row["tpot_ms"] == pytest.approx((row["e2el_ms"] - row["ttft_ms"]) / (n - 1))
    out = capsys.readouterr().out
    assert "median_ttft" in out and "request_goodput" in out and "P->RLD->MD" in out
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
            if role == "router":  # it has its own RouterMetrics; no KV pool
                continue
            text = render(registry_for(lambda s=stats: s))[0].decode()
            families = {f.name: f for f in text_string_to_metric_families(text)}
            blocks = {s.labels["state"]: s.value for s in families["pdd_kv_blocks"].samples}
            assert blocks["used"] + blocks["free"] == stats["kv_blocks"]["total"], (mode, role)
            assert blocks["used"] == 0, (mode, role)  # nothing leaked after the run


def test_engine_quick(tmp_path, capsys):
    assert pdd("bench", "engine", "--quick", "--no-progress", "--out", str(tmp_path)) == 0
    (path,) = (tmp_path / "engine").glob("*.json")
    data = json.loads(path.read_text())
    assert data["config"]["quick"] is True and data["torch_threads"] == 1
    assert len(data["machine"]["loadavg"]) == len(data["loadavg_before"]) == 3
    assert data["model"]["name"] == "tiny-long" and data["target"]["model"] == "llama-3-70b"
    shapes = {(r["kind"], r["context"], r["chunk"], r["batch"]) for r in data["rows"]}
    assert shapes == {
        (k, n, c, b)
        for n in (256, 1024)
        for k, c, b in (("prefill", 128, 1), ("decode", 1, 1), ("decode", 1, 4))
    }
    for r in data["rows"]:
        assert r["modelled_s"] > 0
        for p in ("gather", "paged"):
            entry = r["paths"][p]
            assert len(entry["times_s"]) == 2 and entry["median_s"] > 0
            assert r["k"][p] == pytest.approx(entry["median_s"] / r["modelled_s"])
        assert r["max_logit_diff"] < 1e-9  # both paths computed the same forward
    # a longer prefill chunk or a bigger batch costs the modelled target more
    model = {(r["kind"], r["context"], r["batch"]): r["modelled_s"] for r in data["rows"]}
    assert model[("decode", 1024, 4)] > model[("decode", 1024, 1)]
    assert (tmp_path / "engine" / path.with_suffix(".png").name).exists()
    assert "k paged" in capsys.readouterr().out

    # a shape the old path could not hold is recorded as skipped, the new one still measured
    assert (
        pdd(
            "bench",
            "engine",
            "--contexts",
            "300",
            "--chunks",
            "64",
            "--batches",
            "2",
            "--repeats",
            "1",
            "--max-old-gib",
            "1e-6",
            "--no-progress",
            "--out",
            str(tmp_path / "capped"),
        )
        == 0
    )
    (path,) = (tmp_path / "capped" / "engine").glob("*.json")
    for r in json.loads(path.read_text())["rows"]:
        assert "GiB of temporaries" in r["paths"]["gather"]["skipped"]
        assert r["paths"]["paged"]["median_s"] > 0 and r["speedup"] is None


def test_handoff_mode_quick(tmp_path):
    assert pdd("bench", "handoff-mode", "--quick", "--no-progress", "--out", str(tmp_path)) == 0
    data = only_result(tmp_path / "handoff-mode")
    c = data["consistency"]
    assert c["errors"] == [] and c["tokens_complete"]
    assert c["streaming_extend_within_chunk"]  # MD never extends > chunk
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
    if one_shot:  # one-shot hands everything over in one HANDOFF: MD extends it in one step
        assert c["md_max_extend_tokens"]["one-shot"] >= min(r["relay_tokens"] for r in one_shot)
    assert set(data["by_mode"]) == {"one-shot", "streaming", "dynamic"}
    for mode, serving in data["serving"].items():  # vLLM's per-request latency stats
        n = sum(1 for r in data["requests"] if r["mode"] == mode)
        assert serving["completed"] == n and serving["failed"] == 0
        assert 0 < serving["median_ttft_ms"] <= serving["median_e2el_ms"]
        assert serving["median_tpot_ms"] > 0 and serving["p99_itl_ms"] >= 0
        assert "request_throughput" not in serving  # one request at a time: no throughput
    for r in rows:
        assert r["e2el_ms"] >= r["ttft_ms"] > 0 and r["tpot_ms"] > 0
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
    assert d["tokens_identical"]  # the daemon path yields the reference's tokens
    assert (
        d["daemon"]["total_output_tokens"]
        == d["reference"]["total_output_tokens"]
        == d["requests"] * d["max_tokens"]
    )
    daemon = d["daemon"]  # vLLM's names for the cluster's requests
    assert daemon["completed"] == d["requests"] and daemon["failed"] == 0
    assert daemon["output_throughput"] == pytest.approx(
        daemon["total_output_tokens"] / daemon["duration"]
    )
    assert 0 < daemon["median_ttft_ms"] <= daemon["median_e2el_ms"]
    assert len(list((tmp_path / "transport").glob("*.png"))) == 1
    # the bench's pool (pdd-bench-<this pid>-...) is gone; other test processes' are not ours
    assert not [p for p in Path("/dev/shm").glob(f"pdd-bench-{os.getpid()}-*")]


def test_demo_quick(tmp_path, capsys):
    assert pdd("demo", "--quick", "--no-progress", "--out", str(tmp_path)) == 0
    out = capsys.readouterr().out
    (folder,) = (tmp_path / "demo").iterdir()
    assert f"results and plots in {folder}/" in out
    data = json.loads((folder / "result.json").read_text())
    assert data["machine"]["cores"] >= 1 and data["threads_per_daemon"] == 1
    assert set(data["modes"]) == {"pdd", "cross-dc", "same-dc"}
    for mode, s in data["modes"].items():
        assert s["completed"] > 0 and s["failed"] == 0, (mode, s["errors"])
        assert_serving_summary(s, percentiles=(90, 99))
        assert sum(s["token_share"].values()) == pytest.approx(1.0)
        assert sum(s["pipeline_split"].values()) == s["completed"]
        lanes = s["md_lane_bytes"]
        assert s["md_wan_bytes_received"] == sum(d["bytes_in"] for d in lanes.values())
        assert s["md_wan_bytes_sent"] == sum(d["bytes_out"] for d in lanes.values())
    assert data["modes"]["same-dc"]["md_lane_bytes"] == {}  # no MD, no WAN
    pdd_mode = data["modes"]["pdd"]
    assert pdd_mode["md_wan_bytes_received"] >= pdd_mode["wan_kv_bytes"] + pdd_mode["handoff_bytes"]
    assert data["config"]["wan_shell"]["same-dc"] in (None, "none")  # no WAN at all
    assert data["config"]["wan_shell"]["pdd"] in ("kernel", "packet", "proxy")
    assert {"ttft-cdf.png", "token-share.png", "pipelines.png", "wan-bytes.png"} <= {
        p.name for p in folder.glob("*.png")
    }
    for header in (
        "median_ttft",
        "p99_ttft",
        "median_tpot",
        "median_itl",
        "median_e2el",
        "request_goodput",
        "output_throughput",
        "P->MD",
        "P->RLD->MD",
        "P->RLD",
        "handoffs",
        "mean_handoff_latency",
    ):
        assert header in out, header

    # the plots' groups: same-dc's decode instance is D, nobody is P, every request counted
    from pddnet.bench.demo import pipeline_groups, token_share_groups, wan_groups

    shares = token_share_groups(data["modes"])
    assert set(shares["same-dc"]) == {"D (same-dc's decode)"}
    assert set(shares["pdd"]) == {"RLD", "MD"} and set(shares["cross-dc"]) == {"MD"}
    for mode, g in pipeline_groups(data["modes"]).items():
        assert sum(g.values()) == data["modes"][mode]["completed"]
    assert pipeline_groups(data["modes"])["same-dc"] == {
        "P->D (same-dc)": data["modes"]["same-dc"]["completed"]
    }
    wan = wan_groups(data["modes"])["cross-dc"]
    assert wan["KV payload (P -> MD)"] == pytest.approx(
        data["modes"]["cross-dc"]["wan_kv_bytes"] / 2**20
    )


# -- the pure measurement functions the benchmarks rest on ----------------------------------


def record(times: list[float], pdd_obj: dict, sent_at: float = 0.0):
    """A client's record of one stream (copies: ONE_SHOT_RUN serves several tests)."""
    from pddnet.bench.client import StreamRecord

    return StreamRecord(
        sent_at=sent_at,
        first_token_at=times[0],
        token_times=list(times),
        token_ids=list(range(len(times))),
        pdd=copy.deepcopy(pdd_obj),
    )


# A one-shot handoff: RLD makes tokens 0..3 every 10 ms from t=1.0, TAKEOVER at backlog 3, the
# cut after token 3; MD's first token (index 4) comes 50 ms later, then every 10 ms. (The
# client's token times, the pdd object.)
ONE_SHOT_RUN = (
    [1.00, 1.01, 1.02, 1.03, 1.08, 1.09, 1.10],
    {
        "relay_tokens": 4,
        "main_tokens": 3,
        "handoff_mode": "one-shot",
        "timeline": [
            {"event": "rld_kv_complete", "time": 0.99, "producer": "relay"},
            {
                "event": "handoff_start",
                "time": 1.025,
                "producer": "relay",
                "detail": {"value": 3, "label": "one-shot"},
            },
            {"event": "first_md_token", "time": 1.075, "producer": "main_decode"},
        ],
    },
)


def test_handoff_metrics_stall_occupancy_and_duration():
    from pddnet.bench.handoff_mode import handoff_metrics, rate_for_backlog

    m = handoff_metrics(record(*ONE_SHOT_RUN), prompt_len=100)
    assert m["backlog"] == 3 and m["handed_off"]
    assert m["stall_s"] == pytest.approx(0.05)
    assert m["handoff_s"] == pytest.approx(0.05)
    # held 100 tokens 0.99 -> 1.00, then 101, 102, 103 for 10 ms each
    assert m["rld_occupancy_token_s"] == pytest.approx(100 * 0.01 + (101 + 102 + 103) * 0.01)
    assert rate_for_backlog(8, 10, 0.01, 10**6, 1e4) is None  # reached anyway
    assert rate_for_backlog(110, 10, 0.01, 10**6, 1e4) == pytest.approx(8.0)  # 1 MB in 1 s
    assert rate_for_backlog(11, 10, 0.001, 10**9, 100.0) == 100.0  # capped


def assert_serving_summary(s: dict, percentiles=(90, 99)) -> None:
    """vLLM's bench serve keys, consistent with each other."""
    for key in (
        "duration",
        "completed",
        "failed",
        "total_input_tokens",
        "total_output_tokens",
        "request_throughput",
        "request_goodput",
        "output_throughput",
        "total_token_throughput",
    ):
        assert key in s, key
    for metric in ("ttft", "tpot", "itl", "e2el"):
        keys = [f"{stat}_{metric}_ms" for stat in ("mean", "median", "std")]
        keys += [f"p{p}_{metric}_ms" for p in percentiles]
        assert all(k in s for k in keys), (metric, keys)
        assert s[f"median_{metric}_ms"] <= s[f"p{max(percentiles)}_{metric}_ms"]
    assert s["median_ttft_ms"] <= s["median_e2el_ms"]
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration"])
    assert s["request_throughput"] == pytest.approx(s["completed"] / s["duration"])


def test_mode_summary_shares_and_goodput():
    from pddnet.bench.metrics import tpot_s
    from pddnet.bench.ttft import mode_summary

    fast = record([0.1, 0.11, 0.12], {"relay_tokens": 1, "main_tokens": 2})
    slow = record([2.0, 2.2], {"relay_tokens": 2})
    assert tpot_s(fast) == pytest.approx(0.01) and tpot_s(slow) == pytest.approx(0.2)
    s = mode_summary([fast, slow], {"ttft": 1000.0, "tpot": 50.0}, duration_s=4.0)
    assert s["token_share"] == {"prefill": 0.0, "relay": 0.6, "main_decode": 0.4}
    assert s["total_output_tokens"] == sum(s["tokens_by_producer"].values()) == 5
    assert s["good_completed"] == 1 and s["request_goodput"] == pytest.approx(0.25)
    assert s["output_throughput"] == pytest.approx(5 / 4.0)


# -- emulated devices: time dilation on the client's side, the flags, the devices section -----

EMULATED = (
    "--target-model",
    "llama-3-70b",
    "--device",
    "prefill=h100-sxm:8",
    "--device",
    "relay=h100-sxm:8",
    "--device",
    "main-decode=h200-sxm:8",
)


def test_stream_record_reports_modelled_durations():
    from pddnet.bench.client import StreamRecord
    from pddnet.bench.handoff_mode import handoff_metrics
    from pddnet.bench.metrics import e2el_s, handoff_latency_s, tpot_s
    from pddnet.bench.ttft import mode_summary

    times = [10.4, 10.6, 11.0]
    raw = StreamRecord(sent_at=10.0, first_token_at=10.4, token_times=times, token_ids=[1, 2, 3])
    paced = StreamRecord(
        sent_at=10.0,
        first_token_at=10.4,
        token_times=list(times),
        token_ids=[1, 2, 3],
        dilation=4.0,
    )
    # unpaced: exactly the raw differences, as before dilation existed
    assert raw.ttft_s == 10.4 - 10.0 and raw.inter_token_s() == [10.6 - 10.4, 11.0 - 10.6]
    assert tpot_s(raw) == (11.0 - 10.4) / 2
    # paced at k = 4: every duration / k, the raw (wall) times untouched
    assert paced.ttft_s == pytest.approx(0.1) and paced.wall_ttft_s == pytest.approx(0.4)
    assert paced.inter_token_s() == pytest.approx([0.05, 0.1])
    assert tpot_s(paced) == pytest.approx(0.075) and e2el_s(paced) == pytest.approx(0.25)
    assert paced.token_times == times and paced.sent_at == 10.0
    s = mode_summary([paced], {"ttft": 200.0, "tpot": 80.0}, duration_s=2.0)
    assert s["median_ttft_ms"] == pytest.approx(100.0) and s["good_completed"] == 1
    assert s["median_e2el_ms"] == pytest.approx(250.0)
    assert s["mean_itl_ms"] == pytest.approx(75.0)
    # the router's timeline `time` is wall clock too: its handoff latency is / the router's k
    timeline = [{"event": "handoff_start", "time": 5.0}, {"event": "first_md_token", "time": 5.4}]
    assert handoff_latency_s({"timeline": timeline}) == pytest.approx(0.4)
    assert handoff_latency_s(
        {"timeline": timeline, "emulation": {"dilation": 4.0}}
    ) == pytest.approx(0.1)
    # handoff-mode's figures: stall, handoff duration and RLD occupancy all / k
    one = handoff_metrics(record(*ONE_SHOT_RUN), prompt_len=100)
    rec = record(*ONE_SHOT_RUN)
    rec.dilation = 5.0
    five = handoff_metrics(rec, prompt_len=100)
    for key in (
        "stall_s",
        "handoff_s",
        "rld_occupancy_token_s",
        "median_itl_ms",
        "ttft_ms",
        "tpot_ms",
        "e2el_ms",
    ):
        assert five[key] == pytest.approx(one[key] / 5), key


async def test_drivers_stretch_the_workload_by_the_dilation():
    """Against a tiny streaming server: arrivals (and think times) x k, records carry k."""
    import time

    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    from pddnet.bench.drive import drive, warm_up
    from pddnet.workload.agent import AgentRequest
    from pddnet.workload.poisson import BenchRequest

    async def completions(request):
        body = await request.json()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(body["max_tokens"]):
            chunk = {"choices": [{"token_ids": [i + 7]}]}
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    k = 3.0
    async with TestServer(app) as server, ClientSession() as session:
        url = str(server.make_url("/"))
        await warm_up(session, url, "m", dilation=k)
        poisson = [BenchRequest(a, (1, 2), 2) for a in (0.0, 0.05, 0.1)]
        t0 = time.time()
        recs = await drive(session, url, poisson, "m", dilation=k)
        for req, rec in zip(poisson, recs, strict=True):
            assert rec.error is None and rec.dilation == k and rec.token_ids == [7, 8]
            assert rec.sent_at - t0 >= req.arrival_s * k - 0.01  # stretched by k
            assert rec.ttft_s == (rec.first_token_at - rec.sent_at) / k
        agent = [
            AgentRequest(0, 0, 0.0, (1, 2, 3), 2, (0, 0), (1, 2, 3)),
            AgentRequest(0, 1, 0.08, (1, 2, 3, 0, 0, 4), 2, (0, 0), (4,)),
        ]
        t0 = time.time()
        recs = await drive(session, url, agent, "m", dilation=k)
        assert [r.dilation for r in recs] == [k, k]
        assert recs[1].sent_at - t0 >= 0.08 * k - 0.01  # the think time stretched too
        # unpaced: k = 1 on every record, durations exactly the raw ones
        t0 = time.time()
        recs = await drive(session, url, poisson, "m")
        for req, rec in zip(poisson, recs, strict=True):
            assert rec.dilation == 1.0 and rec.ttft_s == rec.first_token_at - rec.sent_at
            assert rec.sent_at - t0 >= req.arrival_s - 0.01


async def test_drive_chains_a_conversations_turns_and_a_failed_turn_ends_only_its_own():
    """One driver for both workloads: an agent turn's prompt is built from what the turn before
    returned; a failed turn leaves its conversation's later turns unsent, while a failed open-loop
    request (a conversation of one) touches no other request."""
    from aiohttp import ClientSession, web
    from aiohttp.test_utils import TestServer

    from pddnet.bench.drive import drive
    from pddnet.workload.agent import AgentRequest
    from pddnet.workload.poisson import BenchRequest

    prompts: list[list[int]] = []

    async def completions(request):
        body = await request.json()
        prompts.append(body["prompt"])
        if body["prompt"][0] == 9:  # the server's way to fail a request
            return web.Response(status=500, text="refused")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = {"choices": [{"token_ids": list(range(50, 50 + body["max_tokens"]))}]}
        await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    async with TestServer(app) as server, ClientSession() as session:
        url = str(server.make_url("/"))
        agent = [  # conversation 1 fails at turn 0; its turn 1 is listed first, out of order
            AgentRequest(1, 1, 0.0, (9, 0, 0, 4), 2, (0, 0), (4,)),
            AgentRequest(0, 0, 0.0, (1, 2), 2, (0, 0), (1, 2)),
            AgentRequest(1, 0, 0.0, (9,), 2, (0, 0), (9,)),
            AgentRequest(0, 1, 0.0, (1, 2, 0, 0, 3), 1, (0,), (3,)),
        ]
        recs = await drive(session, url, agent, "m")
        assert [r.token_ids for r in recs] == [[], [50, 51], [], [50]]
        assert recs[0].error == "not sent: turn 0 failed"
        assert recs[2].error is not None and recs[2].error.startswith("HTTP 500")
        # turn 1 = turn 0's prompt + its real output + what it adds; the failed one's turn 1 unsent
        assert sorted(prompts) == [[1, 2], [1, 2, 50, 51, 3], [9]]
        prompts.clear()
        open_loop = [BenchRequest(0.0, (9, 1), 1), BenchRequest(0.0, (1, 2), 1)]
        recs = await drive(session, url, open_loop, "m")
        assert recs[0].error is not None and recs[1].error is None and recs[1].token_ids == [50]
        assert sorted(prompts) == [[1, 2], [9, 1]]


def test_device_setup_resolves_auto_once_on_the_widest_mode(monkeypatch):
    from pddnet.bench import ttft
    from pddnet.bench.devices import setup_devices
    from pddnet.device import probe

    probed = []

    def fake_probe(config, log=print, **kw):
        probed.append(config.mode.value)
        return probe.ProbeResult(3.5, 64, 4, 1.5)

    monkeypatch.setattr(probe, "probe_dilation", fake_probe)
    p = argparse.ArgumentParser()
    ttft.add_arguments(p)
    args = p.parse_args(["--quick", *EMULATED, "--dilation", "auto"])
    ttft.apply_quick(args)
    devices = setup_devices(args, {m: ttft.cluster_overrides(m, args) for m in args.modes})
    assert probed == ["pdd"]  # once, on the mode with every role
    assert devices.dilation == devices.overrides["dilation"] == 3.5 and devices.auto
    assert devices.line() == (
        "devices: emulated llama-3-70b on prefill 8 x h100-sxm, relay "
        "8 x h100-sxm, main_decode 8 x h200-sxm; k = 3.5 (auto) "
        "(times / k)"
    )
    assert devices.wall_rate_mbit(1000.0) == pytest.approx(1000.0 * 1024 / 327680 / 3.5)
    plain = setup_devices(p.parse_args([]), {"same-dc": {"mode": "same-dc"}})
    assert not plain.emulated and plain.dilation == 1.0 and plain.overrides == {}
    assert plain.line() == "devices: unpaced: this box's own times"


@pytest.mark.parametrize("bench", ["ttft", "drc", "handoff-mode", "transport", "demo"])
@pytest.mark.parametrize(
    "flag, message",
    [
        ("gpu=h100-sxm", "'gpu' runs no model"),
        ("main-decode=h999", "unknown chip profile 'h999'"),
        ("relay=h100-sxm:0", "GPUS must be an integer >= 1"),
    ],
)
def test_bad_device_flags_fail_before_any_cluster(
    bench, flag, message, monkeypatch, capsys, tmp_path
):
    from pddnet.cluster.local import LocalCluster

    def no_cluster(*a, **kw):
        raise AssertionError("a cluster was started despite a bad --device")

    monkeypatch.setattr(LocalCluster, "__init__", no_cluster)
    devices = [d if not d.startswith("main-decode") else flag for d in EMULATED]
    if flag.startswith(("gpu", "relay")):
        devices = [*EMULATED, "--device", flag]
    argv = ["--quick", "--no-progress", "--out", str(tmp_path), *devices]
    with pytest.raises(SystemExit) as exc:
        pdd(bench, *argv) if bench == "demo" else pdd("bench", bench, *argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written, nothing run


@pytest.mark.timeout(240)
def test_ttft_quick_on_emulated_devices(tmp_path, capsys):
    assert (
        pdd(
            "bench",
            "ttft",
            "--quick",
            "--no-progress",
            "--modes",
            "same-dc",
            "pdd",
            "--workloads",
            "long",
            "--bw-mbit",
            "10000",
            *EMULATED,
            "--dilation",
            "2",
            "--out",
            str(tmp_path),
        )
        == 0
    )
    out = capsys.readouterr().out
    data = only_result(tmp_path / "ttft")
    assert set(data["devices"]) == {"same-dc", "pdd"}
    roles = {"same-dc": {"prefill", "relay"}, "pdd": {"prefill", "relay", "main_decode"}}
    for mode, report in data["devices"].items():
        assert report["emulated"] and report["dilation"] == 2.0 and report["steps"] > 0
        assert set(report["roles"]) == roles[mode]
        assert 0 <= report["overruns"] <= report["steps"]
        # a run over 1% overruns is called out at the end, never silently
        assert (f"NOT VALID: ttft {mode} overran" in out) == (not report["valid"])
    assert data["config"]["dilation_k"] == 2.0 and data["emulation"]["wire_scale"] > 0
    assert (
        "devices: emulated llama-3-70b on prefill 8 x h100-sxm, relay 8 x h100-sxm, "
        "main_decode 8 x h200-sxm; k = 2 (times / k)"
    ) in out
    for mode, s in data["workloads"]["long"].items():
        assert s["completed"] > 0 and s["failed"] == 0, (mode, s["errors"])
        assert sum(s["tokens_by_producer"].values()) == s["total_output_tokens"]
    for row in data["requests"]["pdd"]:
        assert row["dilation"] == 2.0
        assert row["ttft_ms"] == pytest.approx((row["token_times"][0] - row["sent_at"]) / 2 * 1e3)
        assert row["pdd"]["emulation"]["dilation"] == 2.0
