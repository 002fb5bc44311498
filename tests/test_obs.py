"""Observability: Chrome/Perfetto traces from a request's `pdd` timeline, and the Prometheus
collector / /metrics server built from a daemon's stats()."""

from __future__ import annotations

import json

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pddnet.obs.metrics import LatencyHistogram, MetricsServer, registry_for, render
from pddnet.obs.trace import TRACKS, chrome_trace, find_pdd_objects, find_token_times

T0 = 1_800_000_000.0


def pdd_object(rid: str = "cmpl-1", offset: float = 0.0) -> dict:
    """The shape of a real PDD completion's `pdd` object (p_rld_md, one-shot handoff)."""

    def ev(event: str, dt: float, producer: str, detail=None) -> dict:
        return {"event": event, "time": T0 + offset + dt, "producer": producer, "detail": detail}

    return {
        "request_id": rid,
        "mode": "pdd",
        "pipeline": "p_rld_md",
        "handoff_mode": "one-shot",
        "relay_tokens": 3,
        "main_tokens": 2,
        "wan_kv_bytes": 306176,
        "handoff_bytes": 154,
        "ttft_s": 0.92,
        "finish_reason": "length",
        "timeline": [
            ev("arrival", 0.0, "router", 299),
            ev("prefill_start", 0.007, "prefill", {"value": 299, "label": "p_rld_md"}),
            ev("prefill_end", 0.916, "prefill", 299),
            ev("rld_kv_complete", 0.920, "relay", 306176),
            ev("first_token", 0.921, "router", "relay"),
            ev("md_kv_complete", 0.963, "main_decode", 306176),
            ev("handoff_start", 0.986, "relay", {"value": 3, "label": "one-shot"}),
            ev("handoff_end", 1.003, "main_decode", {"value": 154, "label": "one-shot"}),
            ev("first_md_token", 1.011, "main_decode", 3),
            ev("request_done", 1.104, "main_decode", "length"),
            ev("done", 1.122, "router", "length"),
        ],
    }


def spans(trace: dict, pid: int = 1) -> dict[str, dict]:
    tid_name = {
        e["tid"]: e["args"]["name"]
        for e in trace["traceEvents"]
        if e["ph"] == "M" and e["name"] == "thread_name" and e["pid"] == pid
    }
    return {
        f"{tid_name[e['tid']]}:{e['name']}": e
        for e in trace["traceEvents"]
        if e["ph"] == "X" and e["pid"] == pid
    }


def test_trace_puts_each_phase_on_its_daemons_track_on_one_clock():
    token_times = [T0 + 0.921, T0 + 0.93, T0 + 0.94, T0 + 1.012, T0 + 1.02]
    trace = chrome_trace(pdd_object(), {"cmpl-1": token_times})
    json.dumps(trace)  # serialisable as is
    s = spans(trace)
    assert s["P:prefill"]["ts"] == pytest.approx(7_000, abs=1)
    assert s["P:prefill"]["dur"] == pytest.approx(909_000, abs=1)
    assert s["WAN:KV copy to MD"]["ts"] == s["P:prefill"]["ts"]
    assert s["WAN:KV copy to MD"]["dur"] == pytest.approx(956_000, abs=1)
    # RLD decodes from its copy landing to its last token (index relay_tokens - 1)
    assert s["RLD:relay decode"]["ts"] == pytest.approx(920_000, abs=1)
    assert s["RLD:relay decode"]["dur"] == pytest.approx(20_000, abs=1)
    assert s["MD:extend + decode"]["ts"] == pytest.approx(1_003_000, abs=1)
    assert s["router:request (length)"]["dur"] == pytest.approx(1_122_000, abs=1)
    instants = [e for e in trace["traceEvents"] if e["ph"] == "i"]
    assert len(instants) == 11 and min(e["ts"] for e in instants) == 0
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C"]
    assert [e["args"]["tokens"] for e in counters] == [1, 2, 3, 4, 5]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert names == set(TRACKS)


def test_trace_of_several_requests_shares_one_origin_and_skips_missing_spans():
    late = pdd_object("cmpl-2", offset=2.0)
    # cross-dc-like: no relay, no handoff; MD decodes from its copy
    late.update(mode="cross-dc", pipeline="p_md", relay_tokens=0, handoff_mode=None)
    late["timeline"] = [
        e
        for e in late["timeline"]
        if e["event"] not in ("rld_kv_complete", "handoff_start", "handoff_end")
    ]
    trace = chrome_trace([pdd_object(), late])
    assert trace["otherData"]["requests"] == 2
    second = spans(trace, pid=2)
    assert "RLD:relay decode" not in second and "WAN:token-id handoff" not in second
    assert second["MD:decode"]["ts"] == pytest.approx(2_963_000, abs=1)
    assert second["router:request (length)"]["ts"] == pytest.approx(2_000_000, abs=1)


def test_trace_rejects_objects_without_a_timeline():
    with pytest.raises(ValueError, match="'cmpl-9'.*no timeline"):
        chrome_trace({"request_id": "cmpl-9", "timeline": []})
    with pytest.raises(ValueError, match="entry 0 lacks"):
        chrome_trace({"request_id": "x", "timeline": [{"event": "arrival"}]})
    with pytest.raises(ValueError, match="no requests"):
        chrome_trace([])


def test_find_pdd_objects_in_nested_results():
    doc = {
        "requests": {
            "pdd": [
                {"ttft_s": 0.1, "pdd": pdd_object("a"), "token_times": [1.0]},
                {"pdd": pdd_object("b")},
            ]
        }
    }
    assert [p["request_id"] for p in find_pdd_objects(doc, "b")] == ["b"]
    assert find_pdd_objects(doc, "zz") == []
    assert find_token_times(doc, "a") == [1.0] and find_token_times(doc, "b") is None


def scrape(stats) -> dict[str, list]:
    text = render(registry_for(lambda: stats))[0].decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples: list, **labels) -> float:
    hits = [s.value for s in samples if all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (labels, samples)
    return hits[0]


MD_STATS = {
    "role": "main_decode",
    "instance": "pdd.main_decode",
    "port": 4,
    "requests": {"active": 2, "allocated": 7, "handoffs": 5},
    "kv_blocks": {"total": 1024, "free": 1000, "used": 24, "block_size": 16},
    "lanes": {
        "bulk": {"bytes_in": 307874, "bytes_out": 796},
        "control": {"bytes_in": 1437, "bytes_out": 885},
    },
    "counters": {"tokens_emitted": 48},
    "max_extend_tokens": {"one-shot": 16},
    "active_phases": {"r1": "waiting_cut", "r2": "waiting_cut"},
    "handoffs": {"one-shot": 3, "streaming": 2},
    "queues": {"engine": 4},
    "drc": {"hits": 3, "lookups": 4, "cached_blocks": 10, "hit_intervals": {"95-100%": 2}},
    "load": 0.25,
}


def test_collector_translates_a_daemon_stats_dict():
    m = scrape(MD_STATS)
    base = {"role": "main_decode", "instance": "pdd.main_decode"}
    assert value(m["pdd_requests_active"], **base) == 2
    assert value(m["pdd_requests"], state="allocated") == 7
    assert value(m["pdd_requests_in_phase"], phase="waiting_cut") == 2
    assert value(m["pdd_kv_blocks"], state="used") == 24
    assert value(m["pdd_kv_blocks"], state="free") == 1000
    assert value(m["pdd_lane_bytes"], lane="bulk", direction="in") == 307874
    # MD is reached only over the WAN: its lanes are its WAN bytes, by kind
    assert value(m["pdd_wan_bytes"], direction="out", kind="control") == 885
    assert value(m["pdd_handoffs"], mode="streaming") == 2
    assert value(m["pdd_max_extend_tokens"], mode="one-shot") == 16
    assert value(m["pdd_queue_depth"], queue="engine") == 4
    assert value(m["pdd_drc_hits"]) == 3 and value(m["pdd_drc_cached_blocks"]) == 10
    assert value(m["pdd_drc_requests_by_hit"], interval="95-100%") == 2
    assert value(m["pdd_events"], event="tokens_emitted") == 48
    assert value(m["pdd_stat_load"]) == 0.25
    assert "pdd_stat_port" not in m
    # P's lanes are not all WAN: no pdd_wan_bytes unless the daemon says which are
    assert "pdd_wan_bytes" not in scrape({**MD_STATS, "role": "prefill"})


def test_histograms_are_cumulative_and_checked():
    h = LatencyHistogram((0.01, 0.1))
    for x in (0.005, 0.01, 0.05, 3.0):
        h.observe(x)
    m = scrape({"role": "relay", "histograms": {"inter_token_seconds": h.to_stats()}})
    buckets = {
        s.labels["le"]: s.value for s in m["pdd_inter_token_seconds"] if s.name.endswith("_bucket")
    }
    assert buckets == {"0.01": 2, "0.1": 3, "+Inf": 4}
    assert value(
        [s for s in m["pdd_inter_token_seconds"] if s.name.endswith("_sum")]
    ) == pytest.approx(3.065)
    with pytest.raises(ValueError, match="latency must be"):
        h.observe(-1)
    with pytest.raises(ValueError, match="increasing"):
        LatencyHistogram((0.1, 0.01))


def test_a_failing_stats_call_is_reported_not_raised():
    def broken() -> dict:
        raise RuntimeError("engine gone")

    m = scrape_fn(broken)
    assert value(m["pdd_scrape_ok"]) == 0
    assert "engine gone" in m["pdd_scrape_ok"][0].labels["error"]


def scrape_fn(fn) -> dict[str, list]:
    text = render(registry_for(fn))[0].decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


async def test_metrics_server_serves_a_real_daemons_stats():
    from pddnet.config import ClusterConfig, ClusterMode
    from pddnet.roles.main_decode import MainDecodeDaemon

    cfg = ClusterConfig(name="t-obs", mode=ClusterMode.CROSS_DC, secret="s3cret")
    cfg.main_decode.port, cfg.main_decode.num_blocks = 0, 64
    md = MainDecodeDaemon(cfg.validate())
    await md.start()
    try:
        async with MetricsServer("127.0.0.1", 0, md.stats) as server:
            async with aiohttp.ClientSession() as s, s.get(server.url) as r:
                assert r.status == 200
                assert r.headers["Content-Type"].startswith("text/plain")
                text = await r.text()
        m = {f.name: f.samples for f in text_string_to_metric_families(text)}
        assert value(m["pdd_kv_blocks"], state="free", role="main_decode") == 64
        assert value(m["pdd_requests_active"]) == 0
        assert value(m["pdd_kv_blocks_capacity"]) == 64
    finally:
        await md.close()
    with pytest.raises(ValueError, match="metrics port"):
        MetricsServer("127.0.0.1", 70000, md.stats)


def test_step_times_split_decode_from_prefill_and_sum_decode_by_batch():
    from pddnet.engine.engine import StepStats
    from pddnet.obs.step_times import StepTimes, batch_bucket

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 7, 8, 127, 128, 500)] == [
        "1",
        "2-3",
        "2-3",
        "4-7",
        "4-7",
        "8-15",
        "64-127",
        "128+",
        "128+",
    ]
    with pytest.raises(ValueError, match="at least one"):
        batch_bucket(0)
    st = StepTimes()
    #          step, seconds, seqs, tokens, prefill tokens, decode tokens, sampled
    st.observe(StepStats(1, 0.300, 1, 100, 100, 0, 1))  # a prefill
    st.observe(StepStats(2, 0.010, 1, 1, 0, 1, 1))  # decode, batch 1
    st.observe(StepStats(3, 0.030, 1, 1, 0, 1, 1))
    st.observe(StepStats(4, 0.040, 3, 3, 0, 3, 3))  # decode, batch 3
    st.observe(StepStats(5, 0.050, 2, 9, 8, 1, 2))  # an extend batched with a decode
    out = st.to_stats()
    assert out["histograms"]["engine_prefill_step_s"]["count"] == 2
    assert out["histograms"]["engine_decode_step_s"]["count"] == 3
    assert out["engine_steps"]["prefill_tokens"] == 108
    assert out["decode_step_ms_by_batch"] == pytest.approx({"1": 20.0, "2-3": 40.0})
    assert out["engine_steps"]["decode_by_batch"]["2-3"]["mean_batch"] == 3


async def test_daemons_report_the_step_times_their_engine_measured():
    from test_roles_inprocess import make_config, run_workload, running, workload

    from pddnet.config import ClusterMode
    from pddnet.model.loader import load_model

    tiny = load_model("tiny")
    cfg = make_config(ClusterMode.PDD, "one-shot")
    async with running(cfg) as (daemons, col):
        await run_workload(tiny, col, workload(2))
        stats = {role: d.stats() for role, d in daemons.items()}
    assert stats["prefill"]["histograms"]["engine_prefill_step_s"]["count"] >= 2
    for role in ("relay", "main_decode"):
        steps = stats[role]["engine_steps"]["decode_by_batch"]
        assert sum(b["steps"] for b in steps.values()) > 0, role
        assert all(b["mean_ms"] > 0 for b in steps.values())
        assert stats[role]["threads"] == cfg.model.threads
    m = {
        f.name: f.samples
        for f in text_string_to_metric_families(
            render(registry_for(lambda: stats["relay"], "relay"))[0].decode()
        )
    }
    assert "pdd_engine_decode_step_s" in m and "pdd_stat_decode_step_ms_by_batch" in m


async def test_daemons_freeze_their_start_up_out_of_the_garbage_collector():
    """A full collection scanning torch's, the model's and the engine's start-up objects paused
    a daemon ~80-90 ms inside whatever forward or read was running; every daemon freezes them
    once it is up and says so in its stats."""
    from pddnet.cluster.local import LocalCluster

    async with LocalCluster(mode="same-dc", model="tiny") as cluster:
        await cluster.complete(prompt="hello", max_tokens=4, temperature=0)
        for role in ("prefill", "relay"):
            gc_stats = (await cluster.stats(role))["gc"]
            assert gc_stats["frozen_objects"] > 10_000, (role, gc_stats)
            assert len(gc_stats["collections"]) == 3
