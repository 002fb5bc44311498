"""`pdd bench reproduce --quick`: the three modes on emulated devices, the no-DRC bytes run, the
handoff figure and the simulator on the same requests finish, and the figures are consistent
with each other and with the simulator's inputs (never with wall-clock expectations)."""

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


def test_reproduce_quick(tmp_path, capsys):
    argv = ("bench", "reproduce", "--quick", "--no-progress", "--dilation", "10")
    assert pdd(*argv, "--out", str(tmp_path)) == 0
    out = capsys.readouterr().out
    (path,) = (tmp_path / "reproduce").glob("*.json")
    data = json.loads(path.read_text())
    cfg = data["config"]
    assert cfg["quick"] is True and cfg["dilation_k"] == 10.0 and cfg["requests"] == 4
    assert cfg["goodput_slos_ms"] == {"ttft": 5000.0, "tpot": 100.0}  # the source's SLA
    assert set(data["live"]) == set(data["devices"]) == {"same-dc", "cross-dc", "pdd"}
    for mode, s in data["live"].items():
        assert s["completed"] == cfg["requests"] and s["failed"] == 0, (mode, s["errors"])
        report = data["devices"][mode]
        assert report["emulated"] and report["dilation"] == 10.0 and report["steps"] > 0
        # a run over 1% overruns is called out at the end, never silently
        assert (f"NOT VALID: reproduce {mode} overran" in out) == (not report["valid"])
    # the same conversations in every mode: the model is deterministic, so are the prompts
    inputs = {m: s["total_input_tokens"] for m, s in data["live"].items()}
    assert len(set(inputs.values())) == 1, inputs
    # same-dc sends nothing over the WAN; the naive design sends the uncached KV, and without
    # MD's cache it sends every prompt's whole KV: more bytes, the cut is their ratio
    assert data["live"]["same-dc"]["wan_kv_bytes"] == 0
    drc = data["drc"]
    assert 0 < drc["wan_kv_bytes_with"] < drc["wan_kv_bytes_without"]
    assert drc["cut_x"] == pytest.approx(drc["wan_kv_bytes_without"] / drc["wan_kv_bytes_with"])
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
        "DRC cuts WAN KV bytes >= 9x",
        "overruns < 1% of steps (every daemon)",
    }
    for name, ok in data["checks"].items():
        assert f"{'PASS' if ok else ('n/a ' if ok is None else 'FAIL')}  {name}" in out
    assert (tmp_path / "reproduce" / f"{path.stem}-ttft-cdf.png").exists()


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
