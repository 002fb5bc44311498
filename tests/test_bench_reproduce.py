"""`pdd bench reproduce --quick`: the three modes on emulated devices, the 64K-in / 1K-out shape
run, the decode-side cache's bytes runs, the handoff figure and the simulator on the same
requests finish, and the figures are consistent with each other and with the simulator's inputs
(never with wall-clock expectations); a stage that fails is reported and the others are kept."""

from __future__ import annotations

import argparse
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
    for row in data["rows"]:
        if row["sim_vs_live"] is not None:
            assert row["sim_vs_live"] == pytest.approx((row["sim"] - row["live"]) / row["live"])
    # the handoff figure: both paths at 100 relay tokens, quiet and under jitter + traffic
    h = data["handoff"]
    assert set(h["conditions"]) == {"quiet", "jitter+bulk"} and h["relay_tokens"] == 100
    for paths in h["conditions"].values():
        for way in ("token-id", "kv-direct"):
            assert 0 < paths[way]["mean_ms"] <= paths[way]["max_ms"]
    assert h["emulated"] and h["dilation"] == 10.0
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
