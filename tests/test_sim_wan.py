"""The WAN line on the emulator's link model, on simulated time."""

import pytest

from emulation.link import Link
from pddnet.lanes import LATENCY_DSCP
from pddnet.sim.events import EventLoop
from pddnet.sim.wan import WanLine


def test_a_transfer_takes_its_bytes_over_the_rate_plus_the_delay():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=10.0, piece_bytes=1 << 20)
    assert isinstance(wan.link, Link)
    done = []
    tr = wan.start_transfer(10_000_000, done.append, sender=0)
    wan.make_sendable(tr, 10_000_000)
    loop.run()
    # 10 MB at 80 Mbit/s = 1.0 s of serialisation, then 10 ms of propagation
    assert done == [pytest.approx(1.01, rel=0.01)]
    assert wan.counters()["kv_bytes"] == 10_000_000


def test_bytes_leave_only_once_computed_and_senders_share_the_line():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=0.0, piece_bytes=1 << 18, queue_bytes=1 << 20)
    done = {}
    big = wan.start_transfer(8_000_000, lambda t: done.setdefault("big", t), sender="P0")
    wan.make_sendable(big, 8_000_000)
    small = wan.start_transfer(1_000_000, lambda t: done.setdefault("small", t), sender="P1")
    loop.at(0.5, wan.make_sendable, small, 1_000_000)
    half = wan.start_transfer(1_000_000, lambda t: done.setdefault("late", t), sender="P2")
    loop.at(0.1, wan.make_sendable, half, 500_000)  # only half computed: never done
    loop.run()
    # another sender's small transfer shares the line with the big one instead of waiting
    # for all of it
    assert done["small"] < 0.5 + 0.3
    assert done["big"] == pytest.approx(9.5e6 / 10e6, rel=0.05)
    assert "late" not in done


def test_one_sender_sends_in_write_order():
    """A (P, MD) pair's stripes carry KV in the order P computed it: a newer request's KV
    waits behind an older one's, and bytes computed later wait behind bytes written before."""
    loop = EventLoop()
    wan = WanLine(
        loop,
        rate_mbit=80.0,
        delay_ms=0.0,
        piece_bytes=1 << 18,
        queue_bytes=1 << 20,
        control_reserve=0,
    )
    done = {}
    first = wan.start_transfer(4_000_000, lambda t: done.setdefault("first", t), sender="P0")
    second = wan.start_transfer(1_000_000, lambda t: done.setdefault("second", t), sender="P0")
    wan.make_sendable(first, 2_000_000)  # first half of the older request
    loop.at(0.01, wan.make_sendable, second, 1_000_000)  # the newer one, all of it
    loop.at(0.02, wan.make_sendable, first, 4_000_000)  # the older one's second half
    loop.run()
    line = 10e6  # bytes per second
    # order on the line: first's 2 MB, second's 1 MB, then first's last 2 MB
    assert done["second"] == pytest.approx(3e6 / line, rel=0.02)
    assert done["first"] == pytest.approx(5e6 / line, rel=0.02)
    assert done["second"] < done["first"]


def test_control_messages_wait_behind_queued_bulk_not_behind_unsent_bytes():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=5.0, piece_bytes=1 << 20, queue_bytes=2 << 20)
    tr = wan.start_transfer(50_000_000, lambda t: None, sender=0)
    wan.make_sendable(tr, 50_000_000)
    got = []
    loop.at(1.0, wan.message, "a_to_b", 100, lambda t: got.append(t))
    loop.at(1.0, wan.message, "b_to_a", 100, lambda t: got.append(("back", t)))
    loop.run()
    ahead = (2 << 20) / 10e6  # at most the bottleneck queue's worth of bytes ahead
    assert 1.005 <= got[0][1] <= 1.006  # the empty direction: just the delay
    assert 1.005 <= got[1] <= 1.005 + ahead + 0.11  # bulk direction: queue, not 50 MB


def test_control_messages_go_ahead_of_queued_bulk_on_a_line_with_a_priority_class():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=5.0, piece_bytes=1 << 20, queue_bytes=2 << 20)
    wan.link.set(0.0, priority_dscp=LATENCY_DSCP)  # the daemons' mark for their control lanes
    tr = wan.start_transfer(50_000_000, lambda t: None, sender=0)
    wan.make_sendable(tr, 50_000_000)
    got = []
    loop.at(1.0, wan.message, "a_to_b", 100, lambda t: got.append(t))
    loop.run()
    piece = (1 << 20) / 10e6  # at most the piece the bucket is paying for when it arrives
    assert 1.005 <= got[0] <= 1.005 + piece + 1e-6
    assert wan.link.a_to_b.counters()["priority"]["packets"] == 1


def test_cancel_stops_sending():
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=1.0, piece_bytes=1 << 20, queue_bytes=2 << 20)
    done = []
    tr = wan.start_transfer(20_000_000, done.append, sender=0)
    wan.make_sendable(tr, 20_000_000)
    loop.at(0.2, wan.cancel, tr)
    loop.run()
    assert not done
    assert wan.counters()["kv_bytes"] < 5_000_000
    assert wan.counters()["kv_bytes_cancelled"] > 15_000_000


def _random_traffic(wan: WanLine, loop: EventLoop, seed: int) -> list[tuple[str, float]]:
    import random

    rng = random.Random(seed)
    got: list[tuple[str, float]] = []
    for i in range(40):
        t = rng.uniform(0.0, 2.0)
        if rng.random() < 0.5:
            tr = wan.start_transfer(
                rng.randrange(1, 3_000_000),
                lambda now, i=i: got.append((f"kv{i}", now)),
                sender=rng.randrange(3),
            )
            loop.at(t, wan.make_sendable, tr, tr.total // 2)
            loop.at(t + rng.uniform(0.0, 0.3), wan.make_sendable, tr, tr.total)
        else:
            way = rng.choice(["a_to_b", "b_to_a"])
            loop.at(
                t,
                wan.message,
                way,
                rng.randrange(50, 5000),
                lambda now, i=i: got.append((f"msg{i}", now)),
            )
    loop.run()
    return got


@pytest.mark.parametrize("seed", range(5))
def test_waking_only_when_something_can_happen_changes_no_arrival(seed, monkeypatch):
    """The shell skips the link's queue-exit wake-ups while nobody waits for room (in-order
    propagation: a queued item cannot overtake one in flight). Every arrival is the same as
    with a wake-up at every exit, jitter and a tight queue included."""

    def line(loop: EventLoop) -> WanLine:
        return WanLine(
            loop,
            rate_mbit=40.0,
            delay_ms=20.0,
            jitter_ms=5.0,
            queue_bytes=2 << 20,
            piece_bytes=1 << 18,
            control_reserve=1 << 14,
            seed=seed,
        )

    loop = EventLoop()
    lean = _random_traffic(line(loop), loop, seed)
    lean_events = loop.events_run
    monkeypatch.setattr(
        WanLine, "_next_wake", lambda self, direction: self._dirs[direction].next_wakeup()
    )
    loop = EventLoop()
    eager = _random_traffic(line(loop), loop, seed)
    assert len(lean) > 30
    assert lean == eager
    assert lean_events <= loop.events_run
    if seed == 0:
        assert lean_events < loop.events_run  # (it did skip some)


def test_the_queue_is_the_one_asked_for_and_pieces_fit_in_it():
    """A piece larger than the queue used to raise the queue to fit it: queue_mb = 8 with the
    default 64 MB pieces ran a 65 MB buffer. Now the piece (and the control reserve) are cut
    to fit, so the bottleneck never holds more than asked and every byte still arrives."""
    loop = EventLoop()
    queue = 8 << 20
    wan = WanLine(loop, rate_mbit=800.0, delay_ms=5.0, queue_bytes=queue, piece_bytes=64 << 20)
    done = []
    for sender in range(3):
        tr = wan.start_transfer(40 << 20, done.append, sender=sender)
        wan.make_sendable(tr, 40 << 20)
    for i in range(50):
        loop.at(i * 0.01, wan.message, "a_to_b", 64, lambda now: None)
    loop.run()
    c = wan.counters()
    assert c["queue_bytes"] == queue
    assert c["piece_bytes"] + (1 << 20) <= queue
    assert 0 < c["max_queue_bytes"] <= queue
    assert len(done) == 3 and c["kv_bytes"] == 3 * (40 << 20) and c["drops"] == 0


@pytest.mark.parametrize(
    "queue,piece,want_queue,want_piece",
    [
        (None, 8 << 20, (8 << 20) + (1 << 20), 8 << 20),  # default: one piece and the reserve
        (1 << 20, 32 << 10, 1 << 20, 32 << 10),  # smaller than the reserve: piece kept
    ],
)
def test_default_and_tiny_queues(queue, piece, want_queue, want_piece):
    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=80.0, delay_ms=5.0, queue_bytes=queue, piece_bytes=piece)
    done = []
    tr = wan.start_transfer(3 << 20, done.append, sender=0)
    wan.make_sendable(tr, 3 << 20)
    wan.message("a_to_b", 64, lambda now: done.append(("msg", now)))
    loop.run()
    c = wan.counters()
    assert (c["queue_bytes"], c["piece_bytes"]) == (want_queue, want_piece)
    assert c["max_queue_bytes"] <= want_queue and len(done) == 2
