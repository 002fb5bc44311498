"""The WAN line on the emulator's link model, on simulated time."""

import pytest

from emulation.link import Link
from pddnet.sim.events import EventLoop
from pddnet.sim.wan import WanLine


def test_a_transfer_takes_its_bytes_over_the_rate_plus_the_delay():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=10.0, piece_bytes=1 << 20)
    assert isinstance(wan.link, Link)
    done = []
    tr = wan.start_transfer(10_000_000, done.append)
    wan.make_sendable(tr, 10_000_000)
    loop.run()
    # 10 MB at 80 Mbit/s = 1.0 s of serialisation, then 10 ms of propagation
    assert done == [pytest.approx(1.01, rel=0.01)]
    assert wan.counters()["kv_bytes"] == 10_000_000


def test_bytes_leave_only_once_computed_and_fair_share_between_transfers():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=0.0, piece_bytes=1 << 18, queue_bytes=1 << 20)
    done = {}
    big = wan.start_transfer(8_000_000, lambda t: done.setdefault("big", t))
    wan.make_sendable(big, 8_000_000)
    small = wan.start_transfer(1_000_000, lambda t: done.setdefault("small", t))
    loop.at(0.5, wan.make_sendable, small, 1_000_000)
    half = wan.start_transfer(1_000_000, lambda t: done.setdefault("late", t))
    loop.at(0.1, wan.make_sendable, half, 500_000)        # only half computed: never done
    loop.run()
    # the small transfer shares the line with the big one instead of waiting for all of it
    assert done["small"] < 0.5 + 0.3
    assert done["big"] == pytest.approx(9.5e6 / 10e6, rel=0.05)
    assert "late" not in done


def test_control_messages_wait_behind_queued_bulk_not_behind_unsent_bytes():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=5.0, piece_bytes=1 << 20,
                  queue_bytes=2 << 20)
    tr = wan.start_transfer(50_000_000, lambda t: None)
    wan.make_sendable(tr, 50_000_000)
    got = []
    loop.at(1.0, wan.message, "a_to_b", 100, lambda t: got.append(t))
    loop.at(1.0, wan.message, "b_to_a", 100, lambda t: got.append(("back", t)))
    loop.run()
    ahead = (2 << 20) / 10e6           # at most the bottleneck queue's worth of bytes ahead
    assert 1.005 <= got[0][1] <= 1.006                 # the empty direction: just the delay
    assert 1.005 <= got[1] <= 1.005 + ahead + 0.11     # bulk direction: queue, not 50 MB


def test_cancel_stops_sending():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=1.0, piece_bytes=1 << 20, queue_bytes=2 << 20)
    done = []
    tr = wan.start_transfer(20_000_000, done.append)
    wan.make_sendable(tr, 20_000_000)
    loop.at(0.2, wan.cancel, tr)
    loop.run()
    assert not done
    assert wan.counters()["kv_bytes"] < 5_000_000
    assert wan.counters()["kv_bytes_cancelled"] > 15_000_000
