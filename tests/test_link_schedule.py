"""Schedules and trace replay on the model (fake clock, no sockets)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from emulation.link import Link
from emulation.schedule import build_schedule


def departures(link: Link, until: float) -> list[float]:
    d = link.a_to_b
    out = []
    while (t := d.next_wakeup()) is not None and t <= until:
        out += [t] * len(d.poll(t))
    return out


def test_rate_collapse_step_takes_effect_at_exactly_the_right_time() -> None:
    # 80 Mbit/s = 10 bytes/us: one 10 kB item per ms. Collapse to 5% (4 Mbit/s: one per 20 ms)
    # at t = 2.0005 s for 3 s, with the queue kept full the whole time.
    link = Link(rate_mbit=80, burst_bytes=10_000, queue_bytes=1 << 30)
    t0 = 100.0
    link.load_schedule(t0, [{"at": 2.0005, "rate_mbit": 4, "duration": 3.0}])
    for i in range(9000):
        link.a_to_b.offer(t0, 10_000, i)
    times = [t - t0 for t in departures(link, t0 + 6.0)]
    before = [t for t in times if t <= 2.0005]
    during = [t for t in times if 2.0005 < t <= 5.0005]
    after = [t for t in times if t > 5.0005]
    assert before[-1] == pytest.approx(2.0, abs=1e-9)
    # Half a token-bucket's worth was refilled at the old rate; the rest at the new one.
    assert during[0] == pytest.approx(2.0005 + 5_000 / 500_000, abs=1e-9)
    gaps = [b - a for a, b in zip(during, during[1:], strict=False)]
    assert all(g == pytest.approx(0.020, abs=1e-9) for g in gaps)
    assert len(during) == pytest.approx(3.0 / 0.020, abs=1)
    assert all(
        b - a == pytest.approx(0.001, abs=1e-9) for a, b in zip(after, after[1:], strict=False)
    )
    assert after[0] - during[-1] < 0.020
    assert link.a_to_b.effects()["rate_mbit"] == 80


def test_steps_apply_in_time_order_per_direction() -> None:
    link = Link(delay_ms=10)
    link.load_schedule(
        0.0,
        [
            [3.0, {"delay_ms": 30}],
            {"at": 1.0, "direction": "a_to_b", "delay_ms": 20},
            {"at": 2.0, "direction": "b_to_a", "jitter_ms": 1, "duration": 0.5},
        ],
    )
    at = lambda t, d: link.snapshot(t)[d]["effects"]  # noqa: E731
    assert at(0.99, "a_to_b")["delay_ms"] == 10
    assert at(1.0, "a_to_b")["delay_ms"] == 20 and at(1.0, "b_to_a")["delay_ms"] == 10
    assert at(2.2, "b_to_a")["jitter_ms"] == 1 and at(2.2, "a_to_b")["jitter_ms"] == 0
    assert at(2.5, "b_to_a")["jitter_ms"] == 0
    assert at(3.0, "a_to_b")["delay_ms"] == 30 and at(3.0, "b_to_a")["delay_ms"] == 30
    assert link.snapshot(3.0)["a_to_b"]["pending"]["schedule"]["finished"] is True


def test_a_step_changes_the_delay_of_items_sent_after_it() -> None:
    link = Link(delay_ms=10)
    link.load_schedule(0.0, [{"at": 1.0, "delay_ms": 50}])
    d = link.a_to_b
    d.offer(0.5, 1, "a")
    d.offer(1.5, 1, "b")  # poll comes only later: the step still applied at 1.0
    assert d.poll(0.51) == ["a"]
    assert d.next_wakeup() == pytest.approx(1.55)


def write_trace(tmp_path: Path, kind: str) -> Path:
    rows = [(0, 100, 10), (1, 50, 20), (2, 10, 30)]
    if kind == "csv":
        path = tmp_path / "trace.csv"
        path.write_text("time,rate_mbit,delay_ms\n" + "".join(f"{t},{r},{d}\n" for t, r, d in rows))
    else:
        path = tmp_path / "trace.jsonl"
        path.write_text(
            "".join(
                json.dumps({"time": t, "rate_mbit": r, "delay_ms": d}) + "\n" for t, r, d in rows
            )
        )
    return path


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_trace_replay_loops_with_the_inferred_period(tmp_path: Path, kind: str) -> None:
    link = Link()
    link.load_schedule(10.0, write_trace(tmp_path, kind), loop=True)
    expect = {
        0.5: (100, 10),
        1.5: (50, 20),
        2.5: (10, 30),  # first pass
        3.5: (100, 10),
        4.0: (50, 20),
        5.999: (10, 30),
        6.0: (100, 10),  # period 3 s
        301.2: (50, 20),
    }
    for t, (rate, delay) in expect.items():
        fx = link.snapshot(10.0 + t)["b_to_a"]["effects"]
        assert (fx["rate_mbit"], fx["delay_ms"]) == (rate, delay), t
    info = link.snapshot(400.0)["a_to_b"]["pending"]["schedule"]
    assert info["loop"] is True and info["period_s"] == 3.0 and info["finished"] is False


def test_trace_without_loop_holds_the_last_row(tmp_path: Path) -> None:
    link = Link()
    link.load_schedule(0.0, write_trace(tmp_path, "csv"))
    assert link.snapshot(50.0)["a_to_b"]["effects"]["rate_mbit"] == 10


def test_trace_replay_shapes_traffic(tmp_path: Path) -> None:
    # Items sent steadily see the delay the trace prescribes at their time.
    link = Link()
    link.load_schedule(0.0, write_trace(tmp_path, "csv"), loop=True)
    d = link.a_to_b
    for k in range(60):  # every 0.1 s for 6 s (two periods)
        t = k * 0.1 + 0.05
        d.offer(t, 100, t)
        d.poll(t)
    d.poll(100.0)
    hist = link.a_to_b.counters()["delay"]
    assert hist["min_ms"] == pytest.approx(10) and hist["max_ms"] == pytest.approx(30, abs=1e-6)
    assert hist["mean_ms"] == pytest.approx(20, abs=1e-6)


def test_explicit_period_and_a_new_schedule_replaces_the_old() -> None:
    link = Link()
    link.load_schedule(0.0, [{"at": 0, "delay_ms": 5}], loop=True, period=2.0)
    link.load_schedule(0.5, [{"at": 1.0, "delay_ms": 7}])
    fx = link.snapshot(1.0)["a_to_b"]["effects"]
    assert fx["delay_ms"] == 5  # applied by the first schedule, not undone
    assert link.snapshot(1.5)["a_to_b"]["effects"]["delay_ms"] == 7
    link.set(1.6, delay_ms=1)
    assert link.snapshot(2.1)["a_to_b"]["effects"]["delay_ms"] == 1  # old loop is gone


def test_clear_cancels_the_schedule() -> None:
    link = Link(delay_ms=3)
    link.load_schedule(0.0, [{"at": 1.0, "delay_ms": 70}])
    link.clear(0.5)
    assert link.snapshot(2.0)["a_to_b"]["effects"]["delay_ms"] == 3


@pytest.mark.parametrize(
    ("steps", "kwargs", "message"),
    [
        ([], {}, "schedule has no steps"),
        ([{"delay_ms": 1}], {}, "schedule step 0: missing 'at'"),
        (
            [{"at": 1, "delay_ms": 1}, {"at": -1, "delay_ms": 2}],
            {},
            "schedule step 1: at must be >= 0",
        ),
        ([{"at": 1, "warp": 9}], {}, "schedule step 0: unknown effect 'warp'"),
        ([{"at": 1, "delay_ms": -5}], {}, "schedule step 0: delay_ms must be >= 0 ms"),
        ([{"at": 1, "direction": "up", "delay_ms": 1}], {}, "unknown direction 'up'"),
        ([{"at": 1, "delay_ms": 1, "duration": 0}], {}, "duration must be > 0 s"),
        ([{"at": 1}], {}, "schedule step 0: no effects to change"),
        ([[1, 2, 3]], {}, "a pair must be [at, {effect: value}]"),
        ([{"at": 1, "delay_ms": 1}], {"loop": True}, "needs an explicit period"),
        (
            [{"at": 0, "delay_ms": 1}, {"at": 4, "delay_ms": 2}],
            {"loop": True, "period": 3},
            "period (3 s) must be later than the last step (4 s)",
        ),
        ("nope.csv", {}, "trace file 'nope.csv' does not exist"),
        (42, {}, "a schedule is a list of steps or a trace file path"),
    ],
)
def test_bad_schedules_are_rejected_with_the_step_named(steps, kwargs, message) -> None:
    with pytest.raises(ValueError) as err:
        build_schedule(steps, **kwargs)
    assert message in str(err.value)
    link = Link(delay_ms=2)
    with pytest.raises(ValueError):
        link.load_schedule(0.0, steps, **kwargs)
    assert link.snapshot(10.0)["a_to_b"]["effects"]["delay_ms"] == 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("rate,delay_ms\n1,2\n", "needs a header starting with 'time'"),
        ("time,rate_mbit\n0,fast\n", ":2: rate_mbit must be a number"),
        ("time,rate_mbit\n0,1,2\n", ":2: 3 cells, header has 2"),
        ("time,warp\n0,1\n", "unknown effect 'warp'"),
    ],
)
def test_bad_trace_files_name_the_line(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        build_schedule(path)
    assert message in str(err.value)


def test_csv_trace_may_leave_cells_empty_and_lift_the_rate(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text("time,rate_mbit,delay_ms\n0,10,5\n1,,9\n2,unlimited,\n")
    link = Link()
    link.load_schedule(0.0, path)
    assert link.snapshot(1.5)["a_to_b"]["effects"]["rate_mbit"] == 10
    assert link.snapshot(1.5)["a_to_b"]["effects"]["delay_ms"] == 9
    assert link.snapshot(2.5)["a_to_b"]["effects"]["rate_mbit"] is None
