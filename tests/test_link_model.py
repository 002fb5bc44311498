"""The link model alone: a fake clock (plain floats), no sockets, no sleeping."""

from __future__ import annotations

import math
import statistics

import pytest

from emulation.effects import implied_jitter_std_ms, pareto_normal_table, validate_effects
from emulation.link import Link, LinkDirection


def drain(d: LinkDirection, until: float = math.inf) -> list[tuple[float, object]]:
    """Run the direction like a shell would: poll exactly at each next_wakeup()."""
    out = []
    while (t := d.next_wakeup()) is not None and t <= until:
        out += [(t, item) for item in d.poll(t)]
    return out


def one_way_delays(link: Link, n: int, spacing: float, **effects) -> list[float]:
    """Offer n items `spacing` s apart (far enough that in-order never holds) and return the
    delay (ms) each got."""
    d = link.a_to_b
    link.set(0.0, "a_to_b", **effects) if effects else None
    sent = {}
    got = []
    for i in range(n):
        t = i * spacing
        got += drain(d, t)
        d.offer(t, 100, i)
        sent[i] = t
    got += drain(d)
    return [(t - sent[i]) * 1000.0 for t, i in got]


# --- delay and jitter ---------------------------------------------------------------------


def test_fixed_delay_is_exact_and_recorded_in_the_histogram() -> None:
    link = Link(delay_ms=15)
    d = link.a_to_b
    d.offer(1.0, 1200, "p")
    assert d.next_wakeup() == pytest.approx(1.015)
    assert d.poll(1.0149) == []
    assert d.poll(1.015) == ["p"]
    c = d.counters()
    assert c["packets_in"] == c["packets_out"] == 1 and c["bytes_out"] == 1200
    assert c["delay"]["min_ms"] == pytest.approx(15) and c["delay"]["max_ms"] == pytest.approx(15)
    assert sum(b["count"] for b in c["delay"]["buckets"]) == 1
    (bucket,) = c["delay"]["buckets"]
    assert 15 <= bucket["le_ms"] < 15 * 10**0.25 + 1e-9
    # The other direction is untouched.
    assert link.b_to_a.counters()["packets_in"] == 0


@pytest.mark.parametrize("dist", ["normal", "uniform", "pareto-normal"])
def test_jitter_std_matches_the_distribution(dist: str) -> None:
    delays = one_way_delays(Link(seed=3, delay_ms=100), 4000, 0.2, jitter_ms=5.0, jitter_dist=dist)
    std = statistics.pstdev(delays)
    assert std == pytest.approx(implied_jitter_std_ms(5.0, dist), rel=0.05)
    assert statistics.fmean(delays) == pytest.approx(100, abs=0.5)
    if dist == "uniform":
        assert 95 - 1e-9 <= min(delays) and max(delays) <= 105 + 1e-9
    if dist == "pareto-normal":  # heavy right tail: mean above median, long upper tail
        assert max(delays) - 100 > 100 - min(delays)
        assert statistics.median(delays) < statistics.fmean(delays)


def test_pareto_normal_table_is_standardised() -> None:
    table = pareto_normal_table()
    assert len(table) == 4096
    assert statistics.fmean(table) == pytest.approx(0, abs=1e-9)
    assert statistics.pstdev(table) == pytest.approx(1, abs=1e-9)
    assert list(table) == sorted(table)


def test_jitter_correlation_keeps_the_std_unlike_netem() -> None:
    delays = one_way_delays(
        Link(seed=5, delay_ms=100), 6000, 0.2, jitter_ms=4.0, jitter_corr_pct=80.0
    )
    x = [v - 100 for v in delays]
    lag1 = sum(a * b for a, b in zip(x, x[1:], strict=False)) / sum(a * a for a in x)
    assert lag1 == pytest.approx(0.8, abs=0.05)
    assert statistics.pstdev(delays) == pytest.approx(4.0, rel=0.1)


def test_jitter_never_reorders_by_default() -> None:
    link = Link(seed=7, delay_ms=20, jitter_ms=5)
    d = link.a_to_b
    held = 0
    out = []
    for i in range(2000):  # 0.5 ms apart: much closer than the jitter
        out += drain(d, i * 0.0005)
        d.offer(i * 0.0005, 100, i)
    out += drain(d)
    order = [i for _, i in out]
    assert order == list(range(2000))
    times = [t for t, _ in out]
    assert times == sorted(times)
    # Many were held behind a slower one ahead (so their delay exceeds delay+own jitter).
    held = sum(1 for k in range(1, len(times)) if times[k] == times[k - 1])
    assert held > 100


def test_reordering_happens_only_when_enabled() -> None:
    link = Link(seed=7, delay_ms=20, jitter_ms=5, reorder_pct=100)
    d = link.a_to_b
    out = []
    for i in range(2000):
        out += drain(d, i * 0.0005)
        d.offer(i * 0.0005, 100, i)
    out += drain(d)
    order = [i for _, i in out]
    assert sorted(order) == list(range(2000))
    inversions = sum(1 for a, b in zip(order, order[1:], strict=False) if a > b)
    assert inversions > 200


def test_negative_jitter_never_makes_delay_negative() -> None:
    delays = one_way_delays(Link(seed=1, delay_ms=1), 500, 0.1, jitter_ms=10)
    assert min(delays) >= 0


# --- rate, burst, queue -------------------------------------------------------------------


def test_token_bucket_burst_then_line_rate() -> None:
    # 8 Mbit/s = 1 byte/us: a 1000-byte item takes 1 ms once the 5000-byte burst is spent.
    link = Link(rate_mbit=8, burst_bytes=5000, queue_bytes=1 << 20)
    d = link.a_to_b
    for i in range(100):
        d.offer(0.0, 1000, i)
    out = drain(d)
    times = [t for t, _ in out]
    assert times[:5] == [0.0] * 5
    gaps = [b - a for a, b in zip(times[5:], times[6:], strict=False)]
    assert all(g == pytest.approx(0.001, abs=1e-12) for g in gaps)
    assert times[-1] == pytest.approx(0.095, abs=1e-9)
    # After idling, the bucket refills to the burst, no further.
    d.offer(10.0, 1000, "a")
    for i in range(7):
        d.offer(10.0, 1000, i)
    late = [t for t, _ in drain(d)]
    assert late[:5] == [10.0] * 5 and late[5] == pytest.approx(10.001)


def test_items_larger_than_the_burst_still_pass_at_the_rate() -> None:
    link = Link(rate_mbit=80, burst_bytes=1500)  # 10 bytes/us
    d = link.a_to_b
    for i in range(10):
        d.offer(0.0, 64 * 1024, i)
    times = [t for t, _ in drain(d)]
    total = 10 * 64 * 1024
    # Rate holds over the run: 9 items' worth of serialisation after the first.
    assert times[-1] == pytest.approx((total - 64 * 1024) / 10e6, rel=0.01)


def test_queue_delay_grows_under_load_and_tail_drops_are_counted() -> None:
    # 8 Mbit/s link, 1000-byte items every 0.5 ms = 16 Mbit/s offered: twice the rate.
    link = Link(rate_mbit=8, burst_bytes=1000, queue_bytes=20_000)
    d = link.a_to_b
    sent = {}
    out = []
    for i in range(400):
        t = i * 0.0005
        out += drain(d, t)
        d.offer(t, 1000, i)
        sent[i] = t
    out += drain(d)
    c = d.counters()
    delays = [(t - sent[i]) * 1000 for t, i in out]
    # Queueing delay rises (about +0.5 ms per item) until the queue is full, then plateaus.
    assert delays[10] > delays[2] + 3
    assert max(delays) == pytest.approx(20.0, abs=1.5)  # 20 kB at 1 byte/us
    assert c["drops"]["queue_full"] > 100
    assert c["drops"]["queue_full"] + c["packets_out"] == 400
    assert c["drop_bytes"]["queue_full"] == 1000 * c["drops"]["queue_full"]
    assert c["queue"]["max_bytes"] <= 20_000 and c["queue"]["max_bytes"] >= 19_000
    assert c["queue"]["bytes"] == 0  # drained at the end


def test_rate_change_applies_to_what_is_already_queued() -> None:
    link = Link(rate_mbit=8, burst_bytes=1000)
    d = link.a_to_b
    for i in range(10):
        d.offer(0.0, 1000, i)
    first = drain(d, 0.0025)  # items at 0, 1 ms, 2 ms
    assert len(first) == 3
    link.set(0.0025, rate_mbit=4)  # half the rate from t = 2.5 ms
    times = [t for t, _ in drain(d)]
    # At 2.5 ms the bucket holds 500 bytes; 500 more at 0.5 byte/us = 1 ms -> 3.5 ms, then 2 ms.
    assert times[0] == pytest.approx(0.0035, abs=1e-12)
    assert all(
        b - a == pytest.approx(0.002, abs=1e-12) for a, b in zip(times, times[1:], strict=False)
    )


def test_removing_the_rate_limit_releases_the_queue_at_once() -> None:
    link = Link(rate_mbit=1, burst_bytes=1000, delay_ms=5)
    d = link.a_to_b
    for i in range(5):
        d.offer(0.0, 1000, i)
    link.set(0.001, rate_mbit=None)
    times = [t for t, _ in drain(d)]
    assert times[0] == pytest.approx(0.005) and all(t == pytest.approx(0.006) for t in times[1:])


# --- the priority class (priority_dscp) ---------------------------------------------------


def _behind_a_full_queue(**effects) -> tuple[LinkDirection, float]:
    """An 8 Mbit/s direction (1 byte per us) whose 20 kB queue bulk has filled at t = 0; returns
    it and the time a marked item then arrives."""
    link = Link(rate_mbit=8, burst_bytes=1000, queue_bytes=20_000, delay_ms=5, **effects)
    d = link.a_to_b
    for i in range(20):
        d.offer(0.0, 1000, ("bulk", i))
    return d, 0.0005


def test_a_marked_item_goes_ahead_of_the_queue_in_the_priority_class() -> None:
    d, t = _behind_a_full_queue(priority_dscp=46)
    d.offer(t, 100, ("control", 0), dscp=46)
    out = drain(d)
    order = [item for _, item in out]
    # Bulk item 0 left at t = 0 (the bucket's 1000 B burst); item 1 waits for 1000 B of tokens
    # (until 1 ms). The marked item needs 100 B, which the bucket holds when it arrives at
    # 0.5 ms: it leaves at once, ahead of the 19 queued bulk items, then 5 ms of delay.
    assert order.index(("control", 0)) == 1
    departure = dict((item, when) for when, item in out)[("control", 0)]
    assert departure == pytest.approx(t + 0.005, abs=1e-9)
    assert [i for kind, i in order if kind == "bulk"] == list(range(20))  # bulk stays in order
    c = d.counters()
    assert c["priority"] == {"packets": 1, "bytes": 100, "max_bytes": 100, "queued_bytes": 0}
    assert c["queue"]["max_bytes"] == 19_000  # the marked bytes are not in the FIFO's count


def test_without_priority_dscp_a_marked_item_waits_in_the_fifo() -> None:
    d, t = _behind_a_full_queue()
    assert d.queue_space(t, dscp=46) == d.queue_space(t) == 1000
    d.offer(t, 100, ("control", 0), dscp=46)
    order = [item for _, item in drain(d)]
    assert order[-1] == ("control", 0)  # behind all 20 bulk items
    assert d.counters()["priority"]["packets"] == 0


def test_only_the_configured_mark_is_prioritised_and_each_class_has_its_own_limit() -> None:
    d, t = _behind_a_full_queue(priority_dscp=46)
    assert not d.is_priority(0) and not d.is_priority(10) and d.is_priority(46)
    assert d.queue_space(t, dscp=46) == 20_000 and d.queue_space(t, dscp=10) == 1000
    assert d.would_accept(t, 20_000, dscp=46) and not d.would_accept(t, 1001)
    d.offer(t, 21_000, "too big for its class", dscp=46)
    assert d.counters()["drops"]["queue_full"] == 1


def test_priority_items_are_released_with_the_rest_when_the_limit_goes() -> None:
    d, t = _behind_a_full_queue(priority_dscp=46)
    d.offer(t, 100, "control", dscp=46)
    d.apply(0.0006, {"rate_mbit": None})
    assert d.queued_bytes() == 0
    assert len(drain(d)) == 21


# --- loss, duplication, partition ---------------------------------------------------------


def test_random_loss_is_inside_the_binomial_99pct_interval() -> None:
    n, p = 100_000, 0.01
    link = Link(seed=11, loss_pct=1.0)
    d = link.a_to_b
    for i in range(n):
        d.offer(i * 1e-5, 100, i)
    lost = d.counters()["drops"]["loss"]
    half = 2.576 * math.sqrt(n * p * (1 - p))
    assert n * p - half <= lost <= n * p + half
    assert len(drain(d)) == n - lost


def test_gilbert_elliott_loss_comes_in_bursts() -> None:
    n = 60_000
    link = Link(seed=2, ge_p_pct=1.0, ge_r_pct=25.0)  # bad state: mean 4 items, all lost
    d = link.a_to_b
    for i in range(n):
        d.offer(i * 1e-5, 100, i)
    delivered = {i for _, i in drain(d)}
    lost = [i not in delivered for i in range(n)]
    assert d.counters()["drops"]["burst_loss"] == sum(lost)
    rate = sum(lost) / n
    assert rate == pytest.approx(0.01 / (0.01 + 0.25), rel=0.15)
    runs, k = [], 0
    for x in lost + [False]:
        if x:
            k += 1
        elif k:
            runs.append(k)
            k = 0
    assert statistics.fmean(runs) == pytest.approx(4.0, rel=0.15)
    # Independent loss at the same rate would give runs of ~1.04: this is bursty.
    cond = sum(1 for a, b in zip(lost, lost[1:], strict=False) if a and b) / sum(lost)
    assert cond > 0.6 > rate * 5


def test_duplication_delivers_copies_next_to_the_original() -> None:
    link = Link(seed=4, duplicate_pct=10)
    d = link.a_to_b
    for i in range(5000):
        d.offer(i * 0.001, 10, i)
    out = [i for _, i in drain(d)]
    c = d.counters()
    assert c["packets_out"] == len(out) == 5000 + c["duplicated"]
    assert 400 < c["duplicated"] < 600
    assert [i for k, i in enumerate(out) if k == 0 or out[k - 1] != i] == list(range(5000))


def test_partition_drops_both_ways_and_blackhole_one_way() -> None:
    link = Link(delay_ms=1)
    link.partition(1.0)
    link.a_to_b.offer(1.1, 100, "x")
    link.b_to_a.offer(1.1, 100, "y")
    assert drain(link.a_to_b) == [] and drain(link.b_to_a) == []
    assert link.a_to_b.counters()["drops"]["partition"] == 1
    assert link.b_to_a.counters()["drops"]["partition"] == 1
    link.heal(2.0)
    link.blackhole(2.0, "a_to_b")
    link.a_to_b.offer(2.1, 100, "x")
    link.b_to_a.offer(2.1, 100, "y")
    assert drain(link.a_to_b) == []
    assert [i for _, i in drain(link.b_to_a)] == ["y"]
    assert link.a_to_b.counters()["drops"]["blackhole"] == 1
    link.heal(3.0)
    link.a_to_b.offer(3.0, 100, "z")
    assert [i for _, i in drain(link.a_to_b)] == ["z"]


def test_items_in_flight_when_a_partition_starts_still_arrive() -> None:
    link = Link(delay_ms=50)
    link.a_to_b.offer(0.0, 100, "early")
    link.partition(0.01, duration=1.0)
    link.a_to_b.offer(0.02, 100, "late")
    assert [i for _, i in drain(link.a_to_b)] == ["early"]


# --- timed changes ------------------------------------------------------------------------


def test_duration_reverts_at_the_exact_time_even_when_polled_late() -> None:
    link = Link(delay_ms=10)
    link.set(0.0, duration=2.0, delay_ms=100)
    d = link.a_to_b
    d.offer(1.999, 1, "slow")
    d.offer(2.0, 1, "fast")  # the revert happens at 2.0, before this arrival
    assert d.poll(10.0) == ["slow", "fast"]  # one late poll: both, in order
    assert d.counters()["delay"]["max_ms"] == pytest.approx(100)
    assert d.counters()["delay"]["min_ms"] == pytest.approx(99.0)  # held behind "slow" (2.099)
    assert link.a_to_b.effects()["delay_ms"] == 10


def test_a_later_change_wins_over_a_pending_revert() -> None:
    link = Link(delay_ms=10)
    link.set(0.0, duration=2.0, delay_ms=100, jitter_ms=1)
    link.set(1.0, "a_to_b", delay_ms=50)
    snap = link.snapshot(3.0)
    assert snap["a_to_b"]["effects"]["delay_ms"] == 50  # changed since: kept
    assert snap["a_to_b"]["effects"]["jitter_ms"] == 0  # not changed since: reverted
    assert snap["b_to_a"]["effects"]["delay_ms"] == 10


def test_clear_restores_the_initial_effects_and_cancels_timers() -> None:
    link = Link(delay_ms=15, rate_mbit=100)
    link.set(0.0, duration=5.0, delay_ms=300)
    link.set(0.0, "b_to_a", jitter_ms=3)
    link.clear(1.0)
    snap = link.snapshot(1.0)
    for name in ("a_to_b", "b_to_a"):
        assert snap[name]["effects"]["delay_ms"] == 15
        assert snap[name]["effects"]["jitter_ms"] == 0
        assert snap[name]["pending"]["reverts"] == []


def test_chaos_verbs_each_revert_after_their_duration() -> None:
    link = Link(delay_ms=10, rate_mbit=100)
    link.latency_spike(0.0, 1.0, add_ms=90)
    link.bandwidth_collapse(0.0, 2.0, fraction=0.05)
    link.jitter_storm(0.0, 3.0, jitter_ms=20, jitter_dist="pareto-normal")
    link.chaos(0.0, "loss-burst", 4.0, loss_pct=50)
    fx = link.snapshot(0.5)["a_to_b"]["effects"]
    assert (fx["delay_ms"], fx["rate_mbit"], fx["jitter_ms"], fx["loss_pct"]) == (100, 5, 20, 50)
    assert fx["jitter_dist"] == "pareto-normal"
    fx = link.snapshot(1.0)["b_to_a"]["effects"]
    assert fx["delay_ms"] == 10 and fx["rate_mbit"] == 5
    fx = link.snapshot(2.5)["a_to_b"]["effects"]
    assert fx["rate_mbit"] == 100 and fx["jitter_ms"] == 20
    fx = link.snapshot(4.0)["a_to_b"]["effects"]
    assert (fx["jitter_ms"], fx["jitter_dist"], fx["loss_pct"]) == (0, "normal", 0)
    link.chaos(5.0, "partition", 1.0)
    assert link.a_to_b.blocked(5.5) and link.b_to_a.blocked(5.5)
    assert not link.a_to_b.blocked(6.0)


def test_change_listeners_hear_control_changes() -> None:
    link = Link()
    calls = []
    link.subscribe(lambda: calls.append(1))
    link.set(0.0, delay_ms=1)
    link.partition(0.0, 1.0)
    link.clear(0.0)
    assert len(calls) == 3


# --- determinism --------------------------------------------------------------------------


def _run(seed: int, poll_every: float | None) -> dict:
    link = Link(
        seed=seed,
        delay_ms=20,
        jitter_ms=4,
        rate_mbit=40,
        loss_pct=2,
        duplicate_pct=1,
        queue_bytes=30_000,
    )
    link.set(0.0, duration=0.3, jitter_dist="uniform")
    d = link.a_to_b
    for i in range(3000):
        t = i * 0.0002
        if poll_every is not None and i % int(poll_every / 0.0002) == 0:
            d.poll(t)
        d.offer(t, 1200, i)
    d.poll(100.0)
    return d.counters()


def test_deterministic_for_a_seed_and_independent_of_poll_timing() -> None:
    a = _run(1, 0.001)
    assert a == _run(1, 0.001)
    assert a == _run(1, None)  # polling only at the very end changes nothing
    assert a == _run(1, 0.0134)
    assert a != _run(2, 0.001)
    assert a["drops"]["loss"] > 0 and a["drops"]["queue_full"] > 0 and a["duplicated"] > 0


def test_time_does_not_move_backwards() -> None:
    link = Link(delay_ms=10)
    d = link.a_to_b
    d.offer(5.0, 1, "a")
    d.offer(4.0, 1, "b")  # a shell clock glitch: treated as 5.0
    assert d.poll(5.01) == ["a", "b"]


# --- validation ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("effects", "message"),
    [
        ({"delay_ms": -1}, "delay_ms must be >= 0 ms, got -1"),
        ({"loss_pct": 101}, "loss_pct must be <= 100 %, got 101"),
        ({"jitter_dist": "cauchy"}, "unknown distribution 'cauchy' for jitter_dist"),
        ({"bogus": 1}, "unknown effect 'bogus'"),
        ({"rate_mbit": 0}, "rate_mbit must be > 0 Mbit/s"),
        ({"rate_mbit": "fast"}, "rate_mbit must be a number"),
        ({"queue_bytes": 10.5}, "queue_bytes must be a whole number of bytes"),
        ({"partition": 1}, "partition must be true or false"),
        ({"delay_ms": float("nan")}, "delay_ms must be finite"),
        ({"jitter_corr_pct": 100}, "jitter_corr_pct must be <= 99.9 %"),
        ({"ge_r_pct": 0}, "ge_r_pct must be > 0 %"),
        ({"delay_ms": True}, "delay_ms must be a number"),
        ({"priority_dscp": 64}, "priority_dscp must be <= 63"),
        ({"priority_dscp": 4.5}, "priority_dscp must be a whole number"),
    ],
)
def test_bad_settings_raise_precise_value_errors(effects: dict, message: str) -> None:
    with pytest.raises(ValueError) as err:
        validate_effects(effects)
    assert message in str(err.value)
    link = Link(delay_ms=5)
    with pytest.raises(ValueError, match="must|unknown"):
        link.set(0.0, **effects)
    assert link.a_to_b.effects()["delay_ms"] == 5  # nothing half-applied
    with pytest.raises(ValueError):
        Link(**effects)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda link: link.set(0.0, "sideways", delay_ms=1), "unknown direction 'sideways'"),
        (
            lambda link: link.set(0.0, duration=-1, delay_ms=1),
            "duration must be a number of seconds > 0",
        ),
        (lambda link: link.set(0.0), "no effects given"),
        (lambda link: link.bandwidth_collapse(0.0, 1.0, fraction=0.1), "needs a rate limit"),
        (
            lambda link: link.bandwidth_collapse(0.0, 1.0, fraction=0),
            "fraction must be a number in (0, 1]",
        ),
        (lambda link: link.latency_spike(0.0, None, add_ms=5), "duration (s) is required"),
        (lambda link: link.chaos(0.0, "meteor", 1.0), "unknown chaos 'meteor'"),
        (lambda link: link.chaos(0.0, "latency-spike", 1.0, add_mss=3), "bad parameters for chaos"),
        (lambda link: link.blackhole(0.0, "both"), "blackhole is one direction"),
        (lambda link: link.a_to_b.offer(0.0, -1, "x"), "size must be >= 0"),
    ],
)
def test_bad_control_calls_raise(call, message: str) -> None:
    link = Link()
    with pytest.raises(ValueError) as err:
        call(link)
    assert message in str(err.value)


def test_restricted_effects_are_refused_with_the_reason() -> None:
    link = Link(delay_ms=5)
    link.restrict(["loss_pct", "duplicate_pct"], "byte streams cannot lose bytes")
    with pytest.raises(ValueError, match="loss_pct=1.0 is not supported here: byte streams"):
        link.set(0.0, loss_pct=1)
    link.set(0.0, loss_pct=0)  # the neutral value is fine
    with pytest.raises(ValueError, match="not supported"):
        link.load_schedule(0.0, [{"at": 1, "duplicate_pct": 5}])
    lossy = Link(loss_pct=1)
    with pytest.raises(ValueError, match="loss_pct=1.0 on a_to_b"):
        lossy.restrict(["loss_pct"], "no")
