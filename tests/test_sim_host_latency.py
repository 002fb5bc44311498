"""The simulator's host latency ([engine] host_latency_us + host_latency_per_token_us x prompt
tokens per request, host_latency_per_step_us per engine step): its fit from measured points,
and where a simulated request pays it."""

from __future__ import annotations

import random

import pytest

import pddnet.sim.runner as runner
from pddnet.sim.config import Engine, parse_config
from pddnet.sim.host_latency import HostLatency, fit_host_latency, host_latency_from_dict
from pddnet.sim.system import SimulatedSystem
from pddnet.workload.units import SimRequest
from tests.sim_configs import one_pool_config

# -- the fit (sans IO) -------------------------------------------------------------------------


def test_the_fit_recovers_a_fixed_part_and_a_part_per_token():
    points = [(n, 0.004 + 2e-7 * n) for n in (1000, 4000, 12000, 30000, 48000)]
    fit = fit_host_latency(points)
    assert fit.fixed_s == pytest.approx(0.004)
    assert fit.per_token_s == pytest.approx(2e-7)
    assert fit.at(10000) == pytest.approx(0.006)


def test_noise_averages_out_in_the_least_squares_fit():
    rng = random.Random(1)
    points = [(n, 0.01 + 1e-7 * n + rng.gauss(0, 1e-4)) for n in range(1000, 50000, 1000)]
    fit = fit_host_latency(points)
    assert fit.fixed_s == pytest.approx(0.01, abs=1e-4)
    assert fit.per_token_s == pytest.approx(1e-7, rel=0.05)


def test_a_negative_fixed_part_is_refitted_through_the_origin():
    points = [(1000, 0.0), (2000, 0.002), (3000, 0.004)]  # unconstrained: -2 ms + 2 us/token
    fit = fit_host_latency(points)
    assert fit.fixed_s == 0.0
    # through the origin: sum(n y) / sum(n^2)
    assert fit.per_token_s == pytest.approx(
        (2000 * 0.002 + 3000 * 0.004) / (2000**2 + 3000**2 + 1000**2)
    )


def test_a_cost_that_shrinks_with_the_prompt_is_flat_at_the_mean():
    points = [(1000, 0.012), (10000, 0.010), (40000, 0.008)]
    fit = fit_host_latency(points)
    assert fit.per_token_s == 0.0
    assert fit.fixed_s == pytest.approx(0.010)


def test_no_part_is_negative_even_when_every_point_is():
    fit = fit_host_latency([(1000, -0.002), (8000, -0.001), (30000, -0.003)])
    assert fit == HostLatency(0.0, 0.0)


def test_one_prompt_length_gives_the_mean_and_no_points_is_an_error():
    assert fit_host_latency([(5000, 0.004), (5000, 0.006)]) == HostLatency(pytest.approx(0.005))
    with pytest.raises(ValueError, match="no points"):
        fit_host_latency([])


def test_the_json_and_the_config_keys_carry_the_same_latency():
    host = HostLatency(0.0075, 1.25e-7, 2e-4)
    assert host.to_dict() == {
        "fixed_ms": pytest.approx(7.5),
        "per_1k_tokens_ms": pytest.approx(0.125),
        "per_step_ms": pytest.approx(0.2),
    }
    back = host_latency_from_dict(host.to_dict())
    assert back.fixed_s == pytest.approx(host.fixed_s)
    assert back.per_token_s == pytest.approx(host.per_token_s)
    assert back.per_step_s == pytest.approx(host.per_step_s)
    assert host_latency_from_dict(None) == HostLatency()
    # a result from before the per-step part was measured
    assert host_latency_from_dict({"fixed_ms": 7.5, "per_1k_tokens_ms": 0.125}).per_step_s == 0
    engine = parse_config({**config_dict(), "engine": host.engine_settings()}).engine
    assert engine.host_latency_us == pytest.approx(7500.0)
    assert engine.host_latency_per_token_us == pytest.approx(0.125)
    assert engine.host_latency_per_step_us == pytest.approx(200.0)


# -- the simulator applies it ------------------------------------------------------------------


def config_dict(**engine: float) -> dict:
    """One instance per pool, one unit per token, a 2 Gbit/s line (as `pdd bench reproduce`)."""
    return one_pool_config(jitter_ms=1.0, **engine)


def ttfts(cfg_dict: dict, system: str, requests: list[SimRequest]) -> dict[int, float]:
    """Each request's TTFT (exact, not the report's histogram) in one run of `system`."""
    got: dict[int, float] = {}

    class Recording(SimulatedSystem):
        def _first_token(self, st, user):
            super()._first_token(st, user)
            got[st.req.rid] = user - st.req.arrival_s

    cfg = parse_config({**cfg_dict, "workload": {"requests": len(requests)}})
    original = runner.SimulatedSystem
    runner.SimulatedSystem = Recording
    try:
        runner.simulate(cfg, system, requests=requests)
    finally:
        runner.SimulatedSystem = original
    return got


def request(rid: int, prompt: int, output: int, at: float = 0.0) -> SimRequest:
    rng = random.Random(rid)
    units = tuple(rng.randrange(1 << 20) for _ in range(prompt))
    return SimRequest(rid, -1, at, units, prompt, output, tuple(range(output)))


def test_the_host_latency_is_off_by_default():
    assert Engine().host_latency_us == 0.0 and Engine().host_latency_per_token_us == 0.0
    assert Engine().host_latency_per_step_us == 0.0
    assert parse_config(config_dict()).engine == Engine()


@pytest.mark.parametrize("system", ["same-dc", "cross-dc", "pdd"])
@pytest.mark.parametrize(
    "prompt, output",
    [(2000, 16), (30000, 16), (30000, 1000)],  # pdd: P->RLD, P->RLD, P->RLD->MD or P->MD
)
def test_a_request_alone_is_later_by_exactly_the_host_latency(system, prompt, output):
    fixed_us, per_token_us = 4000.0, 0.15
    req = [request(0, prompt, output)]
    without = ttfts(config_dict(), system, req)[0]
    with_host = ttfts(
        config_dict(host_latency_us=fixed_us, host_latency_per_token_us=per_token_us),
        system,
        req,
    )[0]
    assert with_host - without == pytest.approx((fixed_us + per_token_us * prompt) / 1e6, abs=1e-9)


def test_the_host_path_is_paid_before_p_and_overlaps_a_wait_for_it():
    """A request reaches P's queue after its host path: one sent while P works on a long
    prompt waits out its own host path in that time, and is later only by as much as the long
    prompt's host path delayed P (not by its own on top, as a cost after P would be)."""
    long, short = request(0, 48000, 8), request(1, 1000, 8, at=0.02)
    per_token_us = 0.2
    without = ttfts(config_dict(), "same-dc", [long, short])
    with_host = ttfts(config_dict(host_latency_per_token_us=per_token_us), "same-dc", [long, short])
    assert with_host[0] - without[0] == pytest.approx(48000 * per_token_us / 1e6, abs=1e-9)
    assert with_host[1] - without[1] == pytest.approx(48000 * per_token_us / 1e6, abs=1e-9)


# -- per engine step ---------------------------------------------------------------------------


def figures(cfg_dict: dict, system: str, requests: list[SimRequest]) -> dict[int, dict]:
    """Each request's own figures (SimulatedSystem.request_records) in one run of `system`."""
    records: list[dict] = []
    cfg = parse_config({**cfg_dict, "workload": {"requests": len(requests)}})
    runner.simulate(cfg, system, requests=requests, request_records=records)
    return {r["rid"]: r for r in records}


@pytest.mark.parametrize("system", ["same-dc", "cross-dc"])
def test_every_engine_step_pays_the_per_step_part(system):
    """A prompt of 5 chunks alone: every token after the first is one step's host time later
    (the decode side's steps); in same-DC the first token is 5 steps' later (P's chunks, then
    the RDMA hop). (Cross-DC its KV crosses the line as the chunks finish, seconds of it: only
    the last chunk's step delays the crossing's end.)"""
    step_us = 300.0
    prompt = 5 * 2048 - 100  # 5 chunks of [engine] chunk_tokens
    req = [request(0, prompt, 64)]
    chunks = {"chunk_tokens": 2048}
    without = figures(config_dict(**chunks), system, req)[0]
    with_step = figures(config_dict(**chunks, host_latency_per_step_us=step_us), system, req)[0]
    steps_before_first = 5 if system == "same-dc" else 1
    assert with_step["ttft_s"] - without["ttft_s"] == pytest.approx(
        steps_before_first * step_us / 1e6, abs=1e-9
    )
    assert with_step["tpot_s"] - without["tpot_s"] == pytest.approx(step_us / 1e6, abs=1e-9)


def test_the_per_step_part_is_not_device_time_nor_what_a_policy_is_told():
    """RLD's time per token that P plans with is its forward's, as the relay daemon's
    step_s EWMA of its paced steps; the busy shares are the devices'."""
    from pddnet.sim.decode import DecodeInstance, Member
    from pddnet.sim.events import EventLoop
    from pddnet.sim.metrics import Histogram

    cfg = parse_config(config_dict())
    cost = SimulatedSystem(cfg, "pdd").relay[0].cost
    runs = {}
    for host_step in (0.0, 0.001):
        loop = EventLoop()
        inst = DecodeInstance(loop, cost, "RLD0", 8, 0.0, Histogram(), host_step_s=host_step)
        estimate = inst.step_time_estimate(4000)
        inst.add(Member(None, 4000, 100, 0.0, lambda m, t, made: None))
        loop.run()
        runs[host_step] = (estimate, inst.busy_s, loop.now)
    assert runs[0.001][0] == runs[0.0][0]
    assert runs[0.001][1] == pytest.approx(runs[0.0][1])
    assert runs[0.001][2] == pytest.approx(runs[0.0][2] + 100 * 0.001)
    with pytest.raises(ValueError, match="host_step_s"):
        DecodeInstance(EventLoop(), cost, "x", 8, 0.0, Histogram(), host_step_s=-1.0)
