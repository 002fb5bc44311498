"""The WAN line between datacenter A and B, driven by the emulator's link model on sim time.

``emulation.link.Link`` is the very model the proxy / packet shells use: token-bucket bottleneck
with a byte-limited FIFO, propagation delay with jitter, loss, schedules. This shell plays the
part of the TCP senders in front of it:
- bulk KV transfers are cut into pieces and offered round-robin across active transfers (the
  fair share of parallel TCP streams), only while the bottleneck queue has room (backpressure,
  never a tail drop), keeping ``control_reserve`` bytes free for control messages;
- control messages (allocation, TAKEOVER, HANDOFF token ids, cancel) are small items offered to
  the same link, so they wait behind the bulk bytes already queued at the bottleneck, as on a
  real line, but never behind a transfer's unsent bytes (they have their own connection).
Loss is not retransmitted here: use loss-free links (the TCP shell's view of the line).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from emulation.link import Link, LinkDirection
from pddnet.sim.events import EventLoop


class Transfer:
    """One request's KV on the WAN; bytes become sendable as P computes them."""

    __slots__ = ("total", "sendable", "offered", "delivered", "on_done", "cancelled",
                 "started_at", "done_at")

    def __init__(self, total: int, on_done: Callable[[float], None], now: float) -> None:
        self.total = total
        self.sendable = 0
        self.offered = 0
        self.delivered = 0
        self.on_done = on_done
        self.cancelled = False
        self.started_at = now
        self.done_at: float | None = None


class _Message:
    __slots__ = ("callback", "args")

    def __init__(self, callback: Callable[..., None], args: tuple[Any, ...]) -> None:
        self.callback = callback
        self.args = args


class _Piece:
    __slots__ = ("transfer", "size")

    def __init__(self, transfer: Transfer, size: int) -> None:
        self.transfer = transfer
        self.size = size


class WanLine:
    def __init__(self, loop: EventLoop, rate_mbit: float, delay_ms: float, jitter_ms: float = 0.0,
                 queue_bytes: int = 64 << 20, piece_bytes: int = 8 << 20, seed: int = 0,
                 control_reserve: int = 1 << 20, **effects: Any) -> None:
        if rate_mbit <= 0:
            raise ValueError(f"WAN rate must be > 0 Mbit/s, got {rate_mbit!r}")
        if piece_bytes < 1:
            raise ValueError(f"piece_bytes must be >= 1, got {piece_bytes!r}")
        queue_bytes = max(int(queue_bytes), piece_bytes + control_reserve)
        self.loop = loop
        self.link = Link(seed=seed, rate_mbit=rate_mbit, delay_ms=delay_ms, jitter_ms=jitter_ms,
                         queue_bytes=queue_bytes, **effects)
        self.piece_bytes = piece_bytes
        self.control_reserve = control_reserve
        self.rate_bytes_per_s = rate_mbit * 1e6 / 8
        self.one_way_s = delay_ms / 1e3
        self._burst = self.link.a_to_b.effects()["burst_bytes"]
        self._dirs = {"a_to_b": self.link.a_to_b, "b_to_a": self.link.b_to_a}
        self._ready: deque[Transfer] = deque()      # transfers with sendable, unoffered bytes
        # control messages not yet accepted by the bottleneck queue (their TCP send buffer)
        self._control: dict[str, deque[tuple[int, _Message]]] = {"a_to_b": deque(),
                                                                 "b_to_a": deque()}
        self._pump_token = {"a_to_b": 0, "b_to_a": 0}
        self._pump_at: dict[str, float | None] = {"a_to_b": None, "b_to_a": None}
        self.kv_bytes = 0            # KV bytes offered to the line
        self.kv_bytes_cancelled = 0  # bytes of cancelled transfers never offered (computed or not)
        self.messages = 0

    # -- what the system calls ----------------------------------------------------------------

    def start_transfer(self, total_bytes: int, on_done: Callable[[float], None]) -> Transfer:
        tr = Transfer(int(total_bytes), on_done, self.loop.now)
        if tr.total <= 0:
            tr.done_at = self.loop.now
            self.loop.at(self.loop.now, on_done, self.loop.now)
        return tr

    def make_sendable(self, tr: Transfer, upto_bytes: int) -> None:
        """Bytes [0, upto) of the transfer are computed and may be sent."""
        if tr.cancelled or tr.total <= 0:
            return
        upto = min(int(upto_bytes), tr.total)
        if upto <= tr.sendable:
            return
        idle = tr.sendable == tr.offered
        tr.sendable = upto
        if idle:
            self._ready.append(tr)
        self._pump_now("a_to_b")

    def cancel(self, tr: Transfer) -> None:
        """Stop sending (pieces already on the line still arrive and are discarded)."""
        if tr.cancelled or tr.done_at is not None:
            return
        tr.cancelled = True
        self.kv_bytes_cancelled += tr.total - tr.offered

    def message(self, direction: str, size: int, callback: Callable[..., None],
                *args: Any) -> None:
        """A control message; ``callback(arrival_time, *args)`` when it arrives."""
        if direction not in self._dirs:
            self.link.direction(direction)      # raises: not a direction's name
        self.messages += 1
        self._control[direction].append((size, _Message(callback, args)))
        self._pump_now(direction)

    # -- the sender / receiver loop -------------------------------------------------------------

    def _pump_now(self, direction: str) -> None:
        self._schedule(direction, self.loop.now)

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
                item.callback(now, *item.args)
        control = self._control[direction]
        while control and d.would_accept(now, control[0][0]):
            size, msg = control.popleft()
            d.offer(now, size, msg)
        if direction == "a_to_b" and not control:
            self._offer_pieces(d, now)
        wake = d.next_wakeup()
        if wake is not None:
            self._schedule(direction, max(wake, now + 1e-9))

    def _offer_pieces(self, d: LinkDirection, now: float) -> None:
        ready = self._ready
        while ready:
            tr = ready[0]
            if tr.cancelled:
                ready.popleft()
                continue
            space = d.queue_space(now)
            size = min(self.piece_bytes, tr.sendable - tr.offered)
            if space is not None and space - self.control_reserve < size:
                return
            ready.popleft()
            tr.offered += size
            self.kv_bytes += size
            d.offer(now, size, _Piece(tr, size))
            if tr.offered < tr.sendable:
                ready.append(tr)   # round-robin: the next transfer's piece goes first

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
            tr.on_done(now)

    # -- reporting --------------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        c = self.link.a_to_b.counters()
        return {"kv_bytes": self.kv_bytes, "kv_bytes_cancelled": self.kv_bytes_cancelled,
                "messages": self.messages, "bytes_out_a_to_b": c["bytes_out"],
                "max_queue_bytes": c["queue"]["max_bytes"],
                "drops": sum(c["drops"].values())}
