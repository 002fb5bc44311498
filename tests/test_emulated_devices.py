"""Emulated accelerators (pddnet.device): step pacing, the roofline's arithmetic, the modelled
RDMA line, the config's validation, time dilation, and the engine worker on a paced clock.

Tests marked ``xfail(strict=True, reason="BUG: ...")`` document a defect of the code under test:
they fail today and turn into an XPASS failure (remove the marker) once it is fixed.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass

import pytest
from conftest import root_netns_missing_reason

from pddnet.cluster.wan_setup import TestbedPlacement, WanChoice, queue_bytes
from pddnet.config import ConfigError, load_config
from pddnet.device.cost import InstanceCost
from pddnet.device.dilation import (
    LINUX_TCP_RTO_MIN_MS,
    modelled_seconds,
    rdma_bytes_per_s,
    real_kv_bytes_per_token,
    tcp_rto_min_ms,
    wallclock,
    wire_rate,
)
from pddnet.device.emulated import Emulation, EmulationError, parse_device_flags
from pddnet.device.line import ModelledLine
from pddnet.device.pacer import VALID_OVERRUN_SHARE, StepPacer, dilation_for
from pddnet.device.profiles import load_chip, load_model
from pddnet.engine.engine import Engine
from pddnet.engine.worker import EngineWorker

# -- shared helpers ---------------------------------------------------------------------------

LLAMA = "llama-3-70b"
# The scenario: P and RLD on 8 x h100-sxm, MD on 8 x h200-sxm, k = 4.
SCENARIO = {
    "target_model": LLAMA,
    "dilation": 4.0,
    "prefill.device": "h100-sxm",
    "prefill.gpus": 8,
    "relay.device": "h100-sxm",
    "relay.gpus": 8,
    "main_decode.device": "h200-sxm",
    "main_decode.gpus": 8,
}


def llama_on(chip: str, gpus: int = 8) -> InstanceCost:
    return InstanceCost(load_chip(chip), load_model(LLAMA), gpus=gpus)


def config_error(overrides: dict) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


# -- 1. the pacer on a fake clock -------------------------------------------------------------

DECODE = [(100, 101)]  # one decode token at position 100: a shape with a fixed modelled time


@pytest.fixture(scope="module")
def h100_cost() -> InstanceCost:
    return llama_on("h100-sxm")


def test_pacer_waits_the_difference_to_k_times_modelled(h100_cost):
    pacer = StepPacer(h100_cost, dilation=4.0)
    m = pacer.modelled(DECODE)
    assert m > 0
    real = 1.5 * m  # below k x modelled = 4 m
    wait = pacer.pace(DECODE, started=100.0, ended=100.0 + real)
    assert wait == pytest.approx(4 * m - real, rel=1e-9)
    assert (pacer.steps, pacer.overruns, pacer.lost_s) == (1, 0, 0.0)
    assert pacer.waited_s == pytest.approx(2.5 * m, rel=1e-9)
    assert pacer.modelled_s == pytest.approx(m, rel=1e-12)  # undilated: the device's busy time
    assert pacer.real_s == pytest.approx(real, rel=1e-9)
    assert pacer.valid and pacer.overrun_share == 0.0


def test_pacer_overrun_waits_nothing_and_counts_the_lost_time(h100_cost):
    pacer = StepPacer(h100_cost, dilation=4.0)
    m = pacer.modelled(DECODE)
    pacer.pace(DECODE, 0.0, 2.0 * m)  # on time
    wait = pacer.pace(DECODE, 10.0, 10.0 + 6.0 * m)  # 6 m > 4 m: overran by 2 m
    assert wait == 0.0
    assert pacer.steps == 2 and pacer.overruns == 1
    assert pacer.lost_s == pytest.approx(2.0 * m, rel=1e-9)
    assert pacer.waited_s == pytest.approx(2.0 * m, rel=1e-9)  # only the on-time step waited
    assert pacer.overrun_share == 0.5
    assert pacer.worst_ratio == pytest.approx(6.0, rel=1e-9)
    stats = pacer.to_stats()
    assert stats["overruns"] == 1 and stats["valid"] is False and stats["steps"] == 2
    assert stats["dilation"] == 4.0


def test_pacer_a_step_exactly_at_k_times_modelled_is_not_an_overrun(h100_cost):
    pacer = StepPacer(h100_cost, dilation=2.0)
    m = pacer.modelled(DECODE)
    assert pacer.pace(DECODE, 0.0, 2.0 * m) == 0.0
    assert pacer.overruns == 0


def test_pacer_valid_at_the_threshold_and_not_above(h100_cost):
    assert VALID_OVERRUN_SHARE == 0.01
    pacer = StepPacer(h100_cost, dilation=2.0)
    m = pacer.modelled(DECODE)
    for i in range(100):  # 1 overrun in 100 steps: exactly the threshold
        pacer.pace(DECODE, 0.0, (3.0 if i == 50 else 1.0) * m)
    assert pacer.overrun_share == pytest.approx(0.01)
    assert pacer.valid
    pacer.pace(DECODE, 0.0, 3.0 * m)  # 2 in 101: above it
    assert pacer.overrun_share == pytest.approx(2 / 101)
    assert not pacer.valid


def test_pacer_dilation_needed_is_the_hand_computed_quantile(h100_cost):
    # 200 steps whose real / modelled ratios are 0.5, 0.55, ..., 10.45 (in shuffled order).
    # At 1% of 200, 2 steps may overrun: k is the 3rd largest ratio, 0.5 + 197 x 0.05 = 10.35,
    # rounded up to a tenth: 10.4.
    ratios = [0.5 + 0.05 * i for i in range(200)]
    random.Random(7).shuffle(ratios)
    pacer = StepPacer(h100_cost, dilation=1.0)
    m = pacer.modelled(DECODE)
    for r in ratios:
        pacer.pace(DECODE, 50.0, 50.0 + r * m)
    assert pacer.dilation_needed() == pytest.approx(10.4)
    assert pacer.to_stats()["dilation_needed"] == pytest.approx(10.4)
    # and it means what it says: replayed at that k the run is valid, a tenth lower it is not
    for k, valid in ((10.4, True), (10.3, False)):
        again = StepPacer(h100_cost, dilation=k)
        for r in ratios:
            again.pace(DECODE, 50.0, 50.0 + r * m)
        assert again.valid is valid, (k, again.overruns)
    assert again.overruns == 3


def test_pacer_dilation_needed_without_steps_or_slow_steps_is_one(h100_cost):
    pacer = StepPacer(h100_cost, dilation=3.0)
    assert pacer.dilation_needed() == 1.0
    m = pacer.modelled(DECODE)
    for _ in range(10):
        pacer.pace(DECODE, 0.0, 0.3 * m)
    assert pacer.dilation_needed() == 1.0


@pytest.mark.parametrize(
    "ratios, expected",
    [
        ([], 1.0),  # no steps: nothing asks for more than real time
        ([0.1, 0.5, 0.99], 1.0),  # all faster than the device: never below 1
        ([2.0] * 149 + [1000.0], 2.0),  # one outlier in 150 (1% = 1 step) is ignored
        ([2.0] * 101 + [1000.0], 2.0),  # ... in 102 as well
        ([2.0] * 98 + [1000.0], 1000.0),  # in 99 it is not: 1% of 99 is no step
        ([2.0] * 149 + [math.inf], 2.0),  # an infinite ratio is an outlier like any other
        ([1.0, math.inf], math.inf),  # an infinite one that counts: no k is enough
        ([1.23], 1.3),  # rounded up to a tenth
        ([2.0], 2.0),  # a tenth exactly stays
    ],
)
def test_dilation_for(ratios, expected):
    assert dilation_for(ratios) == pytest.approx(expected)


def test_dilation_for_share():
    xs = [1.0, 2.0, 3.0, 4.0]
    assert dilation_for(xs, share=0.0) == 4.0
    assert dilation_for(xs, share=0.5) == 2.0  # 2 of 4 may overrun: k = 2nd smallest


@pytest.mark.parametrize("k", [0.5, 0, -1, True, math.nan, math.inf, "4"])
def test_pacer_refuses_a_bad_dilation(h100_cost, k):
    with pytest.raises(ValueError, match="dilation must be a number >= 1"):
        StepPacer(h100_cost, dilation=k)


def test_pacer_refuses_a_step_that_ends_before_it_starts(h100_cost):
    pacer = StepPacer(h100_cost, dilation=2.0)
    with pytest.raises(ValueError, match="cannot end"):
        pacer.pace(DECODE, started=5.0, ended=4.9)
    assert pacer.steps == 0  # nothing was accounted


# -- 2. the roofline, by hand -------------------------------------------------------------------
# The figures below are copied from pddnet/device/profiles/{chips,models}/*.toml (checked by
# test_hand_literals_are_the_shipped_profiles) and the formula written out from cost.py's
# docstring, so the pacer is checked against arithmetic, not against itself.


@dataclass(frozen=True)
class HandChip:
    name: str
    fp8_tflops: float
    memory_bw_gbs: float
    scale_up_gbs: float
    compute_efficiency: float = 0.55
    bandwidth_efficiency: float = 0.75
    step_overhead_ms: float = 1.5


H100 = HandChip("h100-sxm", fp8_tflops=1979, memory_bw_gbs=3350, scale_up_gbs=900)
H200 = HandChip("h200-sxm", fp8_tflops=1979, memory_bw_gbs=4800, scale_up_gbs=900)
GPU_B = HandChip("gpu-b", fp8_tflops=600, memory_bw_gbs=4800, scale_up_gbs=900)

# llama-3-70b: 80 layers, hidden 8192, 64 heads, 8 KV heads, head_dim 128, 70.6e9 params in fp8
# (1 byte each), BF16 KV (2 bytes).
L_LAYERS, L_HIDDEN, L_HEADS, L_KV_HEADS, L_HEAD_DIM = 80, 8192, 64, 8, 128
L_PARAMS = 70.6e9
L_KV_BYTES_PER_TOKEN = 80 * 2 * 8 * 128 * 2  # K and V per layer: 327680 = 320 KiB


def hand_forward_time(chip: HandChip, chunks: list[tuple[int, int]], gpus: int) -> float:
    new = sum(end - start for start, end in chunks)
    cached = sum(start for start, _ in chunks)
    # the token at position i attends to positions 0..i: i + 1 (query, key) pairs
    pairs = sum(sum(i + 1 for i in range(start, end)) for start, end in chunks)
    flops = 2 * L_PARAMS * new + 4 * L_LAYERS * L_HEADS * L_HEAD_DIM * pairs
    nbytes = L_PARAMS * 1 + (cached + new) * L_KV_BYTES_PER_TOKEN
    compute = gpus * chip.fp8_tflops * 1e12 * chip.compute_efficiency
    bandwidth = gpus * chip.memory_bw_gbs * 1e9 * chip.bandwidth_efficiency
    # two bf16 all-reduces of the activations per layer; a ring sends 2 (g - 1) / g of them,
    # at one direction's rate (half the datasheet's both-ways scale_up figure)
    comm = 0.0
    if gpus > 1:
        per_token = 2 * L_LAYERS * L_HIDDEN * 2 * 2 * (gpus - 1) / gpus
        comm = per_token * new / (chip.scale_up_gbs * 1e9 / 2)
    # per_seq and per_ctx are 0 on these GPU profiles
    return chip.step_overhead_ms * 1e-3 + max(flops / compute, nbytes / bandwidth) + comm


PREFILL_2K = [(0, 2048)]  # (a)
PREFILL_ON_PREFIX = [(60000, 62048)]  # (b) on a cached 60000 tokens
DECODE_4 = [(1000, 1001), (2000, 2001), (3000, 3001), (4000, 4001)]  # (c)
EXTEND_ON_64K = [(65536, 65636), (1000, 1001), (2000, 2001), (3000, 3001)]  # (d)


@pytest.mark.parametrize(
    "chip, gpus, chunks",
    [
        pytest.param(H100, 8, PREFILL_2K, id="P-h100-prefill-0-2048"),
        pytest.param(H100, 8, PREFILL_ON_PREFIX, id="P-h100-prefill-60000-62048"),
        pytest.param(H100, 8, DECODE_4, id="RLD-h100-decode-4"),
        pytest.param(H100, 8, EXTEND_ON_64K, id="RLD-h100-extend-100-on-64K"),
        pytest.param(H200, 8, DECODE_4, id="MD-h200-decode-4"),
        pytest.param(H200, 8, EXTEND_ON_64K, id="MD-h200-extend-100-on-64K"),
        pytest.param(GPU_B, 8, DECODE_4, id="MD-gpu-b-decode-4"),
        pytest.param(GPU_B, 8, EXTEND_ON_64K, id="MD-gpu-b-extend-100-on-64K"),
        pytest.param(GPU_B, 8, PREFILL_2K, id="gpu-b-prefill-0-2048"),
        pytest.param(H200, 1, DECODE_4, id="1xh200-decode-4-no-all-reduce"),
    ],
)
def test_pacer_modelled_time_is_the_hand_roofline(chip, gpus, chunks):
    pacer = StepPacer(llama_on(chip.name, gpus), dilation=4.0)
    expected = hand_forward_time(chip, chunks, gpus)
    assert pacer.modelled(chunks) == pytest.approx(expected, rel=1e-9)


def test_hand_roofline_regimes_on_h100():
    # the max() decides: a 2K prefill chunk is compute-bound, a decode step memory-bound
    compute = 8 * 1979e12 * 0.55
    bandwidth = 8 * 3350e9 * 0.75
    prefill_flops = 2 * L_PARAMS * 2048 + 4 * 80 * 64 * 128 * (2048 * 2049 / 2)
    prefill_bytes = L_PARAMS + 2048 * L_KV_BYTES_PER_TOKEN
    assert prefill_flops / compute > prefill_bytes / bandwidth
    decode_flops = 2 * L_PARAMS * 4 + 4 * 80 * 64 * 128 * (1001 + 2001 + 3001 + 4001)
    decode_bytes = L_PARAMS + (10000 + 4) * L_KV_BYTES_PER_TOKEN
    assert decode_flops / compute < decode_bytes / bandwidth
    pacer = StepPacer(llama_on("h100-sxm"), dilation=1.0)
    # ~56 ms and ~5.2 ms: a cached prefix makes a chunk dearer (attention over 60K positions)
    assert pacer.modelled(PREFILL_2K) == pytest.approx(0.0562198, rel=1e-5)
    assert pacer.modelled(DECODE_4) == pytest.approx(0.0052163, rel=1e-4)
    assert pacer.modelled(PREFILL_ON_PREFIX) > pacer.modelled(PREFILL_2K)


def test_hand_literals_are_the_shipped_profiles():
    for hand in (H100, H200, GPU_B):
        chip = load_chip(hand.name)
        assert chip.tflops["fp8"] == hand.fp8_tflops
        assert (chip.memory_bw_gbs, chip.scale_up_gbs) == (hand.memory_bw_gbs, hand.scale_up_gbs)
        assert (chip.compute_efficiency, chip.bandwidth_efficiency, chip.step_overhead_ms) == (
            hand.compute_efficiency,
            hand.bandwidth_efficiency,
            hand.step_overhead_ms,
        )
        assert (chip.step_per_seq_us, chip.step_per_ctx_token_ns, chip.step_jitter_cv) == (0, 0, 0)
    m = load_model(LLAMA)
    assert (m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_dim) == (
        L_LAYERS,
        L_HIDDEN,
        L_HEADS,
        L_KV_HEADS,
        L_HEAD_DIM,
    )
    assert (m.total_params, m.active_params, m.expert_params) == (L_PARAMS, L_PARAMS, 0)
    assert (m.compute_dtype, m.weight_bytes_per_param, m.kv_bytes_per_elem) == ("fp8", 1, 2)
    assert m.kv_bytes_per_token == L_KV_BYTES_PER_TOKEN == 320 * 1024


def test_modelled_time_does_not_depend_on_dilation():
    cost = llama_on("h200-sxm")
    assert StepPacer(cost, 1.0).modelled(DECODE_4) == StepPacer(cost, 7.5).modelled(DECODE_4)


@pytest.mark.parametrize("chip", ["h100-sxm", "h200-sxm", "gpu-b"])
def test_paced_decode_step_is_the_simulators_decode_step(chip):
    # one cost function for the simulator and the emulation: a decode step of 4 sequences at
    # 1000..4000 positions costs what the simulator's decode_step_time says
    cost = llama_on(chip)
    assert StepPacer(cost, 4.0).modelled(DECODE_4) == pytest.approx(
        cost.decode_step_time(4, 1000 + 2000 + 3000 + 4000, jitter=False), rel=1e-9
    )


def test_paced_extend_step_is_the_simulators_extend_step():
    # the extend's own 64K cached positions are read too (the simulator once left them out
    # and priced this forward at 6.197 ms against 7.230 ms)
    cost = llama_on("h100-sxm")
    extend_pairs = sum(i + 1 for i in range(65536, 65636))
    sim = cost.decode_step_time(
        3,
        1000 + 2000 + 3000,
        extend_tokens=100,
        extend_pairs=extend_pairs,
        jitter=False,
        extend_context=65536,
    )
    assert StepPacer(cost, 4.0).modelled(EXTEND_ON_64K) == pytest.approx(sim, rel=1e-6)


# -- 3. the modelled line -------------------------------------------------------------------------


def test_line_back_to_back_writes_queue_fifo():
    line = ModelledLine(1000.0)  # 1000 B/s
    assert line.complete(0.0, 500, now=0.1) == pytest.approx(0.4)  # done at 0.5
    # starts at 0.2 while the first is still on the line: done at 0.5 + 1000 / 1000
    assert line.complete(0.2, 1000, now=0.3) == pytest.approx(1.2)
    assert line.free_at == pytest.approx(1.5)
    assert (line.writes, line.bytes, line.overruns) == (2, 1500, 0)


def test_line_write_after_idle_starts_at_its_start():
    line = ModelledLine(1000.0)
    line.complete(0.0, 500, now=0.5)
    assert line.complete(10.0, 100, now=10.01) == pytest.approx(0.09)  # done at 10.1
    assert line.free_at == pytest.approx(10.1)


def test_line_overrun_is_counted():
    line = ModelledLine(1000.0)
    assert line.complete(20.0, 100, now=20.5) == 0.0  # modelled done at 20.1
    assert line.overruns == 1
    assert line.lost_s == pytest.approx(0.4)
    assert line.to_stats()["overruns"] == 1
    assert line.complete(30.0, 0, now=30.0) == 0.0  # an empty write on time
    assert line.overruns == 1


@pytest.mark.parametrize("rate", [0, -1.0, math.inf, math.nan, True, "1e9"])
def test_line_refuses_a_bad_rate(rate):
    with pytest.raises(ValueError, match="rate must be a finite number"):
        ModelledLine(rate)


@pytest.mark.parametrize("started, nbytes, now", [(1.0, -1, 2.0), (2.0, 10, 1.0)])
def test_line_refuses_a_bad_write(started, nbytes, now):
    with pytest.raises(ValueError, match="bad write"):
        ModelledLine(1000.0).complete(started, nbytes, now)


# -- 4. emulation and config validation --------------------------------------------------------


def test_scenario_emulation_resolves_every_role():
    emulation = load_config(None, SCENARIO).emulation()
    assert emulation is not None
    assert emulation.describe() == {
        "target_model": LLAMA,
        "dilation": 4.0,
        "target_kv_bytes_per_token": 327680,
        "devices": {
            "prefill": "8 x h100-sxm",
            "relay": "8 x h100-sxm",
            "main_decode": "8 x h200-sxm",
        },
    }
    assert emulation.cost_of("main_decode") == llama_on("h200-sxm")
    assert emulation.wire_scale(1024) == 1024 / 327680
    with pytest.raises(EmulationError):
        emulation.wire_scale(0)


def test_no_target_model_is_no_emulation():
    assert load_config(None, {}).emulation() is None


def test_unknown_chip():
    msg = config_error({**SCENARIO, "relay.device": "h999"})
    assert "unknown chip profile 'h999'" in msg and "h100-sxm" in msg


def test_unknown_model():
    msg = config_error({**SCENARIO, "target_model": "llama-9"})
    assert "unknown model profile 'llama-9'" in msg and LLAMA in msg


@pytest.mark.parametrize("k", [0.5, math.inf, math.nan])
def test_bad_dilation(k):
    assert "dilation must be a number >= 1" in config_error({**SCENARIO, "dilation": k})


def test_dilation_without_target_model():
    assert "no target_model" in config_error({"dilation": 4.0})


def test_device_without_target_model():
    msg = config_error({"prefill.device": "h100-sxm"})
    assert "device set for prefill but no target_model" in msg


@pytest.mark.parametrize(
    "mode, devices, missing",
    [
        ("pdd", ("prefill", "relay"), "main_decode"),
        ("pdd", ("relay", "main_decode"), "prefill"),
        ("same-dc", ("prefill",), "relay"),
        ("cross-dc", ("prefill", "relay"), "main_decode"),
    ],
)
def test_role_of_the_mode_without_device(mode, devices, missing):
    overrides = {
        "mode": mode,
        "target_model": LLAMA,
        **{f"{r}.device": "h100-sxm" for r in devices},
        **{f"{r}.gpus": 8 for r in devices},
    }
    msg = config_error(overrides)
    assert f"{missing} has no device" in msg and f"mode {mode}" in msg


@pytest.mark.parametrize(
    "mode, devices",
    [
        ("same-dc", ("prefill", "relay")),
        ("cross-dc", ("prefill", "main_decode")),
        ("pdd", ("prefill", "relay", "main_decode")),
    ],
)
def test_mode_needs_only_its_roles_devices(mode, devices):
    overrides = {
        "mode": mode,
        "target_model": LLAMA,
        **{f"{r}.device": "h200-sxm" for r in devices},
        **{f"{r}.gpus": 8 for r in devices},
    }
    config = load_config(None, overrides)
    assert config.mode.model_roles == devices
    emulation = config.emulation()
    assert emulation is not None and tuple(emulation.devices) == devices


def test_pool_that_does_not_fit_the_modelled_chips_names_the_max_num_blocks():
    # 1 x h100: 80 GB x 0.9 - 70.6 GB of weights = 1.4 GB = 4272 tokens of 320 KiB = 267 blocks
    # of 16; P's default pool is 1024 blocks
    msg = config_error({**SCENARIO, "prefill.gpus": 1})
    assert msg.startswith("prefill:")
    assert "4272 tokens" in msg and "prefill.num_blocks <= 267" in msg
    load_config(None, {**SCENARIO, "prefill.gpus": 1, "prefill.num_blocks": 267})
    assert "<= 267" in config_error({**SCENARIO, "prefill.gpus": 1, "prefill.num_blocks": 268})


def test_weights_that_do_not_fit_the_modelled_chips():
    msg = config_error({**SCENARIO, "target_model": "deepseek-v3"})  # 671 GB on 8 x 80 GB
    assert msg.startswith("prefill:") and "does not fit on 8 x h100-sxm" in msg


def test_gpus_zero():
    assert "prefill.gpus must be >= 1, got 0" in config_error({**SCENARIO, "prefill.gpus": 0})
    with pytest.raises(ValueError, match="gpus per instance"):
        llama_on("h100-sxm", gpus=0)


def test_parse_device_flags():
    assert parse_device_flags(["md=h200-sxm:8"]) == {
        "main_decode.device": "h200-sxm",
        "main_decode.gpus": 8,
    }
    assert parse_device_flags(["prefill=h100-sxm:8", "RLD=h100-sxm", "main-decode=gpu-b"]) == {
        "prefill.device": "h100-sxm",
        "prefill.gpus": 8,
        "relay.device": "h100-sxm",
        "main_decode.device": "gpu-b",
    }
    assert parse_device_flags([]) == {}


@pytest.mark.parametrize(
    "flag, message",
    [
        ("router=h100", "runs no model"),
        ("wan=h100-sxm", "runs no model"),
        ("prefill", "ROLE=CHIP[:GPUS]"),
        ("prefill=", "ROLE=CHIP[:GPUS]"),
        ("p=:8", "ROLE=CHIP[:GPUS]"),
        ("p=h100-sxm:0", "GPUS must be an integer >= 1"),
        ("p=h100-sxm:-1", "GPUS must be an integer >= 1"),
        ("p=h100-sxm:x", "GPUS must be an integer >= 1"),
        ("p=h100-sxm:", "GPUS must be an integer >= 1"),
        ("p=h100-sxm:1.5", "GPUS must be an integer >= 1"),
    ],
)
def test_parse_device_flags_refuses(flag, message):
    with pytest.raises(EmulationError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_device_flags([flag])


def test_parse_device_flags_refuses_a_unicode_digit_with_its_message():
    with pytest.raises(EmulationError, match="GPUS must be an integer >= 1"):
        parse_device_flags(["p=h100-sxm:²"])


# -- 5. dilation arithmetic ---------------------------------------------------------------------

TINY_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 8  # layers x (K, V) x kv heads x head_dim x float64
WIRE_SCALE = TINY_KV_BYTES_PER_TOKEN / 327680  # = 1 / 320


@pytest.fixture
def user_config():
    return load_config(
        None,
        {
            **SCENARIO,
            "wan.jitter_ms": 2.0,
            "wan.queue_ms": 10.0,
            "policy.wan_bw_mbit": 500.0,
            "transport.abort_grace_s": 1.5,
        },
    )


def test_real_kv_bytes_of_the_tiny_preset(user_config):
    assert user_config.model.name == "tiny"
    assert real_kv_bytes_per_token(user_config.model) == TINY_KV_BYTES_PER_TOKEN == 1024


def test_wallclock_dilates_times_and_scales_rates(user_config):
    c = user_config
    w = wallclock(c)
    assert w is not c
    k = 4.0
    for section, field in [
        ("wan", "rtt_ms"),
        ("wan", "jitter_ms"),
        ("wan", "queue_ms"),
        ("wan", "heartbeat_s"),
        ("wan", "heartbeat_deadline_s"),
        ("transport", "deadline_s"),
        ("transport", "abort_grace_s"),
        ("router", "request_timeout_s"),
        ("router", "stall_timeout_s"),
        ("policy", "direct_budget_s"),
        ("policy", "rld_step_s"),
    ]:
        before = getattr(getattr(c, section), field)
        assert before > 0, (section, field)
        assert getattr(getattr(w, section), field) == pytest.approx(before * k), (section, field)
    assert w.transport.progress_timeout_s == math.ceil(c.transport.progress_timeout_s * k)
    assert w.wan.bw_mbit == pytest.approx(1000.0 * WIRE_SCALE / k)  # 0.78125
    assert w.policy.wan_bw_mbit == pytest.approx(500.0 * WIRE_SCALE / k)
    # a goodput sample weighs fully from the same target bytes: in real bytes, scaled (not / k)
    assert c.policy.goodput_full_weight_bytes == 1 << 20
    assert w.policy.goodput_full_weight_bytes == round((1 << 20) * WIRE_SCALE)
    # the queue holds the same real bytes at any k: 10 ms of the target's 1 Gbit/s, scaled
    assert queue_bytes(w.wan) == int(1000e6 / 8 * 0.010 * WIRE_SCALE)
    assert queue_bytes(c.wan) == int(1000e6 / 8 * 0.010)
    # the user's config is not touched; what is not a time stays
    assert (c.wan.rtt_ms, c.wan.bw_mbit, c.router.stall_timeout_s) == (30.0, 1000.0, 30.0)
    assert (w.wan.stripes, w.wan.loss_pct, w.dilation, w.target_model) == (
        c.wan.stripes,
        c.wan.loss_pct,
        4.0,
        LLAMA,
    )


def test_the_live_planner_weighs_a_goodput_sample_as_the_simulator_does(user_config):
    # The same transfer, 100 tokens of the target's KV over 1 modelled s: the daemon sees
    # the real model's bytes over k x the time, the simulator the target's over the modelled
    # time. Both estimates must move alike (with 1 MiB against real bytes the live one barely
    # moved on small transfers: P's plans then parted from the simulator's).
    from pddnet.policy.estimators import BandwidthEstimator
    from pddnet.roles.prefill_planning import make_planner

    w, k = wallclock(user_config), 4.0
    live = make_planner(w, TINY_KV_BYTES_PER_TOKEN).bandwidth
    sim = BandwidthEstimator(initial_bps=500e6 / 8)  # the config's policy.wan_bw_mbit
    assert live.bytes_per_s == pytest.approx(sim.bytes_per_s * WIRE_SCALE / k)
    tokens, seconds = 100, 1.0
    live.observe(tokens * TINY_KV_BYTES_PER_TOKEN, seconds * k)
    sim.observe(tokens * 327680, seconds)
    assert sim.bytes_per_s < 500e6 / 8 * 0.95  # the sample moved it
    assert live.bytes_per_s == pytest.approx(sim.bytes_per_s * WIRE_SCALE / k)


def test_the_testbed_of_a_dilated_cluster_dilates_tcps_minimum_rto(user_config):
    assert tcp_rto_min_ms(1.0) is None  # the kernel's own
    assert tcp_rto_min_ms(2.5) == pytest.approx(2.5 * LINUX_TCP_RTO_MIN_MS) == 500.0
    placement = TestbedPlacement(WanChoice("packet", "test"), user_config)  # makes nothing yet
    assert placement.testbed.tcp_rto_min_ms == pytest.approx(4.0 * 200.0)
    assert placement.describe()["tcp_rto_min_ms"] == pytest.approx(800.0)
    plain = load_config(None, {"wan.rtt_ms": 30.0})
    assert TestbedPlacement(WanChoice("packet", "test"), plain).testbed.tcp_rto_min_ms is None


@pytest.mark.skipif(
    root_netns_missing_reason() is not None, reason=str(root_netns_missing_reason())
)
async def test_a_dilated_cluster_on_hosts_gives_every_daemons_namespace_the_dilated_rto(
    user_config, tmp_path, monkeypatch
):
    """With one namespace per daemon the TCP endpoints are there, not in the testbed's two:
    each gets k x 200 ms too (the placement alone, no daemons)."""
    from emulation import netns
    from pddnet.cluster.wan_setup import HostsPlacement

    monkeypatch.setenv("PDD_STATE_DIR", str(tmp_path / "state"))
    placement = HostsPlacement(WanChoice("packet", "test"), user_config)
    made = [*placement.hosts.values(), placement.testbed.ns_a, placement.testbed.ns_b]
    try:
        await placement.start()
        for ns in made:
            assert netns.read_sysctl(ns, "net.ipv4.tcp_rto_min_us") == "800000", ns
    finally:
        await placement.close()
    assert not [ns for ns in made if netns.exists(ns)]


def test_wallclock_is_idempotent(user_config):
    w = wallclock(user_config)
    assert wallclock(w) is w
    assert wallclock(w).wan.rtt_ms == pytest.approx(120.0)


def test_user_config_on_disk_stays_the_users(user_config, tmp_path):
    path = tmp_path / "cluster.toml"
    path.write_text(user_config.to_toml())
    again = load_config(path)
    assert again == user_config
    assert again.wan.rtt_ms == 30.0 and again.dilation == 4.0
    assert wallclock(again).wan.rtt_ms == pytest.approx(120.0)


def test_wallclock_of_an_unemulated_config_is_the_config():
    c = load_config(None, {"wan.rtt_ms": 30.0})
    assert wallclock(c) is c
    assert rdma_bytes_per_s(c) is None


def test_rdma_rate(user_config):
    # P's 8 NICs of 400 Gbit/s, carrying the tiny model's KV for llama's, at k = 4
    assert rdma_bytes_per_s(user_config) == pytest.approx(8 * 400e9 / 8 * WIRE_SCALE / 4.0)
    assert rdma_bytes_per_s(user_config) == pytest.approx(312.5e6)


def test_wire_rate_and_modelled_seconds(user_config):
    emulation = user_config.emulation()
    assert wire_rate(emulation, 1e9, 1024) == pytest.approx(1e9 / 320 / 4)
    assert modelled_seconds(8.0, 4.0) == 2.0


# -- 6. the engine worker on a paced clock -----------------------------------------------------

FAST = """
name = "{name}"
memory_gb = 1
memory_bw_gbs = 1e9
scale_up_gbs = 1e9
scale_out_gbit = 1e9
price_per_hour = 0
compute_efficiency = 1.0
bandwidth_efficiency = 1.0
step_overhead_ms = {overhead_ms}

[tflops]
fp32 = 1e9
"""
STEP_MS = 5.0


def chip_file(tmp_path, name: str, overhead_ms: float):
    path = tmp_path / f"{name}.toml"
    path.write_text(FAST.format(name=name, overhead_ms=overhead_ms))
    return path


class RecordingPacer(StepPacer):
    """A StepPacer that remembers each forward it paced: (chunks, real seconds, wait)."""

    def __init__(self, cost: InstanceCost, dilation: float) -> None:
        super().__init__(cost, dilation)
        self.calls: list[tuple[tuple[tuple[int, int], ...], float, float]] = []

    def pace(self, chunks, started, ended):
        wait = super().pace(chunks, started, ended)
        self.calls.append((tuple(chunks), ended - started, wait))
        return wait


@pytest.fixture(scope="module")
def tiny():
    from pddnet.model.loader import load_model as load_real_model

    return load_real_model("tiny")


def tiny_prompts(tok) -> list[list[int]]:
    return [tok.encode(text, add_bos=True) for text in ("the quick brown fox", "paced relay")]


async def run_paced(model, tok, pacer: StepPacer, max_tokens: int):
    """Both prompts through an EngineWorker with `pacer`: (tokens by id, engine, paced steps,
    wall seconds from the first call to the last output)."""
    engine = Engine(model, tok, num_blocks=64, block_size=4)
    tokens: dict[str, list[int]] = {}
    finished: set[str] = set()
    steps = []
    changed = asyncio.Event()

    def on_outputs(outputs):
        for out in outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished.add(out.request_id)
        changed.set()

    errors: list[BaseException] = []
    worker = EngineWorker(
        engine,
        on_outputs,
        name="test-paced",
        pacer=pacer,
        on_step_stats=steps.append,
        on_error=errors.append,
    )
    try:
        t0 = time.perf_counter()
        ids = [
            await worker.call(engine.add_request, p, max_tokens, None, f"r{i}", ignore_eos=True)
            for i, p in enumerate(tiny_prompts(tok))
        ]
        async with asyncio.timeout(60):
            while finished != set(ids):
                changed.clear()
                await changed.wait()
        elapsed = time.perf_counter() - t0
    finally:
        await worker.close()
    assert not errors
    return tokens, engine, steps, elapsed


async def test_paced_worker_is_token_exact_and_lasts_the_modelled_time(tiny, tmp_path):
    model, tok = tiny
    k = 2.0
    cost = InstanceCost(load_chip(chip_file(tmp_path, "paced", STEP_MS)), load_model("tiny"))
    pacer = RecordingPacer(cost, k)
    assert pacer.modelled([(0, 8)]) == pytest.approx(STEP_MS * 1e-3, rel=1e-6)

    reference = Engine(model, tok, num_blocks=64, block_size=4)
    expected = [reference.generate(p, 6, ignore_eos=True) for p in tiny_prompts(tok)]
    tokens, engine, steps, elapsed = await run_paced(model, tok, pacer, 6)

    assert [tokens["r0"], tokens["r1"]] == expected
    # one paced forward per engine forward, each seen once by on_step_stats
    assert pacer.steps == engine.num_steps == len(pacer.calls) == len(steps) > 0
    assert [s.step for s in steps] == list(range(1, engine.num_steps + 1))
    for step, (chunks, real, wait) in zip(steps, pacer.calls, strict=True):
        assert step.chunks == chunks
        assert step.duration_s == pytest.approx(real + wait, rel=1e-12, abs=1e-12)
        assert step.duration_s >= real
        # a paced step lasts at least k x its modelled time
        assert step.duration_s >= k * pacer.modelled(chunks) * (1 - 1e-9)
    assert engine.last_step == steps[-1]  # the engine's last step is the paced one
    assert engine.last_step.duration_s >= pacer.calls[-1][1]
    # steps run one after another in one thread: the run lasts at least their paced times
    assert elapsed >= pacer.steps * k * STEP_MS * 1e-3 - 1e-3
    assert pacer.modelled_s == pytest.approx(sum(pacer.modelled(c) for c, _, _ in pacer.calls))


async def test_paced_worker_on_an_impossibly_fast_device_overruns_every_step(tiny, tmp_path):
    model, tok = tiny
    cost = InstanceCost(load_chip(chip_file(tmp_path, "instant", 0)), load_model("tiny"))
    pacer = RecordingPacer(cost, 1.0)
    assert pacer.modelled([(0, 8)]) < 1e-9  # no real forward can be this fast

    reference = Engine(model, tok, num_blocks=64, block_size=4)
    expected = [reference.generate(p, 4, ignore_eos=True) for p in tiny_prompts(tok)]
    tokens, engine, steps, _ = await run_paced(model, tok, pacer, 4)

    assert [tokens["r0"], tokens["r1"]] == expected  # overruns never change tokens
    assert pacer.steps == engine.num_steps > 0
    assert pacer.overruns == pacer.steps
    assert pacer.waited_s == 0.0 and all(wait == 0.0 for _, _, wait in pacer.calls)
    assert pacer.lost_s > 0
    assert not pacer.valid and pacer.overrun_share == 1.0
    assert pacer.dilation_needed() > 1
    stats = pacer.to_stats()
    assert stats["valid"] is False and stats["overruns"] == stats["steps"]
    # unpaced in effect: the step's time is the real one
    assert engine.last_step.duration_s == pacer.calls[-1][1]


def test_emulation_accepts_a_chip_toml_path(tmp_path):
    path = chip_file(tmp_path, "paced", STEP_MS)
    devices = {f"{r}.device": str(path) for r in ("prefill", "relay", "main_decode")}
    config = load_config(None, {"target_model": "tiny", "dilation": 2.0, **devices})
    emulation = Emulation.from_config(config)
    assert emulation is not None
    assert emulation.describe()["devices"]["relay"] == "1 x paced"
    assert emulation.wire_scale(1024) == 1.0  # the tiny target's own KV: no byte scaling
