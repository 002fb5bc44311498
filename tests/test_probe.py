"""``--dilation auto``'s probe (pddnet.device.probe): the sans-IO estimate that turns each role's
timed forwards into k, and the probe of the real engine around it (warm-up pass untimed, the
garbage collector frozen while it times, what it reports)."""

from __future__ import annotations

import gc
import json
import math
import random

import pytest

from pddnet.config import load_config
from pddnet.device import probe
from pddnet.device.pacer import ratio_within
from pddnet.device.probe import PROBE_MARGIN, ProbeResult, estimate, role_ratio


def passes_of(ratios: list[list[float]], model_s: float = 0.01) -> list[list[tuple[float, float]]]:
    """(real, modelled) samples whose real / modelled are ``ratios``, pass by pass."""
    return [[(r * model_s, model_s) for r in p] for p in ratios]


def k_of(ratio: float, share: float, margin: float = PROBE_MARGIN) -> float:
    return math.ceil(ratio * margin * share * 10 - 1e-9) / 10


def test_a_consistent_ratio_gives_that_ratio_x_margin_x_share():
    got = estimate({"prefill": passes_of([[2.0] * 8] * 5)}, host_share=1.5)
    assert got.by_role["prefill"].ratio == pytest.approx(2.0)
    assert got.dilation == pytest.approx(k_of(2.0, 1.5))
    assert got.dilation > 2.0 * 1.5  # the margin is on top, not inside
    assert estimate({"p": passes_of([[2.0] * 8])}, 1.0, margin=1.0).dilation == 2.0


def test_a_warm_up_outlier_does_not_set_k():
    steady = [[2.0] * 8 for _ in range(5)]
    steady[0][0] = 40.0  # a first forward that paid the process's warm-up
    got = estimate({"relay": passes_of(steady)}, host_share=1.0)
    assert got.by_role["relay"].ratio == 2.0
    assert got.dilation == k_of(2.0, 1.0)
    # ... where the old rule, the max of the forwards, would have: the test can fail
    assert got.dilation < 40.0


def test_outliers_above_the_tail_do_set_k():
    """More than PROBE_TAIL of the forwards slow is no outlier: k covers them."""
    slow = [[2.0] * 10 for _ in range(4)]
    for p in slow:
        p[0] = p[1] = 6.0  # 20% of the forwards
    got = estimate({"relay": passes_of(slow)}, host_share=1.0)
    assert got.by_role["relay"].ratio == 6.0


def test_more_noise_gives_a_higher_k():
    rng = random.Random(7)

    def noisy(spread: float) -> list[list[float]]:
        return [[2.0 * (1 + spread * rng.random()) for _ in range(16)] for _ in range(6)]

    ks = [estimate({"p": passes_of(noisy(s))}, host_share=1.5).dilation for s in (0, 0.2, 1.0)]
    assert ks[0] < ks[1] < ks[2]


def test_k_is_never_below_one():
    got = estimate({"prefill": passes_of([[0.1] * 8]), "relay": passes_of([[0.2] * 8])}, 1.5)
    assert got.dilation == 1.0
    # the share applies to the ratio before the floor: 0.5 x 1.5 margin x 1.5 share is 1.2
    assert estimate({"p": passes_of([[0.5] * 8])}, 1.5).dilation == k_of(0.5, 1.5)
    assert estimate({}, 1.5).dilation == 1.0


def test_the_worst_role_sets_k_and_every_role_is_reported():
    got = estimate(
        {"prefill": passes_of([[1.0] * 4] * 3), "main_decode": passes_of([[3.0] * 16] * 3)}, 1.0
    )
    assert got.dilation == k_of(3.0, 1.0)
    assert got.by_role["prefill"].samples == 12 and got.by_role["main_decode"].samples == 48


def test_spread_is_the_same_ratio_pass_by_pass():
    r = role_ratio(passes_of([[1.0] * 20, [3.0] * 20, [2.0] * 20]))
    assert (r.low, r.high) == (1.0, 3.0)
    assert r.ratio == ratio_within([1.0] * 20 + [3.0] * 20 + [2.0] * 20, 0.05) == 3.0
    empty = role_ratio([[], []])
    assert (empty.ratio, empty.samples, empty.low, empty.high) == (0.0, 0, 0.0, 0.0)


def test_an_infinite_ratio_counts_like_any_other():
    few = [[(0.01, 0.0)] + [(0.02, 0.01)] * 39]  # 1 in 40 within the tail: ignored
    assert estimate({"p": few}, 1.0).dilation == k_of(2.0, 1.0)
    many = [[(0.01, 0.0)] * 5 + [(0.02, 0.01)] * 5]
    assert estimate({"p": many}, 1.0).dilation == math.inf


def test_the_summary_is_one_line_with_what_was_measured():
    result = ProbeResult(
        2.3,
        8192,
        4,
        1.5,
        2.4,
        {"prefill": 0.95, "relay": 0.5},
        9,
        {"prefill": 36, "relay": 144},
        {"prefill": (0.74, 1.03), "relay": (0.49, 0.86)},
    )
    line = result.summary()
    assert "\n" not in line
    assert "k = 2.3" in line and "p95" in line and "9 passes" in line
    assert "prefill 0.95 of 36 forwards [passes 0.74-1.03]" in line
    assert "relay 0.50 of 144 [0.49-0.86]" in line
    assert "x 1.5 margin x 1.5 daemons per core" in line
    d = json.loads(json.dumps(result.to_dict()))
    assert d["spread_by_role"]["relay"] == [0.49, 0.86] and d["samples_by_role"]["prefill"] == 36
    assert d["percentile"] == 95 and d["margin"] == PROBE_MARGIN


def test_probe_times_fresh_passes_after_an_untimed_warm_up_with_the_gc_frozen(monkeypatch):
    """The real engine on a tiny config: the warm-up pass is run but not sampled, the timed
    passes run with the heap frozen out of the collector, which is thawed afterwards."""
    config = load_config(
        None,
        {
            "target_model": "qwen2.5-7b",
            "model.name": "tiny-window",
            **{f"{r}.device": "h100-sxm" for r in ("prefill", "relay", "main_decode")},
        },
    )
    calls: list[tuple[int, int, int]] = []  # context, frozen objects, forwards
    run_pass = probe.run_pass

    def recording(engine, rng, context, batch, vocab):
        frozen = gc.get_freeze_count()
        forwards = run_pass(engine, rng, context, batch, vocab)
        calls.append((context, frozen, len(forwards)))
        return forwards

    monkeypatch.setattr(probe, "run_pass", recording)
    monkeypatch.setattr(probe, "PROBE_PASSES", (3, 3))
    frozen_before = gc.get_freeze_count()
    lines: list[str] = []
    result = probe.probe_dilation(config, context=48, log=lines.append)
    assert gc.get_freeze_count() == frozen_before
    assert len(calls) == 4 and result.passes == 3
    assert calls[0][1] == frozen_before  # the warm-up ran before the freeze
    assert all(frozen > frozen_before for _, frozen, _ in calls[1:])
    timed = sum(n for _, _, n in calls[1:])
    assert sum(result.samples_by_role[r] for r in ("prefill", "relay")) == timed
    assert result.samples_by_role["relay"] == result.samples_by_role["main_decode"]
    assert result.samples_by_role["relay"] >= 3 * (probe.PROBE_DECODE_STEPS - 1)
    assert result.dilation >= 1.0 and set(result.spread_by_role) == set(result.ratio_by_role)
    assert len(lines) == 2 and lines[1] == result.summary()
