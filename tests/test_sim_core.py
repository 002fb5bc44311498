"""The simulator's event core and streaming statistics."""

import pytest

from pddnet.sim.events import EventLoop
from pddnet.sim.metrics import Histogram, Series


def test_events_run_in_time_then_scheduling_order():
    loop = EventLoop()
    seen = []
    loop.at(2.0, seen.append, "c")
    loop.at(1.0, seen.append, "a")
    loop.at(1.0, seen.append, "b")  # same time: scheduling order
    loop.after(0.5, lambda: loop.after(1.0, seen.append, "late"))  # scheduled from an event
    assert loop.run() == 5
    assert seen == ["a", "b", "late", "c"]
    assert loop.now == 2.0


def test_event_loop_refuses_the_past_and_stops_at_until():
    loop = EventLoop()
    loop.at(5.0, lambda: None)
    loop.run(until=1.0)
    assert loop.now == 1.0 and len(loop) == 1
    with pytest.raises(ValueError, match="cannot schedule"):
        loop.at(0.5, lambda: None)
    with pytest.raises(ValueError, match="negative delay"):
        loop.after(-1, lambda: None)


def test_histogram_quantiles_within_bucket_resolution():
    h = Histogram()
    for i in range(1, 10001):
        h.add(i / 1000.0)  # 1 ms .. 10 s, uniform
    assert h.n == 10000
    assert h.quantile(0.5) == pytest.approx(5.0, rel=0.005)
    assert h.quantile(0.99) == pytest.approx(9.9, rel=0.005)
    assert h.min == 0.001 and h.max == 10.0
    assert h.mean == pytest.approx(5.0005)
    s = h.summary()
    assert s["p90"] == pytest.approx(9.0, rel=0.005)


def test_histogram_weights_and_merge():
    a, b = Histogram(), Histogram()
    a.add(0.1, 99)
    b.add(10.0, 1)
    a.merge(b)
    assert a.n == 100
    assert a.quantile(0.5) == pytest.approx(0.1, rel=0.005)
    assert a.quantile(1.0) == 10.0
    assert a.fraction_le(0.2) == pytest.approx(0.99)
    with pytest.raises(ValueError):
        a.add(-1.0)


def test_histogram_buckets_in_order_from_the_floor_bucket_up():
    h = Histogram()
    h.add(0.0)  # at or below the floor: bucket -1
    h.add(2.0, 3)
    h.add(1e-3)
    assert list(h.counts) == sorted(h.counts) and h.counts[-1] == 1.0
    assert sum(h.counts.values()) == h.n == 5
    assert h.quantile(0.0) == 0.5e-6  # the floor bucket (its midpoint), not an empty one
    assert h.quantile(0.5) == pytest.approx(2.0, rel=0.005)
    short = Histogram()
    short.add(1e-5)
    short.merge(h)  # a longer one into a shorter one
    assert short.n == 6 and short.counts == {**h.counts, short._bucket(1e-5): 1.0}
    big = Histogram()
    big.add(1.7e308)  # the largest floats still have a bucket
    with pytest.raises(ValueError, match="finite"):
        big.add(float("inf"))
    assert big.quantile(0.5) == 1.7e308 and len(big.counts) == 1
    with pytest.raises(ValueError):
        Histogram().merge(Histogram(rel_width=0.01))


def test_histogram_add_each_is_add_for_every_value():
    values = [0.0, 1e-7, 0.0071, 0.0069, 2.0, 1.7e308, 0.0071]
    one, each = Histogram(), Histogram()
    for v in values:
        one.add(v, 3)
    each.add_each(values, 3)
    assert (each.counts, each.n, each.total, each.min, each.max) == (
        one.counts,
        one.n,
        one.total,
        one.min,
        one.max,
    )
    each.add_each([], 3)
    each.add_each([1.0], 0)
    assert each.n == one.n
    for bad in ([0.1, float("nan")], [0.1, float("inf")], [0.1, -0.1]):
        with pytest.raises(ValueError, match="finite and >= 0"):
            Histogram().add_each(bad, 1)


def test_series_is_bounded_and_keeps_maxima():
    s = Series(interval_s=1.0, max_points=8)
    for t in range(100):
        s.observe(float(t), float(t % 10))
    assert len(s.values) <= 8
    assert s.interval_s >= 100 / 8
    assert max(s.values) == 9.0


def test_series_interval_max_includes_the_level_held_into_it():
    s = Series(interval_s=1.0, max_points=64)
    s.observe(0.2, 8.0)  # 8 requests from 0.2 s on
    s.observe(2.5, 7.0)  # one leaves at 2.5 s: 8 were there during [2, 2.5)
    s.observe(4.5, 0.0)  # the last leaves at 4.5 s: 7 were there during [4, 4.5)
    assert s.values == [8.0, 8.0, 8.0, 7.0, 7.0]
