"""vLLM's serving metrics as the benchmarks compute them (pddnet.bench.metrics), against hand
arithmetic: no cluster, no clock."""

from __future__ import annotations

import argparse
import math

import pytest

from pddnet.bench import metrics
from pddnet.bench.client import StreamRecord


def rec(
    sent: float,
    times: list[float],
    pdd: dict | None = None,
    prompt_len: int | None = 10,
    dilation: float = 1.0,
    error: str | None = None,
) -> StreamRecord:
    return StreamRecord(
        sent_at=sent,
        first_token_at=times[0] if times else None,
        token_times=list(times),
        token_ids=list(range(len(times))),
        pdd=pdd or {},
        error=error,
        dilation=dilation,
        prompt_len=prompt_len,
    )


# -- per request ----------------------------------------------------------------------------------


def test_ttft_e2el_tpot_itl_of_one_request():
    r = rec(0.0, [0.5, 0.6, 0.8, 1.1])  # 4 tokens: gaps 0.1, 0.2, 0.3
    assert r.ttft_s == 0.5
    assert metrics.e2el_s(r) == 1.1
    assert metrics.tpot_s(r) == pytest.approx((1.1 - 0.5) / 3)  # (e2el - ttft) / (n - 1)
    assert metrics.itl_s(r) == pytest.approx([0.1, 0.2, 0.3])
    # the mean ITL of one request is its TPOT (token gaps sum to e2el - ttft)
    assert sum(metrics.itl_s(r)) / 3 == pytest.approx(metrics.tpot_s(r))
    one = rec(0.0, [0.4])  # a single token: no TPOT, no ITL
    assert metrics.tpot_s(one) is None and metrics.itl_s(one) == []
    assert metrics.e2el_s(one) == 0.4
    # paced at k = 2: every duration / k
    paced = rec(0.0, [0.5, 0.6, 0.8, 1.1], dilation=2.0)
    assert metrics.e2el_s(paced) == pytest.approx(0.55)
    assert metrics.tpot_s(paced) == pytest.approx(0.1)


def test_tokens_of_one_chunk_are_zero_gaps():
    r = rec(0.0, [0.5, 0.5, 0.7])  # two tokens in the first SSE chunk
    assert metrics.itl_s(r) == [0.0, pytest.approx(0.2)]
    assert metrics.tpot_s(r) == pytest.approx(0.1)


# -- stats ----------------------------------------------------------------------------------------


def test_stats_ms_mean_median_std_percentiles():
    s = metrics.stats_ms(
        "ttft", [1.0, 2.0, 3.0, 4.0], percentiles=[50, 90, 99, 99.9], with_max=True
    )
    assert s["mean_ttft_ms"] == pytest.approx(2500.0)
    assert s["median_ttft_ms"] == pytest.approx(2500.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(1.25) * 1000)  # population (ddof 0)
    # linear interpolation between the sorted values, as numpy's default: p at (n-1) p / 100
    assert s["p50_ttft_ms"] == pytest.approx(2500.0)
    assert s["p90_ttft_ms"] == pytest.approx(3700.0)  # 1 + 0.9 * 3 s
    assert s["p99_ttft_ms"] == pytest.approx(3970.0)
    assert s["p99.9_ttft_ms"] == pytest.approx(3997.0)  # vLLM's key for 99.9
    assert s["max_ttft_ms"] == 4000.0
    empty = metrics.stats_ms("itl", [], percentiles=[99])
    assert empty == {
        "mean_itl_ms": None,
        "median_itl_ms": None,
        "std_itl_ms": None,
        "p99_itl_ms": None,
    }
    assert metrics.p_word(99.0) == "99" and metrics.p_word(99.9) == "99.9"


def test_serving_metrics_by_hand():
    a = rec(0.0, [0.5, 0.6, 0.8, 1.1], prompt_len=100)  # tpot 0.2, itl 0.1 0.2 0.3
    b = rec(1.0, [1.2, 1.3], prompt_len=50)  # tpot 0.1, itl 0.1
    c = rec(2.0, [2.9], prompt_len=20)  # one token: tpot excluded
    failed = rec(3.0, [], error="HTTP 500: boom")
    s = metrics.serving_metrics([a, b, c, failed], duration_s=4.0, slos=None, percentiles=[50])
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 170 and s["total_output_tokens"] == 7
    assert s["request_throughput"] == pytest.approx(3 / 4.0)
    assert s["output_throughput"] == pytest.approx(7 / 4.0)
    assert s["total_token_throughput"] == pytest.approx(177 / 4.0)
    assert s["request_goodput"] is None and s["good_completed"] is None  # no SLOs given
    assert s["mean_ttft_ms"] == pytest.approx((500 + 200 + 900) / 3)
    # tpot over the requests with n > 1 only: (0.2 + 0.1) / 2
    assert s["mean_tpot_ms"] == pytest.approx(150.0)
    # itl pooled over requests: 0.1, 0.2, 0.3 and 0.1 -> median of 4 values
    assert s["mean_itl_ms"] == pytest.approx(175.0)
    assert s["median_itl_ms"] == pytest.approx(150.0)
    assert s["median_e2el_ms"] == pytest.approx(900.0)  # 1.1, 0.3, 0.9 s
    no_time = metrics.serving_metrics([a], duration_s=None)
    assert no_time["request_throughput"] is None and no_time["output_throughput"] is None


def test_goodput_counts_every_slo_inclusive_and_single_tokens_as_tpot_zero():
    a = rec(0.0, [0.5, 0.6, 0.8, 1.1])  # ttft 500, tpot 200, e2el 1100 ms
    b = rec(0.0, [0.2, 0.3])  # ttft 200, tpot 100, e2el 300
    c = rec(0.0, [0.9])  # ttft 900, one token: tpot 0 for goodput (vLLM)

    def good(slos):
        return metrics.serving_metrics([a, b, c], 2.0, slos)["good_completed"]

    assert good({"ttft": 500.0}) == 2  # 500 <= 500 counts (SLO >= value)
    assert good({"ttft": 1000.0, "tpot": 100.0}) == 2  # b, and c with tpot 0
    assert good({"tpot": 0.0}) == 1  # only c
    assert good({"e2el": 1000.0}) == 2  # b and c
    assert good({"ttft": 1000.0, "tpot": 500.0, "e2el": 1100.0}) == 3
    s = metrics.serving_metrics([a, b, c], 2.0, {"ttft": 500.0})
    assert s["request_goodput"] == pytest.approx(2 / 2.0)
    assert s["goodput_slos_ms"] == {"ttft": 500.0}


# -- --goodput and --metric-percentiles ------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench")
    metrics.add_arguments(p)
    return p


def test_goodput_parsed_as_vllm_does():
    args = parser().parse_args(["--goodput", "ttft:1000", "tpot:50.5", "e2el:2e3"])
    assert metrics.goodput_config(args) == {"ttft": 1000.0, "tpot": 50.5, "e2el": 2000.0}
    args = parser().parse_args(["--goodput", "ttft:1000", "ttft:300"])  # the last one wins
    assert metrics.goodput_config(args) == {"ttft": 300.0}
    assert metrics.goodput_config(parser().parse_args([])) == {"ttft": 1000.0, "tpot": 50.0}
    assert parser().parse_args([]).metric_percentiles == [90.0, 99.0]
    assert parser().parse_args(["--metric-percentiles", "50,99.9"]).metric_percentiles == [
        50.0,
        99.9,
    ]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--goodput", "ttft"], "give it as KEY:VALUE"),
        (["--goodput", "ttft:1:2"], "give it as KEY:VALUE"),
        (["--goodput", "ttft:fast"], "give it as KEY:VALUE"),
        (["--goodput", "itl:5"], "should be one of ttft, tpot, e2el"),
        (["--goodput", "TTFT:5"], "should be one of ttft, tpot, e2el"),
        (["--goodput", "tpot:-1"], "non-negative"),
        (["--goodput", "tpot:nan"], "non-negative"),
        (["--goodput"], "expected at least one argument"),
        (["--metric-percentiles", "99,abc"], "comma-separated list of numbers"),
        (["--metric-percentiles", "101"], "within 0..100"),
    ],
)
def test_bad_goodput_and_percentiles_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err and ("--goodput" in err or "--metric-percentiles" in err)


def test_deprecated_sla_flags_still_work():
    notes: list[str] = []
    args = parser().parse_args(["--sla-ttft-ms", "800"])
    assert metrics.goodput_config(args, notes.append) == {"ttft": 800.0}
    assert notes == ["note: --sla-ttft-ms is deprecated; use --goodput ttft:800 (vLLM's syntax)"]
    args = parser().parse_args(["--goodput", "e2el:5000", "--sla-tpot-ms", "40"])
    assert metrics.goodput_config(args, notes.append) == {"e2el": 5000.0, "tpot": 40.0}
    args = parser().parse_args(["--goodput", "tpot:40", "--sla-tpot-ms", "40"])  # agrees
    assert metrics.goodput_config(args, notes.append) == {"tpot": 40.0}
    args = parser().parse_args(["--goodput", "tpot:40", "--sla-tpot-ms", "50"])
    with pytest.raises(ValueError, match="contradicts --goodput tpot:40"):
        metrics.goodput_config(args, notes.append)
    with pytest.raises(ValueError, match="non-negative"):
        metrics.goodput_config(parser().parse_args(["--sla-ttft-ms", "-5"]), notes.append)


def test_bench_cli_says_what_is_wrong_with_goodput(capsys):
    from pddnet.bench.cli import BENCHES, run_spec

    with pytest.raises(SystemExit) as exc:
        run_spec(BENCHES["ttft"], ["--quick", "--goodput", "itl:5"])
    assert exc.value.code == 2
    assert "argument --goodput: invalid metric name in 'itl:5'" in capsys.readouterr().err


# -- pddnet's extras -------------------------------------------------------------------------------


def test_pdd_extras_pipeline_split_handoffs_and_bytes():
    def pdd(pipeline, relay, main, kv=0, target=None, handoff=None):
        obj = {
            "mode": "pdd",
            "pipeline": pipeline,
            "relay_tokens": relay,
            "main_tokens": main,
            "wan_kv_bytes": kv,
            "target_wan_kv_bytes": kv if target is None else target,
            "timeline": [],
        }
        if handoff is not None:
            obj["handoff_mode"] = "one-shot"
            obj["timeline"] = [
                {"event": "handoff_start", "time": 1.0},
                {"event": "first_md_token", "time": 1.0 + handoff},
            ]
        return obj

    records = [
        rec(0, [1, 2, 3], pdd("p_rld_md", 1, 2, kv=100, target=1000, handoff=0.2)),
        rec(0, [1, 2, 3], pdd("p_rld_md", 2, 1, kv=100, target=1000, handoff=0.4)),
        rec(0, [1, 2], pdd("p_rld_md", 2, 0, kv=100, target=1000)),  # finished on RLD
        rec(0, [1, 2], pdd("p_rld", 2, 0)),
        rec(0, [1, 2], pdd("p_md", 0, 2, kv=50, target=500)),
        rec(0, [], pdd("p_md", 0, 0), error="boom"),  # not counted
    ]
    x = metrics.pdd_extras(records, percentiles=[99])
    assert x["pipeline_split"] == {"p_rld_md": 3, "p_rld": 1, "p_md": 1}
    assert x["handoff_count"] == 2 and x["p_rld_md_finished_on_rld"] == 1
    assert x["mean_handoff_latency_ms"] == pytest.approx(300.0)
    assert x["max_handoff_latency_ms"] == pytest.approx(400.0)
    assert x["handoff_modes"] == {"one-shot": 2}
    assert x["tokens_by_producer"] == {"prefill": 0, "relay": 7, "main_decode": 5}
    assert x["rld_token_share"] == pytest.approx(7 / 12)
    assert x["wan_kv_bytes"] == 350 and x["target_wan_kv_bytes"] == 3500
    assert x["cluster_mode"] == "pdd" and x["errors"] == ["boom"]
    # the handoff latency is in the modelled world: / the router's k
    paced = pdd("p_rld_md", 1, 1, handoff=0.4)
    paced["emulation"] = {"dilation": 4.0}
    assert metrics.handoff_latency_s(paced) == pytest.approx(0.1)
