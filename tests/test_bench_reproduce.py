"""`pdd bench reproduce --quick`: the three modes on emulated devices, the 64K-in / 1K-out shape
run, the decode-side cache's bytes runs, the handoff figure and the simulator on the same
requests finish, and the figures are consistent with each other and with the simulator's inputs
(never with wall-clock expectations); a stage that fails is reported and the others are kept."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from pddnet.bench.cli import register
from pddnet.bench.reproduce_sim import sim_requests
from pddnet.workload.agent import AgentWorkloadParams, generate_agent_workload


def pdd(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="pdd")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


@pytest.mark.timeout(420)  # five clusters, the handoff figure and the simulator, in turn
def test_reproduce_quick(tmp_path, capsys, monkeypatch):
    from pddnet.bench import reproduce

    def broken(*a, **kw):
        raise RuntimeError("injected")

    # one stage fails (the simulator on the shape): said, recorded, and everything else kept
    monkeypatch.setattr(reproduce, "simulate_shape", broken)
    argv = ("bench", "reproduce", "--quick", "--no-progress", "--dilation", "10")
    assert pdd(*argv, "--out", str(tmp_path)) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert data_failed(tmp_path) == {"sim shape": "RuntimeError: injected"}
    assert "reproduce: sim shape failed: RuntimeError: injected" in captured.err
    assert "FAILED STAGE sim shape: RuntimeError: injected" in out
    (path,) = (tmp_path / "reproduce").glob("*.json")
    data = json.loads(path.read_text())
    cfg = data["config"]
    assert cfg["quick"] is True and cfg["dilation_k"] == 10.0 and cfg["requests"] == 4
    assert cfg["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 100.0}  # the source's SLA
    # how warm the workload is, said beside the source's skew
    assert 0 < cfg["prefix_hit"]["mean"] < 1 and 0 <= cfg["prefix_hit"]["above_95"] <= 1
    assert f"an ideal prefix cache hits {cfg['prefix_hit']['mean']:.0%}" in out
    assert set(data["live"]) == {"same-dc", "cross-dc", "pdd"}
    assert set(data["devices"]) == {*data["live"], "pdd shape"}
    for mode, s in data["live"].items():
        assert s["completed"] == cfg["requests"] and s["failed"] == 0, (mode, s["errors"])
        report = data["devices"][mode]
        assert report["emulated"] and report["dilation"] == 10.0 and report["steps"] > 0
        # a run over 1% overruns is called out at the end, never silently
        assert (f"NOT VALID: reproduce {mode} overran" in out) == (not report["valid"])
    # the same conversations in every mode: the model is deterministic, so are the prompts
    inputs = {m: s["total_input_tokens"] for m, s in data["live"].items()}
    assert len(set(inputs.values())) == 1, inputs
    assert data["live"]["same-dc"]["wan_kv_bytes"] == 0  # same-dc sends nothing over the WAN
    # the long conversations, MD's cache on and off: with it only the uncached KV crosses,
    # without it every prompt's whole KV; the cut is their ratio, the hits MD's own
    drc = data["drc"]
    assert drc["requests"] == cfg["drc_requests"] == len(drc["rows"])
    assert 0 < drc["wan_kv_bytes_drc"] < drc["wan_kv_bytes_no_drc"]
    assert drc["byte_reduction"] == pytest.approx(
        drc["wan_kv_bytes_no_drc"] / drc["wan_kv_bytes_drc"]
    )
    assert 0 < drc["hit_ratio_of_tokens"] < 1 and drc["sim_cut_x"] > 1
    # the shape run: the warm-up went to MD (its context is what the conversations hit there),
    # then every conversation's request completed; RLD's share is of their tokens
    shape = data["shape"]
    assert shape["requests"] == cfg["shape_requests"] and shape["failed"] == 0
    assert shape["warm_up"]["error"] is None and shape["warm_up"]["main_tokens"] > 0
    assert shape["md_hit_ratio"] > 0.5
    rld = sum(r["relay_tokens"] for r in shape["per_request"])
    assert shape["rld_share"] == pytest.approx(rld / shape["output_tokens"])
    assert shape["sim_rld_share"] is None  # its stage failed
    assert len(data["requests"]["pdd shape"]) == cfg["shape_requests"]
    # the simulator ran the very same requests, one per live request, on the live settings
    assert data["sim_config"]["tokens_per_unit"] == 1
    assert data["sim_config"]["line"]["bw_gbit"] == cfg["line_gbit"]
    for mode in ("same-dc", "cross-dc", "pdd"):
        assert data["sim"][mode]["median_ttft_ms"] > 0
    # the host probe ran on same-dc's cluster before its traffic, counted apart from it, and
    # the simulator got the latency fitted to its points
    host = data["host_latency"]
    assert host["requests"] == len(host["points"]) == 4
    for p in host["points"]:
        assert p["live_ttft_ms"] > 0 and p["modelled_ttft_ms"] > 0
        assert p["host_ms"] == pytest.approx(p["live_ttft_ms"] - p["modelled_ttft_ms"])
    fit = host["fit"]
    assert fit["fixed_ms"] >= 0 and fit["per_1k_tokens_ms"] >= 0
    engine = data["sim_config"]["engine"]
    assert engine["host_latency_us"] == pytest.approx(fit["fixed_ms"] * 1e3)
    assert engine["host_latency_per_token_us"] == pytest.approx(fit["per_1k_tokens_ms"])
    assert engine["host_latency_per_step_us"] == pytest.approx(fit["per_step_ms"] * 1e3)
    assert fit["per_step_ms"] >= 0 and data["host_latency"]["per_step_measured_ms"] >= 0
    # every request as the simulator served it, beside the live rows
    for mode in ("same-dc", "cross-dc", "pdd"):
        assert len(data["sim_requests"][mode]) == cfg["requests"]
    assert "host latency in the simulator: " in out
    assert len(data["requests"]["same-dc"]) == cfg["requests"]
    # P's plan of every pdd request, live and simulated, side by side
    plans = data["pipeline_decisions"]
    assert len(plans) == cfg["requests"] and all(p["live"] and p["sim"] for p in plans)
    assert "P's plans in pdd: " in out
    for row in data["rows"]:
        if row["sim_vs_live"] is not None:
            assert row["sim_vs_live"] == pytest.approx((row["sim"] - row["live"]) / row["live"])
    # pairs of requests P took in one order live and in the other in the simulator, per mode
    assert set(data["order_swaps"]) == set(data["live"])
    assert all(isinstance(pairs, list) for pairs in data["order_swaps"].values())
    assert all(r is None or "arrival_s" in r for m in data["sim_requests"].values() for r in m)
    # the handoff figure: both paths at 100 relay tokens, quiet and under jitter + traffic
    h = data["handoff"]
    assert set(h["conditions"]) == {"quiet", "jitter+bulk", "jitter+bulk+priority"}
    assert h["relay_tokens"] == 100
    for line in ("FIFO line", "control class"):  # the target is judged on each line
        assert f"token-id handoff max/mean <= 1.10 (jitter + traffic, {line})" in data["checks"]
    for paths in h["conditions"].values():
        for way in ("token-id", "kv-direct"):
            assert 0 < paths[way]["mean_ms"] <= paths[way]["max_ms"]
    assert h["emulated"] and h["dilation"] == 10.0
    # --handoff-wan auto: the packet shell where a testbed can run (root, TUN), else the proxy
    from emulation.testbed import unavailable_reason

    assert h["wan"]["shell"] == ("proxy" if unavailable_reason() else "packet")
    assert "handoff figure's line: the " in out
    # behind each line's max/mean: how many handoffs reached the target's multiple of the mean
    for line in ("FIFO line", "control class"):
        assert f"handoff tail, {line}: KV-direct " in out
    assert f"RLD and MD ran {reproduce.HANDOFF_MODEL}, the competing traffic on 4 lanes" in out
    # token ids are a few hundred bytes; KV-direct carries the target model's KV of 100 tokens
    assert h["payload_bytes"]["token-id"] < 1000 < h["payload_target_bytes"]["kv-direct"]
    # every target is reported as passed, failed or not measured, and printed
    assert set(data["checks"]) >= {
        "PDD TTFT P99 <= 1.2x same-dc",
        "naive cross-dc TTFT P99 >= 3x same-dc",
        "DRC cuts WAN KV bytes >= 9x (long conversations, ~90% hit)",
        "RLD share on the 64K-in / 1K-out shape within 1.5x of 6.2%",
        "overruns < 1% of steps (every daemon)",
    }
    for name, ok in data["checks"].items():
        assert f"{'PASS' if ok else ('n/a ' if ok is None else 'FAIL')}  {name}" in out
    assert (tmp_path / "reproduce" / f"{path.stem}-ttft-cdf.png").exists()
    # every cluster with a WAN ran on the line the simulator was given: its emulator's buffer
    # is the 20 modelled ms (it was the emulator's 1 MiB default, ~0.9 modelled s, until the
    # clusters got their settings), and the bench says so under the table
    from pddnet.bench.reproduce import QUEUE_MS

    lines = data["lines"]
    assert lines["dilation"] == 10.0 and set(lines["modes"]) == set(data["live"])
    for mode in ("cross-dc", "pdd"):
        fx = lines["modes"][mode]["a_to_b"]
        buffer_ms = fx["queue_bytes"] * 8 / (fx["rate_mbit"] * 1e6) * 1e3 / lines["dilation"]
        assert buffer_ms == pytest.approx(QUEUE_MS, rel=0.01), (mode, fx)
        assert f"line, {mode} (as its emulator had it, P's side to MD's): " in out
    assert data["sim_config"]["line"]["queue_mb"] == pytest.approx(
        cfg["line_gbit"] * 1e9 / 8 * QUEUE_MS / 1e3 / 2**20
    )
    # the workload's next draws in the simulator: each served in every mode, the ratios the
    # targets are stated on summarised over them, printed beside this draw's and plotted
    spread = data["spread"]
    assert cfg["spread_seeds"] == 3 and spread["seeds"] == [cfg["seed"] + i for i in (1, 2, 3)]
    assert len(spread["draws"]) == 3
    for draw in spread["draws"]:
        assert draw["requests"] == cfg["requests"]
        assert set(draw["ttft_ms"]) == set(data["live"])
        assert draw["ratios"]["pdd/same-dc p99"] == pytest.approx(
            draw["ttft_ms"]["pdd"]["p99"] / draw["ttft_ms"]["same-dc"]["p99"]
        )
    pdd_p99 = spread["ratios"]["pdd/same-dc p99"]
    values = [d["ratios"]["pdd/same-dc p99"] for d in spread["draws"]]
    assert pdd_p99["min"] == min(values) and pdd_p99["max"] == max(values)
    assert pdd_p99["met"] == sum(v <= 1.2 for v in values)
    assert "other draws of the workload (simulator, seeds 1-3, 4 requests each" in out
    assert f"in {pdd_p99['met']} of 3; this draw live " in out
    assert (tmp_path / "reproduce" / f"{path.stem}-spread.png").exists()


def data_failed(tmp_path) -> dict:
    (path,) = (tmp_path / "reproduce").glob("*.json")
    return json.loads(path.read_text())["failed_stages"]


def test_sim_requests_keep_the_live_requests_and_their_prefixes():
    params = AgentWorkloadParams(
        num_conversations=3,
        system_prompt_len=(40, 60),
        task_len=(5, 10),
        output_len=(4, 8),
        max_turns=(2, 4),
        max_context=512,
    )
    live = generate_agent_workload(params, seed=3)
    sim = sim_requests(live)
    assert [r.rid for r in sim] == list(range(len(live)))
    assert [r.arrival_s for r in sim] == sorted(r.arrival_s for r in live)
    by_key = {(r.conversation_id, r.arrival_s): r for r in live}
    for s in sim:
        r = by_key[(s.conversation, s.arrival_s)]
        assert s.units == r.prompt_token_ids and s.prompt_tokens == len(r.prompt_token_ids)
        assert s.output_tokens == r.max_tokens and s.output_units == r.output_token_ids
    # a later turn's prompt starts with the previous prompt and output (what the caches hit)
    first = [s for s in sim if s.conversation == 0]
    for a, b in zip(first, first[1:], strict=False):
        assert b.units[: len(a.units) + len(a.output_units)] == a.units + a.output_units


def test_the_workloads_warmth_is_an_ideal_caches_hits_and_said_beside_the_sources():
    from pddnet.bench.reproduce_table import workload_words
    from pddnet.bench.reproduce_workload import workload_hits
    from pddnet.workload.agent import AgentRequest

    cold = tuple(range(1000, 1320))  # 20 blocks of 16
    warm = cold + (7,) * 17 + (9,) * 3  # the first prompt and its output, then 3 new tokens
    requests = [
        AgentRequest(0, 1, 5.0, warm, 1, (9,), warm),  # listed first, arrives second
        AgentRequest(0, 0, 0.0, cold, 17, (7,) * 17, cold),
    ]
    hits = workload_hits(requests)
    # the cache holds the first prompt and its output but the last (sampled) token, 336
    # tokens: 21 whole blocks, all of which the second prompt (340) matches
    assert hits == {"mean": pytest.approx((0 + 336 / 340) / 2), "above_95": 0.5}
    config = {"requests": 2, "conversations": 1}
    assert workload_words(config) == "2 requests of 1 agent conversations"  # an older result
    words = workload_words({**config, "prefix_hit": hits})
    assert words.endswith(
        "(an ideal prefix cache hits 49% of a prompt, 50% of them above 95%; source ~90%, 70-80%)"
    )


def test_the_simulator_sees_the_shape_as_the_live_cluster_does():
    """The warm-up alone, then with the conversations after it: the warm-up is served the
    same in both runs, so the conversations' RLD tokens are the difference."""
    from pddnet.bench import reproduce
    from pddnet.bench.reproduce_table import shape_figures

    args = reproduce_args("--quick")
    warm, conversations = reproduce.shape_workload(args)
    config = reproduce.simulator_config(args, {"ttft": 5000.0, "tpot": 100.0})
    sim = reproduce.simulate_shape(config, warm, conversations)
    alone, both = sim["warm_up"], sim["with_conversations"]
    assert alone["requests"] == 1 and both["requests"] == 1 + len(conversations)
    assert both["finished"] == both["requests"]
    # the conversations arrive once the warm-up is done: its context is in MD's cache then
    assert both["prefix"]["decode_side_hit_ratio"] > 0.5
    assert both["ttft_s"]["max"] > 0 and alone["e2e_s"]["max"] < both["makespan_s"]
    # no live run: nothing to report
    assert shape_figures(None, sim, warm, conversations) is None


def reproduce_args(*argv: str) -> argparse.Namespace:
    from pddnet.bench.reproduce import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "flags, message",
    [
        (("--modes", "pdd"), "--modes must include same-dc"),
        (("--line-gbit", "0"), "--line-gbit must be > 0"),
        (("--spread-seeds", "-1"), "--spread-seeds must be >= 0"),
        (("--conversations", "0"), "--conversations, --max-requests and --gpus must be >= 1"),
        (("--md-chip", "h999"), "unknown chip"),
    ],
)
def test_bad_options_fail_before_any_cluster(flags, message, monkeypatch, capsys, tmp_path):
    from pddnet.cluster.local import LocalCluster

    def no_cluster(*a, **kw):
        raise AssertionError("a cluster was started despite a bad option")

    monkeypatch.setattr(LocalCluster, "__init__", no_cluster)
    with pytest.raises(SystemExit) as exc:
        pdd(
            "bench",
            "reproduce",
            "--no-progress",
            "--dilation",
            "10",
            "--out",
            str(tmp_path),
            *flags,
        )
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written, nothing run


def test_the_host_probe_spans_the_workload_with_prompts_no_cache_shares():
    from pddnet.bench import reproduce
    from pddnet.kv.block_hash import chained_hashes

    for flag in ("--quick", "--seed=0"):
        args = reproduce_args(flag)
        main = reproduce.main_workload(args)
        probe = reproduce.host_probe_workload(args, main)
        lengths = [len(r.prompt_token_ids) for r in probe]
        assert lengths == sorted(lengths) and len(set(lengths)) == len(lengths) >= 4
        assert lengths[0] == min(len(r.prompt_token_ids) for r in main)
        assert lengths[-1] == max(len(r.prompt_token_ids) for r in main)
        # not one full block in common with the workload or another probe request
        first_blocks = {chained_hashes(r.prompt_token_ids[:16], 16)[0] for r in main}
        probe_blocks = [chained_hashes(r.prompt_token_ids[:16], 16)[0] for r in probe]
        assert len(set(probe_blocks)) == len(probe) and not first_blocks & set(probe_blocks)
        assert {r.conversation_id for r in probe}.isdisjoint(r.conversation_id for r in main)
        assert list(reproduce.probe_phases(probe)) == [f"probe{i + 1}" for i in range(len(probe))]


def test_the_host_probe_measures_what_the_simulator_leaves_out():
    """Live TTFTs that are the simulator's own plus 3 ms plus 0.2 ms per 1K prompt tokens give
    that back; the simulator run with it reproduces every probe request's TTFT; a failed
    request is left out."""
    from pddnet.bench import reproduce
    from pddnet.bench.client import StreamRecord
    from pddnet.bench.reproduce_sim import host_latency_probe, simulate_beside, with_host_latency
    from pddnet.sim.host_latency import HostLatency, host_latency_from_dict

    args = reproduce_args("--quick")
    probe = reproduce.host_probe_workload(args, reproduce.main_workload(args))
    config = reproduce.simulator_config(args, {"ttft": 5000.0, "tpot": 100.0})
    truth = HostLatency(0.003, 2e-7)

    def alone(cfg, r):
        return simulate_beside(cfg, [r], {"s": "same-dc"})["s"]["ttft_s"]["mean"]

    k = 10.0  # records carry wall times; their durations are / k
    records = [
        StreamRecord(
            sent_at=100.0, first_token_at=100.0 + k * (alone(config, r) + truth.at(n)), dilation=k
        )
        for r in probe
        for n in [len(r.prompt_token_ids)]
    ]
    records.append(StreamRecord(sent_at=0.0, error="boom"))
    failed = dataclasses.replace(probe[0], conversation_id=-99)
    got = host_latency_probe(config, [*probe, failed], records)
    assert got["requests"] == len(probe) + 1 and len(got["points"]) == len(probe)
    fit = host_latency_from_dict(got["fit"])
    assert fit.fixed_s == pytest.approx(truth.fixed_s, abs=2e-6)
    assert fit.per_token_s == pytest.approx(truth.per_token_s, rel=1e-3)
    with_host = with_host_latency(config, fit)
    assert with_host["engine"]["host_latency_us"] == pytest.approx(3000.0, abs=2)
    for r, p in zip(probe, got["points"], strict=True):
        assert alone(with_host, r) * 1e3 == pytest.approx(p["live_ttft_ms"], abs=2e-3)
    with pytest.raises(RuntimeError, match="1 of 2 requests answered"):
        host_latency_probe(config, probe[:2], [records[0], records[-1]])


def test_the_probe_fits_the_request_path_beside_a_given_per_step_part():
    """With the host's time per engine step measured apart, the probe's requests alone in the
    simulator pay it on each of P's chunks, and the fit is what is left per request: live
    TTFTs that are the simulator's own (with that per-step part) plus 3 ms plus 0.2 ms per 1K
    prompt tokens give those back, and the per-step part rides along in the fit."""
    from pddnet.bench import reproduce
    from pddnet.bench.client import StreamRecord
    from pddnet.bench.reproduce_sim import host_latency_probe, simulate_beside, with_host_latency
    from pddnet.sim.host_latency import HostLatency, host_latency_from_dict

    args = reproduce_args("--quick")
    probe = reproduce.host_probe_workload(args, reproduce.main_workload(args))
    config = reproduce.simulator_config(args, {"ttft": 5000.0, "tpot": 100.0})
    per_step = 5e-4
    stepped = with_host_latency(config, HostLatency(per_step_s=per_step))

    def alone(cfg, r):
        return simulate_beside(cfg, [r], {"s": "same-dc"})["s"]["ttft_s"]["mean"]

    k = 10.0
    truth = HostLatency(0.003, 2e-7)
    records = [
        StreamRecord(
            sent_at=1.0, first_token_at=1.0 + k * (alone(stepped, r) + truth.at(n)), dilation=k
        )
        for r in probe
        for n in [len(r.prompt_token_ids)]
    ]
    got = host_latency_probe(config, probe, records, per_step)
    fit = host_latency_from_dict(got["fit"])
    assert fit.fixed_s == pytest.approx(truth.fixed_s, abs=2e-6)
    assert fit.per_token_s == pytest.approx(truth.per_token_s, rel=1e-3)
    assert fit.per_step_s == pytest.approx(per_step)
    # without it, the steps' time would be taken for a part of the request's path
    assert host_latency_from_dict(host_latency_probe(config, probe, records)["fit"]).at(
        5000
    ) > truth.at(5000)


def test_the_host_time_per_step_is_the_token_gap_beyond_the_paced_decode_step():
    """The client's mean gap between a request's tokens (its first gap, P's token to the
    decode side's first, left out) less the decoding daemons' paced step per token, over the
    phase's own steps (the stats as it began taken out)."""
    from pddnet.bench.client import StreamRecord
    from pddnet.bench.reproduce_sim import host_step_latency

    k = 2.0  # records are in wall time; their durations / k

    def record(gaps_ms: list[float]) -> StreamRecord:
        times = [100.0]
        for g in [40.0, *gaps_ms]:  # the first gap: a KV hop, no step
            times.append(times[-1] + g * k / 1e3)
        return StreamRecord(sent_at=99.0, first_token_at=times[0], token_times=times, dilation=k)

    records = [record([11.0, 11.5] * 30), record([11.5, 11.0] * 10)]
    records.append(StreamRecord(sent_at=0.0, error="boom"))

    def steps(n: int, seconds: float, batch: float) -> dict:
        return {"steps": n, "seconds": seconds, "mean_batch": batch}

    after = {
        "prefill": {"engine_steps": {"decode_by_batch": {}}},
        "relay": {
            "engine_steps": {
                "decode_by_batch": {"1": steps(105, 1.5, 1.0), "2-3": steps(50, 0.6, 2.0)}
            }
        },
    }
    before = {"relay": {"engine_steps": {"decode_by_batch": {"1": steps(5, 0.5, 1.0)}}}}
    # the phase: 100 steps of 10 ms at batch 1, 50 of 12 ms at batch 2: 11 ms per token
    assert host_step_latency(records, after, before) == pytest.approx(0.25e-3)
    # the warm-up's and the probe's slow steps, not taken out, weigh in
    assert host_step_latency(records, after) < 0.25e-3
    assert host_step_latency(records[:1], {}) == 0.0  # nothing paced to compare with
    assert host_step_latency([record([9.0] * 10)], after, before) == 0.0  # never < 0


def test_the_per_step_part_is_moved_to_where_the_simulators_same_dc_tpot_is_the_live_ones():
    """Live same-DC TPOTs that are the simulator's with 0.2 ms per step: a config with 0.3 ms
    comes back to ~0.2, one with 0.2 stays, and the part is never taken below 0."""
    from pddnet.bench import reproduce
    from pddnet.bench.client import StreamRecord
    from pddnet.bench.reproduce_sim import (
        per_step_in_simulator_terms,
        simulate_beside,
        with_host_latency,
    )
    from pddnet.sim.host_latency import HostLatency

    args = reproduce_args("--quick")
    requests = reproduce.main_workload(args)
    config = reproduce.simulator_config(args, {"ttft": 5000.0, "tpot": 100.0})

    def stepped(per_step: float) -> dict:
        return with_host_latency(config, HostLatency(per_step_s=per_step))

    truth = 2e-4
    done = simulate_beside(stepped(truth), requests, {"s": "same-dc"})["s"]["request_records"]
    k = 4.0  # records are in wall time

    def record(tpot_s: float, n: int = 5) -> StreamRecord:
        times = [100.0 + i * tpot_s * k for i in range(n)]
        return StreamRecord(sent_at=99.0, first_token_at=times[0], token_times=times, dilation=k)

    records = [record(r["tpot_s"]) for r in done] + [StreamRecord(sent_at=0.0, error="boom")]
    assert per_step_in_simulator_terms(stepped(truth + 1e-4), requests, records) == pytest.approx(
        truth, abs=2e-5
    )
    assert per_step_in_simulator_terms(stepped(truth), requests, records) == pytest.approx(truth)
    faster = [record(r["tpot_s"] / 2) for r in done]
    assert per_step_in_simulator_terms(stepped(truth), requests, faster) == 0.0


def test_the_simulators_statistics_are_taken_over_its_requests_as_the_live_ones():
    """vLLM's percentiles interpolate between requests; the simulator's histograms give the
    nearest rank. Over a few dozen requests that is a whole request apart, so the simulator's
    TTFT, TPOT and end-to-end figures are its requests' own through the live side's function;
    without per-request records (an older report) the histogram's stay."""
    from pddnet.bench import metrics
    from pddnet.bench.reproduce_sim import vllm_figures

    ttfts = [0.080, 0.090, 0.3, 0.4]
    report = {
        "ttft_s": {"mean": 0.2175, "p50": 0.090, "p90": 0.4, "p99": 0.4},
        "request_records": [
            {"rid": i, "ttft_s": t, "tpot_s": 0.01 * (i + 1), "e2e_s": 1.0 + i}
            for i, t in enumerate(ttfts)
        ],
    }
    got = vllm_figures(report)
    live = metrics.stats_ms("ttft", ttfts, (90.0, 99.0))
    assert got["median_ttft_ms"] == pytest.approx(195.0) == pytest.approx(live["median_ttft_ms"])
    assert got["p90_ttft_ms"] == pytest.approx(live["p90_ttft_ms"])
    assert got["median_tpot_ms"] == pytest.approx(25.0)
    assert got["median_e2el_ms"] == pytest.approx(2500.0)
    older = vllm_figures({k: v for k, v in report.items() if k != "request_records"})
    assert older["median_ttft_ms"] == pytest.approx(90.0)


def test_the_simulator_serves_every_live_request_and_batches_p_as_the_live_p():
    from pddnet.bench import reproduce
    from pddnet.bench.reproduce_sim import SYSTEMS, sim_order, simulate_beside
    from pddnet.config import load_config

    args = reproduce_args("--quick")
    config = reproduce.simulator_config(args, {"ttft": 5000.0, "tpot": 100.0})
    live = load_config(None, reproduce.cluster_settings("pdd", args))
    assert config["engine"]["p_max_seqs"] == live.prefill.max_num_seqs > 1
    workload = reproduce.main_workload(args)
    sims = simulate_beside(config, workload, SYSTEMS)
    for report in sims.values():
        rows = reproduce.sim_rows(report, workload)
        assert [r["rid"] for r in rows] == sim_order(workload)
        assert report["ttft_s"]["n"] == len(rows) == len(workload)


def test_busy_shares_count_the_workload_phase_only():
    """The daemons' busy counters are cumulative: the warm-up's and the host probe's forwards
    are taken out with the stats taken as the workload began."""
    from pddnet.bench.reproduce_table import _busy

    def stats(p: float, d: float) -> dict:
        return {
            "prefill": {"device": {"modelled_busy_s": p}},
            "relay": {"device": {"modelled_busy_s": d}},
        }

    assert _busy(stats(10.0, 6.0), 20.0, stats(4.0, 1.0)) == {"prefill": 0.3, "relay": 0.25}
    assert _busy(stats(10.0, 6.0), 20.0) == {"prefill": 0.5, "relay": 0.3}


def test_p_plans_live_and_simulated_side_by_side_in_the_same_units():
    """A live plan is in wall seconds and the small model's real KV bytes; normalised, a live
    record that is the simulator's own plan seen through k and the wire scale reads the same,
    request by request (matched through the simulator's arrival order), and only a plan that
    differs is named in the notes."""
    from pddnet.bench import reproduce
    from pddnet.bench.client import StreamRecord
    from pddnet.bench.reproduce_sim import sim_order, simulate_beside
    from pddnet.bench.reproduce_table import decision_notes, pipeline_decisions

    args = reproduce_args("--quick")
    workload = list(reversed(reproduce.main_workload(args)))  # any order: matched by rid
    config = reproduce.simulator_config(args, {"ttft": 5000.0, "tpot": 100.0})
    plans = simulate_beside(config, workload, {"pdd": "pdd"})["pdd"]["plan_records"]
    assert sorted(p["rid"] for p in plans) == list(range(len(workload)))
    k, real_kvpt = 10.0, 256
    by_rid = {p["rid"]: p for p in plans}

    def as_live(plan: dict) -> dict:
        x = plan["inputs"]
        scale = real_kvpt / x["kv_bytes_per_token"]
        inputs = {
            **x,
            "kv_bytes_per_token": real_kvpt,
            "bandwidth_bps": x["bandwidth_bps"] * scale / k,
            "wan_backlog_bytes": round(x["wan_backlog_bytes"] * scale),
            "rtt_s": x["rtt_s"] * k,
            "rld_s_per_token": x["rld_s_per_token"] * k,
        }
        return {
            **plan,
            "inputs": inputs,
            "estimated_wan_transfer_s": plan["estimated_wan_transfer_s"] * k,
        }

    records = [
        StreamRecord(sent_at=0.0, dilation=k, pdd={"pipeline_decision": as_live(by_rid[rid])})
        for rid in sim_order(workload)
    ]
    rows = pipeline_decisions(records, workload, plans)
    assert [r["turn"] for r in rows] == [r.turn for r in workload]
    for row in rows:
        assert row["live"].keys() == row["sim"].keys()
        for key, v in row["sim"].items():
            assert row["live"][key] == (v if isinstance(v, str) else pytest.approx(v)), key
    assert decision_notes(rows) == [
        f"P's plans in pdd: {len(rows)} of {len(rows)} requests alike live and simulated"
    ]
    other = {"p_md": "p_rld", "p_rld": "p_md", "p_rld_md": "p_md"}
    rows[0]["live"]["pipeline"] = other[rows[0]["sim"]["pipeline"]]
    notes = decision_notes(rows)
    assert notes[0].startswith(f"P's plans in pdd: {len(rows) - 1} of {len(rows)}")
    assert len(notes) == 2 and f"turn {rows[0]['turn']}" in notes[1]


def test_a_pair_sent_in_one_order_live_and_the_other_in_the_simulator_is_named():
    """Two turns 1.9 modelled ms apart at P: live the first is served at once and the second
    waits out its prefill, the simulator had them the other way round, so both TTFTs differ;
    a pair swapped without effect, and pairs far apart, are not listed."""
    from types import SimpleNamespace

    from pddnet.bench.client import StreamRecord
    from pddnet.bench.reproduce_table import order_swaps, swap_notes

    k, t0 = 2.0, 1000.0

    def live(sent_s: float, ttft_s: float) -> StreamRecord:  # modelled seconds
        sent = t0 + sent_s * k
        return StreamRecord(sent_at=sent, dilation=k, first_token_at=sent + ttft_s * k)

    def turn(conversation: int, n: int) -> SimpleNamespace:
        return SimpleNamespace(conversation_id=conversation, turn=n)

    records = [
        live(27.1125, 0.090),
        live(27.1144, 1.288),
        live(29.0, 0.200),
        live(40.0, 0.300),
        live(40.1, 0.310),
        live(41.0, 0.100),
    ]
    workload = [turn(0, 5), turn(3, 1), turn(1, 0), turn(2, 1), turn(4, 1), turn(5, 0)]
    sim = [
        {"arrival_s": 27.1165, "ttft_s": 1.268},
        {"arrival_s": 27.1125, "ttft_s": 1.278},
        {"arrival_s": 29.0, "ttft_s": 0.2},
        {"arrival_s": 40.1, "ttft_s": 0.300},  # swapped, the same TTFTs: no matter
        {"arrival_s": 40.0, "ttft_s": 0.310},
        None,  # the simulator did not finish it
    ]
    swaps = order_swaps(records, workload, sim)
    assert len(swaps) == 1
    (pair,) = swaps
    assert (pair["first_live"]["conversation"], pair["first_sim"]["conversation"]) == (0, 3)
    assert pair["live_gap_ms"] == pytest.approx(1.9) and pair["sim_gap_ms"] == pytest.approx(4.0)
    assert swap_notes({"pdd": swaps}) == [
        "order at P differs, pdd: conversation 0 turn 5 was sent 1.9 ms before conversation 3 "
        "turn 1 live, 4.0 ms after it in the simulator (TTFT live 90 / 1288 ms, sim 1268 / 1278)"
    ]
    assert order_swaps(records[2:], workload[2:], sim[2:]) == []


def test_a_handoff_figure_that_overran_is_retried_once_at_a_larger_k_under_auto(monkeypatch):
    import asyncio

    from pddnet.bench import handoff, reproduce

    assert reproduce.handoff_retry_k({"valid": True, "dilation_needed": 1.0}, 2.1) is None
    assert reproduce.handoff_retry_k({"valid": None}, 2.1) is None  # unpaced
    # the k it needed, with the margin, rounded up to a tenth; never below the k it ran at
    assert reproduce.handoff_retry_k({"valid": False, "dilation_needed": 2.2}, 2.1) == 2.8
    assert reproduce.handoff_retry_k({"valid": False, "dilation_needed": 1.5}, 3.1) == 3.9

    ran = []

    async def figure(argv):  # the handoff bench's summary, by the k it was given
        k = float(argv[argv.index("--dilation") + 1])
        ran.append(k)
        ok = k >= 2.5
        return {
            "dilation": k,
            "valid": ok,
            "dilation_needed": 2.2,
            "overruns": 0 if ok else 1,
            "steps": 298,
            "path": f"/r/{k:g}.json",
            "conditions": {},
        }

    monkeypatch.setattr(handoff, "source_figure", figure)
    monkeypatch.setattr(reproduce, "handoff_argv", lambda args, k: ["--dilation", f"{k:g}"])
    auto = argparse.Namespace(dilation="auto")
    out = asyncio.run(reproduce.handoff_stage(auto, 2.1))
    assert ran == [2.1, 2.8]
    assert out["dilation"] == 2.8 and out["valid"] is True
    assert out["attempts"] == [
        {"dilation": 2.1, "valid": False, "overruns": 1, "steps": 298, "path": "/r/2.1.json"}
    ]
    # said under the table, beside the figure it replaced
    from pddnet.bench.reproduce_table import notes

    said = notes({"live": {}, "sim": {}, "utilisation": {}, "handoff": out})
    assert any("at k = 2.1 its devices overran on 1 of 298 forwards" in line for line in said)
    # an explicit k is what the user asked for: the figure stays, not valid, and is not rerun
    ran.clear()
    fixed = asyncio.run(reproduce.handoff_stage(argparse.Namespace(dilation="2.1"), 2.1))
    assert ran == [2.1] and fixed["valid"] is False and "attempts" not in fixed
    # kept pace at once: one run
    ran.clear()
    asyncio.run(reproduce.handoff_stage(auto, 3.0))
    assert ran == [3.0]


def test_the_spread_summarises_each_ratio_over_the_draws_and_counts_those_meeting_its_target():
    from pddnet.bench.reproduce_spread import draw_ratios, spread_notes, summarise

    def draw(seed, same, pdd, cross):
        ttft = {
            "same-dc": {"median": 10.0, "p90": 50.0, "p99": same},
            "pdd": {"median": 20.0, "p90": 50.0, "p99": pdd},
            "cross-dc": {"median": 30.0, "p90": None, "p99": cross},
        }
        return {"seed": seed, "requests": 36, "ttft_ms": ttft, "ratios": draw_ratios(ttft)}

    draws = [
        draw(1, 100.0, 110.0, 500.0),
        draw(2, 100.0, 130.0, 250.0),
        draw(3, 200.0, 200.0, 900.0),
    ]
    assert draws[0]["ratios"] == {
        "pdd/same-dc median": 2.0,
        "pdd/same-dc p90": 1.0,
        "pdd/same-dc p99": pytest.approx(1.1),
        "cross-dc/same-dc median": 3.0,  # a statistic missing on one side is left out
        "cross-dc/same-dc p99": 5.0,
    }
    bounds = {"pdd/same-dc p99": ("max", 1.2), "cross-dc/same-dc p99": ("min", 3.0)}
    s = summarise(draws, bounds)
    assert s["pdd/same-dc p99"] == {
        "median": pytest.approx(1.1),
        "min": 1.0,
        "max": pytest.approx(1.3),
        "draws": 3,
        "target": {"kind": "max", "bound": 1.2},
        "met": 2,
    }
    assert s["cross-dc/same-dc p99"]["met"] == 2 and s["cross-dc/same-dc p99"]["min"] == 2.5
    assert "target" not in s["pdd/same-dc median"]
    run = {
        "spread": {"seeds": [1, 2, 3], "draws": draws, "ratios": s},
        "live": {m: {"p99_ttft_ms": v} for m, v in (("same-dc", 100.0), ("pdd", 119.0))},
        "sim": {m: {"p99_ttft_ms": v} for m, v in (("same-dc", 100.0), ("pdd", 116.0))},
    }
    lines = spread_notes(run)
    assert lines[0].startswith("other draws of the workload (simulator, seeds 1-3, 36 requests")
    assert (
        "  TTFT pdd/same-dc p99: median 1.10x (1.00x-1.30x), <= 1.2x in 2 of 3; this draw "
        "live 1.19x, simulated 1.16x" in lines
    )
    assert any(
        line.startswith("  TTFT cross-dc/same-dc p99: median 4.50x (2.50x-5.00x), >= 3x in 2 of 3")
        for line in lines
    )
    assert spread_notes({"spread": None}) == []


def test_the_live_clusters_run_with_the_settings_the_simulator_is_given(monkeypatch):
    # run_live and run_shape start their clusters with `cluster_settings` (pools, and the line
    # with its buffer), the settings `simulator_config` reads: they once passed the pools alone,
    # and the live line had the emulator's 1 MiB buffer against the simulator's 20 ms
    import asyncio

    from pddnet.bench import reproduce, ttft

    started = []

    async def run_mode(mode, phases, args, show, devices, overrides=None):
        started.append((mode, overrides))
        return {}

    monkeypatch.setattr(ttft, "run_mode", run_mode)
    args = reproduce_args("--dilation", "3")
    warm, shape = reproduce.shape_workload(args)
    for mode in reproduce.MODES:
        asyncio.run(reproduce.run_live(args, {"agent": []}, {mode: None}, mode))
    asyncio.run(reproduce.run_shape(args, warm, shape, {"pdd": None}))
    assert [m for m, _ in started] == [*reproduce.MODES, "pdd"]
    for mode, overrides in started:
        assert overrides == reproduce.cluster_settings(mode, args)
        assert overrides["wan.queue_ms"] == reproduce.QUEUE_MS
        assert overrides["wan.bw_mbit"] == reproduce.line_gbit(args) * 1e3
