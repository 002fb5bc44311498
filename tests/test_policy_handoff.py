import pytest

from pddnet.policy import BandwidthEstimator, HandoffMode, HandoffPolicy, RttEstimator


def test_dynamic_small_backlog_is_one_shot():
    d = HandoffPolicy(threshold_tokens=64, chunk=8).decide(backlog_tokens=64, rld_load=0.1)
    assert d.mode is HandoffMode.ONE_SHOT and d.chunk == 64


def test_dynamic_large_backlog_streams_unless_rld_loaded():
    policy = HandoffPolicy(threshold_tokens=64, chunk=8, rld_load_limit=0.8)
    assert policy.decide(65, rld_load=0.5).mode is HandoffMode.STREAMING
    assert policy.decide(65, rld_load=0.5).chunk == 8
    loaded = policy.decide(500, rld_load=0.9)
    assert loaded.mode is HandoffMode.ONE_SHOT and "load" in loaded.reason


def test_fixed_modes_ignore_inputs():
    assert HandoffPolicy(mode="one-shot").decide(1000, 0.0).mode is HandoffMode.ONE_SHOT
    assert HandoffPolicy(mode="streaming").decide(1, 1.0).mode is HandoffMode.STREAMING


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"mode": "sideways"}, "unknown handoff mode"),
        ({"chunk": 0}, "chunk"),
        ({"threshold_tokens": -1}, "threshold_tokens"),
        ({"rld_load_limit": 1.5}, "rld_load_limit"),
    ],
)
def test_bad_policy_values_are_named(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        HandoffPolicy(**kwargs)


def test_bandwidth_estimator_converges_and_weights_small_samples_less():
    est = BandwidthEstimator(initial_bps=1e6)
    for _ in range(40):
        est.observe(4 << 20, (4 << 20) / 50e6)
    assert est.bytes_per_s == pytest.approx(50e6, rel=0.01)
    before = est.bytes_per_s
    est.observe(1024, 1.0)  # a tiny, RTT-bound transfer barely moves the estimate
    assert est.bytes_per_s > 0.99 * before
    assert est.transfer_time(50_000_000, rtt_s=0.03) == pytest.approx(1.03, rel=0.02)


def test_rtt_estimator():
    rtt = RttEstimator(initial_s=0.1)
    for _ in range(50):
        rtt.observe(0.03)
    assert rtt.srtt == pytest.approx(0.03, rel=1e-3)
    assert 0.03 <= rtt.timeout_s < 0.05
    with pytest.raises(ValueError):
        rtt.observe(-1)
