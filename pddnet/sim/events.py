"""The discrete-event core: a heap of (time, sequence number, callback) events. No wall clock.

Ties are broken by scheduling order, so a run is a pure function of its inputs (the same config
and seed give the same event order and byte-identical results). Callbacks schedule more events;
``run`` pops them in time order until none is left (or a time / event limit is reached).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class _Event:
    """One scheduled call, ordered by (time, scheduling order). A class with its own ``<``
    rather than a tuple: compiled, the comparison reads two native floats, where a tuple's
    compared the float objects twice (equal? then less?) -- the heap's whole cost."""

    __slots__ = ("t", "seq", "fn", "args")

    def __init__(self, t: float, seq: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.t = t
        self.seq = seq
        self.fn = fn
        self.args = args

    def __lt__(self, other: _Event) -> bool:
        return self.t < other.t or (self.t == other.t and self.seq < other.seq)


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[_Event] = []
        self._seq = 0
        self.events_run = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``t`` (never before now)."""
        if t < self.now:
            if t < self.now - 1e-9:
                raise ValueError(f"cannot schedule at {t!r} < now {self.now!r}")
            t = self.now
        self._seq += 1
        heapq.heappush(self._heap, _Event(t, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        if dt < 0:
            raise ValueError(f"negative delay {dt!r}")
        self.at(self.now + dt, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def run(self, until: float | None = None, max_events: int | None = None) -> int:
        """Process events in time order; returns how many ran. Stops when the heap is empty,
        the next event is after ``until`` (now becomes ``until``) or ``max_events`` ran."""
        heap, pop, count = self._heap, heapq.heappop, 0
        while heap:
            if until is not None and heap[0].t > until:
                self.now = until
                break
            if max_events is not None and count >= max_events:
                break
            ev = pop(heap)
            self.now = ev.t
            ev.fn(*ev.args)
            count += 1
        self.events_run += count
        return count
