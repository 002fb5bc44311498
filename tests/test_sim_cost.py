"""Profiles as data, and the roofline cost model on hand-computed cases."""

import pytest

from pddnet.device.cost import InstanceCost, prefill_flops
from pddnet.device.profiles import list_profiles, load_chip, load_model
from pddnet.model.config import ModelConfig

CHIP = """
name = "unit-chip"
memory_gb = 100
memory_bw_gbs = 100
scale_up_gbs = 100
scale_out_gbit = 80
price_per_hour = 1.0
compute_efficiency = 1.0
bandwidth_efficiency = 1.0
step_overhead_ms = 0.0
[tflops]
fp32 = 1.0
"""
MODEL = """
name = "unit-model"
num_layers = 2
hidden_size = 64
num_heads = 4
num_kv_heads = 2
head_dim = 16
total_params = 1e9
active_params = 1e9
compute_dtype = "fp32"
weight_bytes_per_param = 2
kv_bytes_per_elem = 2
"""


@pytest.fixture
def unit(tmp_path):
    (tmp_path / "chip.toml").write_text(CHIP)
    (tmp_path / "model.toml").write_text(MODEL)
    return InstanceCost(load_chip(tmp_path / "chip.toml"), load_model(tmp_path / "model.toml"))


def test_prefill_time_is_its_flops_over_compute(unit):
    # 1000 new tokens: 2 * 1e9 * 1000 matmul FLOPs + 4 * 2 layers * 4 heads * 16 * (1000*1001/2)
    # attention FLOPs, at 1 TFLOP/s; the 2 GB of weights at 100 GB/s take only 0.02 s.
    want = (2e9 * 1000 + 4 * 2 * 4 * 16 * 1000 * 1001 / 2) / 1e12
    assert unit.prefill_chunk_time(0, 1000) == pytest.approx(want)
    assert unit.prefill_time(0, 1000, chunk=1000) == pytest.approx(want)
    # the calibration fits P's rate to these FLOPs: the very ones the cost model charges
    assert prefill_flops(unit.model, 1000) / 1e12 == pytest.approx(want)


def test_decode_step_time_is_its_bytes_over_bandwidth(unit):
    kvpt = 2 * 2 * 2 * 16 * 2  # layers * (K,V) * kv heads * head_dim * bytes = 256
    assert unit.model.kv_bytes_per_token == kvpt
    # batch 8 over 8000 context tokens: weights + KV read + KV written, at 100 GB/s
    want = (2e9 + (8000 + 8) * kvpt) / 100e9
    assert unit.decode_step_time(8, 8000) == pytest.approx(want)
    # 64 extend tokens batched in: 72 tokens of matmuls make this weak chip compute-bound
    ext = unit.decode_step_time(8, 8000, extend_tokens=64, extend_pairs=64 * 8000)
    assert ext == pytest.approx((2e9 * 72 + 4 * 2 * 4 * 16 * (8000 + 64 * 8000)) / 1e12)


def test_tensor_parallel_step_adds_a_ring_all_reduce_at_one_directions_rate(unit):
    two = InstanceCost(unit.chip, unit.model, gpus=2)
    # two all-reduces per layer of 64 bf16 activations per token, each GPU sending 2 (g-1)/g of
    # them: 2 * 2 layers * 64 * 2 B * 1 = 512 B per token, at 50 GB/s (100 GB/s both ways)
    comm = 512 / 50e9
    # batch 8 over 8000 context tokens: memory-bound on twice the bandwidth, plus 8 tokens' comm
    want = (2e9 + (8000 + 8) * 256) / 200e9 + 8 * comm
    assert two.decode_step_time(8, 8000) == pytest.approx(want)


def test_capacity_and_model_that_does_not_fit(unit, tmp_path):
    assert unit.kv_capacity_bytes == pytest.approx(100e9 * 0.9 - 2e9)
    assert unit.kv_capacity_tokens() == int((90e9 - 2e9) // 256)
    big = load_model("deepseek-v3")
    with pytest.raises(ValueError, match="does not fit"):
        InstanceCost(unit.chip, big, gpus=1)
    assert InstanceCost(load_chip("gpu-b"), big, gpus=8).kv_capacity_tokens() > 0


def test_moe_reads_the_experts_a_batch_routes_to():
    m = load_model("deepseek-v3")
    c = InstanceCost(load_chip("gpu-a"), m, gpus=16)
    dense = (m.total_params - m.expert_params) * m.weight_bytes_per_param
    one = c.weight_bytes_touched(1)
    assert one == pytest.approx(dense + m.expert_params * 8 / 256)
    assert c.weight_bytes_touched(4096) == pytest.approx(m.weight_bytes, rel=1e-6)


def test_shipped_profiles_load_and_match_the_presets():
    assert {"gpu-a", "gpu-b", "h100-sxm", "h20"} <= set(list_profiles("chips"))
    for name in list_profiles("chips"):
        assert load_chip(name).price_per_hour >= 0
    for name in ("tiny", "tiny-long", "small", "medium"):
        prof, preset = load_model(name), ModelConfig.preset(name)
        assert prof.kv_bytes_per_token == preset.kv_bytes_per_token
        assert prof.total_params == preset.num_parameters
    assert load_model("deepseek-v3").kv_bytes_per_token == 61 * 576 * 2


def test_bad_profiles_are_rejected_with_the_field_named(tmp_path):
    p = tmp_path / "bad.toml"
    p.write_text(CHIP.replace("memory_bw_gbs = 100", "memory_bw_gbs = -1"))
    with pytest.raises(ValueError, match="memory_bw_gbs"):
        load_chip(p)
    p.write_text("warp_speed = 9\n" + CHIP)
    with pytest.raises(ValueError, match="unknown field.*warp_speed"):
        load_chip(p)
    with pytest.raises(ValueError, match="unknown chip profile"):
        load_chip("no-such-chip")
    p.write_text(CHIP)
    with pytest.raises(ValueError, match="no bf16 rate"):
        load_chip(p).flops_per_s("bf16")


def _host_terms(tmp_path, per_seq_us: float, per_ctx_ns: float) -> InstanceCost:
    # the [tflops] table must stay last: the new keys go before it
    head, table = CHIP.split("[tflops]")
    text = (
        head
        + f"step_per_seq_us = {per_seq_us}\nstep_per_ctx_token_ns = {per_ctx_ns}\n"
        + "[tflops]"
        + table
    )
    (tmp_path / "host.toml").write_text(text)
    (tmp_path / "model.toml").write_text(MODEL)
    return InstanceCost(load_chip(tmp_path / "host.toml"), load_model(tmp_path / "model.toml"))


def test_per_sequence_and_per_context_terms_add_to_a_decode_step(tmp_path):
    c = _host_terms(tmp_path, per_seq_us=500.0, per_ctx_ns=200.0)
    kvpt = 256
    roofline = (2e9 + (8000 + 8) * kvpt) / 100e9  # as in the memory-bound case above
    # 8 sequences x 0.5 ms, and 8000 cached + 8 new context tokens x 200 ns
    want = roofline + 8 * 500e-6 + (8000 + 8) * 200e-9
    assert c.decode_step_time(8, 8000) == pytest.approx(want)
    # the batch grows: each extra sequence costs its 0.5 ms plus its context and KV bytes
    one = c.decode_step_time(1, 1000)
    assert one == pytest.approx((2e9 + 1001 * kvpt) / 100e9 + 500e-6 + 1001 * 200e-9)


def test_host_terms_in_prefill_and_extend(tmp_path):
    c = _host_terms(tmp_path, per_seq_us=500.0, per_ctx_ns=200.0)
    flops = 2e9 * 1000 + 4 * 2 * 4 * 16 * 1000 * 1001 / 2
    # a prefill chunk is one sequence; it attends its 1000 new tokens
    assert c.prefill_chunk_time(0, 1000) == pytest.approx(flops / 1e12 + 500e-6 + 1000 * 200e-9)
    # a chunk on a cached prefix [0, 3000) also gathers the 3000 cached positions
    pairs = (4000 * 4001 - 3000 * 3001) / 2
    want = (2e9 * 1000 + 4 * 2 * 4 * 16 * pairs) / 1e12 + 500e-6 + 4000 * 200e-9
    assert c.prefill_chunk_time(3000, 4000) == pytest.approx(want)
    # an extend batched into a decode step adds one sequence (default) or the ones given
    ext = c.decode_step_time(8, 8000, extend_tokens=64, extend_pairs=64 * 8000)
    compute = (2e9 * 72 + 4 * 2 * 4 * 16 * (8000 + 64 * 8000)) / 1e12
    assert ext == pytest.approx(compute + 9 * 500e-6 + (8000 + 72) * 200e-9)
    two = c.decode_step_time(8, 8000, extend_tokens=64, extend_pairs=64 * 8000, extend_seqs=2)
    assert two - ext == pytest.approx(500e-6)


def test_host_terms_default_to_zero_so_gpu_profiles_are_pure_roofline(unit):
    assert unit.chip.step_per_seq_us == 0 and unit.chip.step_per_ctx_token_ns == 0
    for name in list_profiles("chips"):
        chip = load_chip(name)
        if name != "cpu-local":
            assert chip.step_per_seq_us == 0 and chip.step_per_ctx_token_ns == 0, name


def test_negative_host_terms_are_rejected(tmp_path):
    head, table = CHIP.split("[tflops]")
    p = tmp_path / "bad.toml"
    p.write_text(head + "step_per_seq_us = -1\n[tflops]" + table)
    with pytest.raises(ValueError, match="step_per_seq_us"):
        load_chip(p)
    p.write_text(head + 'step_per_ctx_token_ns = "fast"\n[tflops]' + table)
    with pytest.raises(ValueError, match="step_per_ctx_token_ns"):
        load_chip(p)


def _jittery(tmp_path, cv: float, name: str = "unit-chip") -> InstanceCost:
    head, table = CHIP.split("[tflops]")
    p = tmp_path / f"jitter-{cv}-{name}.toml"
    p.write_text(
        head.replace('name = "unit-chip"', f'name = "{name}"')
        + f"step_jitter_cv = {cv}\n[tflops]"
        + table
    )
    (tmp_path / "model.toml").write_text(MODEL)
    return InstanceCost(load_chip(p), load_model(tmp_path / "model.toml"))


def test_step_jitter_defaults_to_zero_everywhere_so_steps_are_the_roofline(unit):
    assert unit.chip.step_jitter_cv == 0
    for name in list_profiles("chips"):
        assert load_chip(name).step_jitter_cv == 0, name
    mean = (2e9 + (8000 + 8) * 256) / 100e9
    assert [unit.decode_step_time(8, 8000) for _ in range(3)] == [pytest.approx(mean)] * 3


def test_step_jitter_is_a_seeded_lognormal_factor_of_mean_one(tmp_path):
    import math
    import random

    from pddnet.device.cost import jitter_seed

    cv = 0.5
    c = _jittery(tmp_path, cv)
    mean = c.decode_step_time(8, 8000, jitter=False)
    assert mean == pytest.approx((2e9 + (8000 + 8) * 256) / 100e9)
    got = [c.decode_step_time(8, 8000) for _ in range(4000)]
    # by hand: log-normal with sigma^2 = ln(1 + cv^2) and mu = -sigma^2 / 2 (mean 1), drawn
    # from the stream seeded by the chip's name
    sigma = math.sqrt(math.log(1 + cv * cv))
    rng = random.Random(jitter_seed("unit-chip"))
    want = [mean * rng.lognormvariate(-sigma * sigma / 2, sigma) for _ in range(4000)]
    assert got == pytest.approx(want)
    # the same chip gives the same stream in a fresh instance (deterministic runs); another
    # chip name another stream
    again = _jittery(tmp_path, cv)
    assert [again.decode_step_time(8, 8000) for _ in range(4000)] == got
    other = _jittery(tmp_path, cv, name="other-chip")
    assert other.decode_step_time(8, 8000) != got[0]
    # its moments: mean 1 x the roofline, the coefficient of variation asked for
    m = sum(got) / len(got)
    sd = math.sqrt(sum((g - m) ** 2 for g in got) / len(got))
    assert m == pytest.approx(mean, rel=0.03)
    assert sd / m == pytest.approx(cv, rel=0.1)
    assert min(got) > 0


def test_step_jitter_leaves_prefill_and_estimates_alone(tmp_path):
    c = _jittery(tmp_path, 0.5)
    flops = 2e9 * 1000 + 4 * 2 * 4 * 16 * 1000 * 1001 / 2
    assert [c.prefill_chunk_time(0, 1000) for _ in range(3)] == [pytest.approx(flops / 1e12)] * 3
    est = [c.decode_step_time(4, 100, jitter=False) for _ in range(3)]
    assert est[0] == est[1] == est[2]


def test_bad_step_jitter_is_rejected(tmp_path):
    head, table = CHIP.split("[tflops]")
    p = tmp_path / "bad.toml"
    for bad in ("-0.1", "inf", "true"):
        p.write_text(head + f"step_jitter_cv = {bad}\n[tflops]" + table)
        with pytest.raises(ValueError, match="step_jitter_cv"):
            load_chip(p)
