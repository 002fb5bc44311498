"""The WAN line between datacenter A and B, driven by the emulator's link model on sim time.

``emulation.link.Link`` is the very model the proxy / packet shells use: token-bucket bottleneck
with a byte-limited FIFO, propagation delay with jitter, loss, schedules. This shell plays the
part of the TCP senders in front of it:
- bulk KV transfers are cut into pieces and offered, only while the bottleneck queue has room
  (backpressure, never a tail drop, keeping ``control_reserve`` bytes free for control
  messages), as the prefill daemon's striped sender writes them: each *sender* (a (P, MD)
  pair: its own TCP stripes) sends its bytes in the order P computed them (write order, so
  an older request's KV goes before a newer one's), and the senders share the line
  round-robin (the fair share of parallel TCP streams);
- control messages (allocation, TAKEOVER, HANDOFF token ids, cancel) are small items offered to
  the same link, so they wait behind the bulk bytes already queued at the bottleneck, as on a
  real line, but never behind a transfer's unsent bytes (they have their own connection).
  They are marked as the daemons mark their control lanes (``LATENCY_DSCP``), so a line with
  ``priority_dscp`` set serves them ahead of the queued KV, as it does on the testbed.
Loss is not retransmitted here: use loss-free links (the TCP shell's view of the line).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

from emulation.link import Link, LinkDirection
from pddnet.lanes import LATENCY_DSCP
from pddnet.sim.events import EventLoop


def _called(now: float) -> None:
    """A transfer's ``on_done`` once it ran (or can no longer run). Dropping the callback
    frees the request it closes over by reference counting, not by a cyclic garbage
    collection much later: at scale such garbage was a third of the simulated requests."""
    raise AssertionError("a transfer's on_done ran twice")


class Transfer:
    """One request's KV on the WAN; bytes become sendable as P computes them."""

    __slots__ = (
        "total",
        "sendable",
        "offered",
        "delivered",
        "on_done",
        "cancelled",
        "started_at",
        "done_at",
        "sender",
    )

    def __init__(
        self, total: int, on_done: Callable[[float], None], now: float, sender: Hashable
    ) -> None:
        self.sender = sender
        self.total = total
        self.sendable = 0
        self.offered = 0
        self.delivered = 0
        self.on_done = on_done
        self.cancelled = False
        self.started_at = now
        self.done_at: float | None = None


# The line's small records (eq=False: compared by identity, as plain objects are)
@dataclass(slots=True, eq=False)
class _Write:
    """Bytes of one transfer P made sendable: sent in write order within their sender."""

    transfer: Transfer
    upto: int


@dataclass(slots=True, eq=False)
class _Message:
    callback: Callable[..., None]
    args: tuple[Any, ...]


@dataclass(slots=True, eq=False)
class _Piece:
    transfer: Transfer
    size: int


class WanLine:
    def __init__(
        self,
        loop: EventLoop,
        rate_mbit: float,
        delay_ms: float,
        jitter_ms: float = 0.0,
        queue_bytes: int | None = None,
        piece_bytes: int = 8 << 20,
        seed: int = 0,
        control_reserve: int = 1 << 20,
        **effects: Any,
    ) -> None:
        if rate_mbit <= 0:
            raise ValueError(f"WAN rate must be > 0 Mbit/s, got {rate_mbit!r}")
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes!r}")
        if queue_bytes is None:
            queue_bytes = piece_bytes + control_reserve  # the default: one piece and the reserve
        elif queue_bytes < 2:
            raise ValueError(
                f"queue_bytes must be >= 2 (a reserve and a piece), got {queue_bytes!r}"
            )
        # An explicit queue is the one asked for: the piece and the control reserve are cut to
        # fit in it (a piece larger than the queue could never be offered; raising the queue to
        # fit it, as this once did, turned queue_mb = 8 into a 65 MB buffer). A queue smaller
        # than the reserve keeps room for one piece: KV enters it only when it is empty.
        queue_bytes = int(queue_bytes)
        control_reserve = min(control_reserve, queue_bytes - min(piece_bytes, queue_bytes // 2))
        piece_bytes = min(piece_bytes, queue_bytes - control_reserve)
        self.loop = loop
        self.link = Link(
            seed=seed,
            rate_mbit=rate_mbit,
            delay_ms=delay_ms,
            jitter_ms=jitter_ms,
            queue_bytes=queue_bytes,
            **effects,
        )
        self.piece_bytes = piece_bytes
        self.control_reserve = control_reserve
        self.rate_bytes_per_s = rate_mbit * 1e6 / 8
        self.one_way_s = delay_ms / 1e3
        self._burst = self.link.a_to_b.effects()["burst_bytes"]
        self._dirs = {"a_to_b": self.link.a_to_b, "b_to_a": self.link.b_to_a}
        # senders with written, unoffered bytes (round-robin), and each one's writes in order
        self._ready: deque[Hashable] = deque()
        self._writes: dict[Hashable, deque[_Write]] = {}
        # control messages not yet accepted by the bottleneck queue (their TCP send buffer)
        self._control: dict[str, deque[tuple[int, _Message]]] = {
            "a_to_b": deque(),
            "b_to_a": deque(),
        }
        self._pump_token = {"a_to_b": 0, "b_to_a": 0}
        self._pump_at: dict[str, float | None] = {"a_to_b": None, "b_to_a": None}
        self.kv_bytes = 0  # KV bytes offered to the line
        self.kv_bytes_cancelled = 0  # bytes of cancelled transfers never offered (computed or not)
        self.messages = 0

    # -- what the system calls ----------------------------------------------------------------

    def start_transfer(
        self, total_bytes: int, on_done: Callable[[float], None], *, sender: Hashable
    ) -> Transfer:
        """A transfer of ``sender``'s (its bytes go in write order behind that sender's
        earlier writes; senders share the line round-robin)."""
        tr = Transfer(int(total_bytes), on_done, self.loop.now, sender)
        if tr.total <= 0:
            tr.done_at = self.loop.now
            tr.on_done = _called
            self.loop.at(self.loop.now, on_done, self.loop.now)
        return tr

    def make_sendable(self, tr: Transfer, upto_bytes: int) -> None:
        """Bytes [0, upto) of the transfer are computed and may be sent."""
        if tr.cancelled or tr.total <= 0:
            return
        upto = min(int(upto_bytes), tr.total)
        if upto <= tr.sendable:
            return
        tr.sendable = upto
        writes = self._writes.get(tr.sender)
        if writes is None:
            writes = self._writes[tr.sender] = deque()
        if not writes:
            self._ready.append(tr.sender)
        if writes and writes[-1].transfer is tr:
            writes[-1].upto = upto  # the same transfer's next bytes: one write
        else:
            writes.append(_Write(tr, upto))
        now = self.loop.now
        if not self._control["a_to_b"]:
            self._offer_pieces(self.link.a_to_b, now)
        self._wake("a_to_b", now)

    def cancel(self, tr: Transfer) -> None:
        """Stop sending (pieces already on the line still arrive and are discarded)."""
        if tr.cancelled or tr.done_at is not None:
            return
        tr.cancelled = True
        tr.on_done = _called
        self.kv_bytes_cancelled += tr.total - tr.offered

    def message(self, direction: str, size: int, callback: Callable[..., None], *args: Any) -> None:
        """A control message; ``callback(arrival_time, *args)`` when it arrives."""
        if direction not in self._dirs:
            self.link.direction(direction)  # raises: not a direction's name
        self.messages += 1
        msg = _Message(callback, args)
        control, d, now = self._control[direction], self._dirs[direction], self.loop.now
        if not control and d.would_accept(now, size, LATENCY_DSCP):
            d.offer(now, size, msg, LATENCY_DSCP)  # nothing ahead of it in its send buffer
        else:
            control.append((size, msg))
        self._wake(direction, now)

    # -- the sender / receiver loop -------------------------------------------------------------

    # Offers are made synchronously (the link model is served up to the `now` of every call, so
    # this is the same as offering in an event at `now`) and the line wakes only when something
    # can change for its senders or receivers: see _next_wake.

    def _wake(self, direction: str, now: float) -> None:
        """Schedule the pump at the next time it has work (outside a pump: may be `now`)."""
        wake = self._next_wake(direction)
        if wake is not None:
            self._schedule(direction, max(wake, now))

    def _next_wake(self, direction: str) -> float | None:
        """When the pump next has work: the next departure, or while a sender waits for queue
        room (or nothing has passed the bottleneck yet) the queue head's exit. With in-order
        propagation an item still queued departs no sooner than every item in flight, so
        while nobody waits for room the exits in between need no call: results do not depend
        on how often the link is polled, only the number of events does."""
        d = self._dirs[direction]
        departure = d.next_departure()
        if (
            departure is None
            or self._control[direction]
            or (direction == "a_to_b" and self._ready)
            or not d.in_order()
        ):
            return d.next_wakeup()
        change = d.next_change()
        return departure if change is None or departure <= change else change

    def _schedule(self, direction: str, t: float) -> None:
        at = self._pump_at[direction]
        if at is not None and at <= t:
            return
        self._pump_token[direction] += 1
        self._pump_at[direction] = t
        self.loop.at(t, self._pump, direction, self._pump_token[direction])

    def _pump(self, direction: str, token: int) -> None:
        if token != self._pump_token[direction]:
            return
        self._pump_at[direction] = None
        now = self.loop.now
        d = self._dirs[direction]
        for item in d.poll(now):
            if isinstance(item, _Piece):
                self._delivered(item, now)
            else:
                assert isinstance(item, _Message), "the line carries pieces and messages"
                item.callback(now, *item.args)
        control = self._control[direction]
        while control and d.would_accept(now, control[0][0], LATENCY_DSCP):
            size, msg = control.popleft()
            d.offer(now, size, msg, LATENCY_DSCP)
        if direction == "a_to_b" and not control:
            self._offer_pieces(d, now)
        self._wake(direction, now + 1e-9)  # (never again at this instant: no busy loop)

    def _offer_pieces(self, d: LinkDirection, now: float) -> None:
        ready = self._ready
        while ready:
            writes = self._writes[ready[0]]
            w = writes[0]
            tr = w.transfer
            size = min(self.piece_bytes, w.upto - tr.offered)
            if tr.cancelled or size <= 0:
                writes.popleft()
                if not writes:
                    ready.popleft()
                continue
            space = d.queue_space(now)
            if space is not None and space - self.control_reserve < size:
                return
            tr.offered += size
            self.kv_bytes += size
            d.offer(now, size, _Piece(tr, size))
            if tr.offered >= w.upto:
                writes.popleft()
            if writes:
                ready.rotate(-1)  # round-robin: the next sender's piece goes first
            else:
                ready.popleft()

    def _delivered(self, piece: _Piece, now: float) -> None:
        # The link model lets an item larger than its token bucket leave once the bucket is
        # full and pays the deficit back afterwards: its departure is its FIRST byte's. A KV
        # piece is megabytes, so its last byte arrives its serialisation time later.
        tail = max(0, piece.size - self._burst) / self.rate_bytes_per_s
        if tail > 0:
            self.loop.at(now + tail, self._complete, piece)
        else:
            self._complete(piece)

    def _complete(self, piece: _Piece) -> None:
        now = self.loop.now
        tr = piece.transfer
        tr.delivered += piece.size
        if tr.delivered >= tr.total and not tr.cancelled and tr.done_at is None:
            tr.done_at = now
            done, tr.on_done = tr.on_done, _called
            done(now)

    # -- reporting --------------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        c = self.link.a_to_b.counters()
        return {
            "kv_bytes": self.kv_bytes,
            "kv_bytes_cancelled": self.kv_bytes_cancelled,
            "messages": self.messages,
            "bytes_out_a_to_b": c["bytes_out"],
            "queue_bytes": self.link.a_to_b.effects()["queue_bytes"],
            "piece_bytes": self.piece_bytes,
            "max_queue_bytes": c["queue"]["max_bytes"],
            "drops": sum(c["drops"].values()),
        }
