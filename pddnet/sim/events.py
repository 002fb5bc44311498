"""The discrete-event core: a heap of (time, sequence number, callback). No wall clock.

Ties are broken by scheduling order, so a run is a pure function of its inputs (the same config
and seed give the same event order and byte-identical results). Callbacks schedule more events;
``run`` pops them in time order until none is left (or a time / event limit is reached).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = 0
        self.events_run = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at simulated time ``t`` (never before now)."""
        if t < self.now:
            if t < self.now - 1e-9:
                raise ValueError(f"cannot schedule at {t!r} < now {self.now!r}")
            t = self.now
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, fn, args))

    def after(self, dt: float, fn: Callable[..., Any], *args: Any) -> None:
        if dt < 0:
            raise ValueError(f"negative delay {dt!r}")
        self.at(self.now + dt, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def next_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(self, until: float | None = None, max_events: int | None = None) -> int:
        """Process events in time order; returns how many ran. Stops when the heap is empty,
        the next event is after ``until`` (now becomes ``until``) or ``max_events`` ran."""
        heap, pop, count = self._heap, heapq.heappop, 0
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                break
            if max_events is not None and count >= max_events:
                break
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            count += 1
        self.events_run += count
        return count
