"""The WAN link model: pure, seeded, time passed in (no sockets, no clock of its own).

Each `LinkDirection` runs the stages a real path has, in this order:

1. ingress: partition / blackhole, random loss, Gilbert-Elliott burst loss (drops counted by cause)
2. bottleneck: token bucket (`rate_mbit`, `burst_bytes`) serving a FIFO with a byte limit
   (`queue_bytes`); arrivals that do not fit are tail-dropped. The queue is served lazily up to
   the `now` of every call, so a rate change applies to what is still queued. With
   `priority_dscp` set, items offered with that DSCP wait in a queue of their own (the same
   byte limit) that the bucket serves first: strict priority, as a QoS class for control
   traffic on a datacenter interconnect. Unmarked items, or any item while it is unset, share
   the one FIFO.
3. propagation: `delay_ms` + jitter (`jitter_ms`, `jitter_dist`, `jitter_corr_pct`). In order by
   default: an item never leaves before the one ahead of it (departure = max(own, previous)),
   unlike netem, whose jitter reorders; `reorder_pct` exempts a share of items from that rule.
4. duplication (`duplicate_pct`): the copy leaves with the original.

A shell (packet forwarder, TCP proxy, simulator) calls `offer` when an item arrives, `poll` at
`next_wakeup()` to get what departs, and `Link.set` & co. to change effects while traffic flows.
Timed changes (durations, schedules) are applied at their exact time while catching up to the
`now` of a later call, so results do not depend on how often the shell calls in.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from emulation.effects import (
    DEFAULT_EFFECTS,
    EFFECTS,
    DelayHistogram,
    GilbertElliott,
    JitterSource,
    bernoulli,
    is_neutral,
    validate_effects,
)

DROP_CAUSES = ("partition", "blackhole", "loss", "burst_loss", "queue_full")


def _check_duration(duration: float | None) -> float | None:
    if duration is None:
        return None
    if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration > 0:
        raise ValueError(f"duration must be a number of seconds > 0, got {duration!r}")
    if duration == float("inf"):
        raise ValueError("duration must be finite (omit it for a permanent change)")
    return float(duration)


@dataclass
class _Queued:
    arrival: float
    size: int
    item: Any  # (Any, not object: mypyc evaluates dataclass annotations by name)


@dataclass
class _InFlight:
    departure: float
    seq: int
    arrival: float = field(compare=False)
    size: int = field(compare=False)
    item: Any = field(compare=False)
    copies: int = field(compare=False)

    def __lt__(self, other: _InFlight) -> bool:
        # the heap's order (departure, then sequence), compiled like __init__
        return self.departure < other.departure or (
            self.departure == other.departure and self.seq < other.seq
        )


@dataclass(order=True)
class _Revert:
    at: float
    seq: int
    # effect name -> (version it reverts, value to restore)
    keys: dict[str, tuple[int, Any]] = field(compare=False)


class LinkDirection:
    """One direction of the WAN: a pure model. `now` is seconds on any monotonic origin."""

    def __init__(self, name: str, seed: int = 0, effects: dict[str, Any] | None = None) -> None:
        self.name = name
        self._baseline = dict(DEFAULT_EFFECTS)
        self._baseline.update(validate_effects(effects or {}))
        self._fx: dict[str, Any] = dict(self._baseline)
        self._version: dict[str, int] = dict.fromkeys(EFFECTS, 0)
        # Separate seeded streams per process: turning on loss does not change the jitter draws.
        self._rng_loss = random.Random(f"{seed}:{name}:loss")
        self._rng_dup = random.Random(f"{seed}:{name}:dup")
        self._rng_reorder = random.Random(f"{seed}:{name}:reorder")
        self._jitter = JitterSource(random.Random(f"{seed}:{name}:jitter"))
        self._ge = GilbertElliott(random.Random(f"{seed}:{name}:ge"))
        self._seq = itertools.count()

        self._now = float("-inf")
        self._queue: deque[_Queued] = deque()
        self._queued_bytes = 0
        self._urgent: deque[_Queued] = deque()  # the priority class (priority_dscp)
        self._urgent_bytes = 0
        self._tokens = float(self._fx["burst_bytes"])
        self._tokens_at = float("-inf")  # time the token count refers to
        self._in_flight: list[_InFlight] = []  # heap by departure
        self._last_departure = float("-inf")  # of in-order items: the in-order floor
        self._reverts: list[_Revert] = []
        self._schedule: Iterator[tuple[float, dict[str, Any], float | None]] | None = None
        self._next_step: tuple[float, dict[str, Any], float | None] | None = None
        self._schedule_info: dict[str, Any] | None = None

        self._c = {
            "bytes_in": 0,
            "packets_in": 0,
            "bytes_out": 0,
            "packets_out": 0,
            "duplicated": 0,
        }
        self._drops = dict.fromkeys(DROP_CAUSES, 0)
        self._drop_bytes = dict.fromkeys(DROP_CAUSES, 0)
        self._max_q_bytes = 0
        self._max_q_packets = 0
        self._urgent_c = {"packets": 0, "bytes": 0, "max_bytes": 0}
        self._hist = DelayHistogram()

    # --- traffic ---------------------------------------------------------------------------

    def offer(self, now: float, size: int, item: object, dscp: int = 0) -> None:
        """An item (packet or byte chunk) of `size` bytes, marked `dscp`, arrives at `now`."""
        if size < 0:
            raise ValueError(f"size must be >= 0 bytes, got {size}")
        now = self._catch_up(now)
        urgent = self.is_priority(dscp)
        self._c["bytes_in"] += size
        self._c["packets_in"] += 1
        fx = self._fx
        cause = None
        if fx["partition"]:
            cause = "partition"
        elif fx["blackhole"]:
            cause = "blackhole"
        elif bernoulli(self._rng_loss, fx["loss_pct"]):
            cause = "loss"
        elif self._ge.drops(
            fx["ge_p_pct"], fx["ge_r_pct"], fx["ge_bad_loss_pct"], fx["ge_good_loss_pct"]
        ):
            cause = "burst_loss"
        elif fx["rate_mbit"] is not None and self._class_bytes(urgent) + size > fx["queue_bytes"]:
            cause = "queue_full"
        if cause is not None:
            self._drops[cause] += 1
            self._drop_bytes[cause] += size
            return
        if urgent:
            self._urgent_c["packets"] += 1
            self._urgent_c["bytes"] += size
        if fx["rate_mbit"] is None:
            self._propagate(now, now, size, item)
            return
        if not self._queue and not self._urgent:
            self._refill(now)
        if urgent:
            self._urgent.append(_Queued(now, size, item))
            self._urgent_bytes += size
            self._urgent_c["max_bytes"] = max(self._urgent_c["max_bytes"], self._urgent_bytes)
        else:
            self._queue.append(_Queued(now, size, item))
            self._queued_bytes += size
            self._max_q_bytes = max(self._max_q_bytes, self._queued_bytes)
            self._max_q_packets = max(self._max_q_packets, len(self._queue))
        self._serve(now)

    def poll(self, now: float) -> list[object]:
        """Every item whose departure time is <= now, in departure order (duplicates twice)."""
        now = self._catch_up(now)
        out: list[object] = []
        while self._in_flight and self._in_flight[0].departure <= now:
            f = heapq.heappop(self._in_flight)
            self._hist.add((f.departure - f.arrival) * 1000.0)
            for _ in range(f.copies):
                out.append(f.item)
                self._c["packets_out"] += 1
                self._c["bytes_out"] += f.size
        return out

    def next_wakeup(self) -> float | None:
        """Earliest time poll() could return something; None when nothing is queued or in flight.

        It may be early (e.g. the head of the queue leaving the bottleneck, or a timed change):
        polling then returns nothing and next_wakeup() moves on.
        """
        wake = self._in_flight[0].departure if self._in_flight else None
        if self._queue or self._urgent:
            head_exit = self._head_exit()
            if head_exit is not None and (wake is None or head_exit < wake):
                wake = head_exit
        if wake is None:
            return None
        event = self._next_event_time()
        return wake if event is None or wake <= event else event

    def next_departure(self) -> float | None:
        """When the next item already past the bottleneck leaves (None: none in flight)."""
        return self._in_flight[0].departure if self._in_flight else None

    def in_order(self) -> bool:
        """True when items leave in arrival order (no reordering): then an item still queued
        departs no sooner than any item already in flight."""
        return not self._fx["reorder_pct"]

    def next_change(self) -> float | None:
        """When the next timed change (revert, schedule step) applies; None when none pending."""
        return self._next_event_time()

    def in_flight_items(self) -> int:
        """Items past the bottleneck and not yet departed (as of the last call)."""
        return len(self._in_flight)

    def queued_bytes(self) -> int:
        """Bytes waiting at the bottleneck, in either class (as of the last call)."""
        return self._queued_bytes + self._urgent_bytes

    def is_priority(self, dscp: int) -> bool:
        """Whether an item marked `dscp` goes in the priority class under the current effects."""
        mark = self._fx["priority_dscp"]
        return mark is not None and dscp == mark

    def would_accept(self, now: float, size: int, dscp: int = 0) -> bool:
        """True when an item of `size` marked `dscp` offered at `now` could only pass ingress and
        its class's queue (random loss aside): byte-stream shells apply backpressure with it
        instead of drops."""
        self._catch_up(now)
        if self.blocked(now):
            return False
        return (
            self._fx["rate_mbit"] is None
            or self._class_bytes(self.is_priority(dscp)) + size <= self._fx["queue_bytes"]
        )

    def queue_space(self, now: float, dscp: int = 0) -> int | None:
        """Free bytes at `now` in the queue an item marked `dscp` would join (None: no rate
        limit, so no queue)."""
        self._catch_up(now)
        if self._fx["rate_mbit"] is None:
            return None
        return max(0, self._fx["queue_bytes"] - self._class_bytes(self.is_priority(dscp)))

    def blocked(self, now: float) -> bool:
        """Partitioned or blackholed at `now`."""
        self._catch_up(now)
        return bool(self._fx["partition"] or self._fx["blackhole"])

    # --- reporting -------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        return {
            **self._c,
            "drops": dict(self._drops),
            "drop_bytes": dict(self._drop_bytes),
            "queue": {
                "bytes": self._queued_bytes,
                "packets": len(self._queue),
                "max_bytes": self._max_q_bytes,
                "max_packets": self._max_q_packets,
            },
            # what went through the priority class (priority_dscp), and its deepest queue
            "priority": {**self._urgent_c, "queued_bytes": self._urgent_bytes},
            "in_flight_packets": len(self._in_flight),
            "delay": self._hist.to_dict(),
        }

    def effects(self) -> dict[str, Any]:
        return dict(self._fx)

    def pending(self) -> dict[str, Any]:
        """Timed changes still to come: reverts and the loaded schedule."""
        return {
            "reverts": [{"at": r.at, "effects": sorted(r.keys)} for r in sorted(self._reverts)],
            "schedule": dict(self._schedule_info) if self._schedule_info else None,
            "next_step_at": self._next_step[0] if self._next_step else None,
        }

    # --- control (called through Link, which validates) ------------------------------------

    def apply(self, now: float, changes: dict[str, Any], duration: float | None = None) -> None:
        """Apply already-validated changes at `now`; with `duration` they revert by themselves."""
        now = self._catch_up(now)
        self._apply_at(now, changes, duration)

    def reset(self, now: float) -> None:
        """Back to the baseline effects; cancel pending reverts and the schedule."""
        now = self._catch_up(now)
        self._reverts.clear()
        self._set_schedule(None, None)
        self._apply_at(now, {k: v for k, v in self._baseline.items() if self._fx[k] != v}, None)

    def set_schedule(
        self,
        now: float,
        steps: Iterator[tuple[float, dict[str, Any], float | None]],
        info: dict[str, Any],
    ) -> None:
        self._catch_up(now)
        self._set_schedule(steps, info)

    # --- internals -------------------------------------------------------------------------

    def _set_schedule(self, steps: Iterator | None, info: dict[str, Any] | None) -> None:
        self._schedule = steps
        self._schedule_info = info
        self._next_step = next(steps, None) if steps is not None else None
        if self._next_step is None:
            self._schedule = None

    def _apply_at(self, t: float, changes: dict[str, Any], duration: float | None) -> None:
        if not changes:
            return
        if "rate_mbit" in changes or "burst_bytes" in changes:
            # Settle the bucket under the old settings first: the change starts exactly at t.
            if self._fx["rate_mbit"] is not None:
                self._refill(t)
        old = {k: self._fx[k] for k in changes}
        for key, value in changes.items():
            self._fx[key] = value
            self._version[key] += 1
        if (
            old.get("rate_mbit", self._fx["rate_mbit"]) is None
            and self._fx["rate_mbit"] is not None
        ):
            self._tokens = float(self._fx["burst_bytes"])
            self._tokens_at = t
        self._tokens = min(self._tokens, float(self._fx["burst_bytes"]))
        if self._fx["rate_mbit"] is None and (self._queue or self._urgent):
            # The limit is gone: everything still queued leaves the bottleneck now.
            for head in sorted([*self._urgent, *self._queue], key=lambda q: q.arrival):
                self._propagate(t, head.arrival, head.size, head.item)
            self._queue.clear()
            self._urgent.clear()
            self._queued_bytes = self._urgent_bytes = 0
        if duration is not None:
            keys = {k: (self._version[k], old[k]) for k in changes}
            heapq.heappush(self._reverts, _Revert(t + duration, next(self._seq), keys))
        self._serve(t)

    def _next_event_time(self) -> float | None:
        step = self._next_step
        if not self._reverts:
            return None if step is None else step[0]
        at = self._reverts[0].at
        return at if step is None else min(at, step[0])

    def _catch_up(self, now: float) -> float:
        """Advance to `now`, applying timed changes at their exact times in order."""
        now = float(now)
        if now < self._now:
            now = self._now  # a shell's clock must not move the model backwards
        while self._reverts or self._next_step is not None:  # (nothing timed: skip the loop)
            event = self._next_event_time()
            if event is None or event > now:
                break
            self._serve(event)
            if self._reverts and self._reverts[0].at == event:
                revert = heapq.heappop(self._reverts)
                restore = {
                    k: value
                    for k, (version, value) in revert.keys.items()
                    if self._version[k] == version
                }  # later changes win over the revert
                self._apply_at(event, restore, None)
            else:
                step, schedule = self._next_step, self._schedule
                assert step is not None and schedule is not None, "a step was due"
                at, changes, duration = step
                self._next_step = next(schedule, None)
                if self._next_step is None:
                    self._schedule = None
                    if self._schedule_info is not None:
                        self._schedule_info["finished"] = True
                self._apply_at(at, changes, duration)
        self._serve(now)
        self._now = now
        return now

    def _rate_bytes_per_s(self) -> float | None:
        rate = self._fx["rate_mbit"]
        return None if rate is None else rate * 1e6 / 8.0

    def _refill(self, t: float) -> None:
        rate = self._rate_bytes_per_s()
        if rate is None:
            return
        if self._tokens_at == float("-inf"):
            self._tokens = float(self._fx["burst_bytes"])
        elif t > self._tokens_at:
            self._tokens = min(
                float(self._fx["burst_bytes"]), self._tokens + rate * (t - self._tokens_at)
            )
        self._tokens_at = max(t, self._tokens_at)

    def _class_bytes(self, urgent: bool) -> int:
        return self._urgent_bytes if urgent else self._queued_bytes

    def _next_queue(self) -> deque[_Queued]:
        """The queue the bucket serves next: the priority class's while it holds anything."""
        return self._urgent if self._urgent else self._queue

    def _head_exit(self) -> float | None:
        """When the next item leaves the bottleneck under the current settings."""
        queue = self._next_queue()
        rate = self._rate_bytes_per_s()
        if rate is None:
            return queue[0].arrival if queue else None
        head = queue[0]
        # Items larger than the bucket may go once it is full; the deficit is paid back later.
        need = min(float(head.size), float(self._fx["burst_bytes"]))
        # (max with its arrival: a priority item may arrive after the bucket's last refill)
        return max(head.arrival, self._tokens_at + max(0.0, need - self._tokens) / rate)

    def _serve(self, until: float) -> None:
        """Move items that leave the bottleneck by `until` into the propagation stage."""
        while self._queue or self._urgent:
            exit_at = self._head_exit()
            if exit_at is None or exit_at > until:
                break
            queue = self._next_queue()
            head = queue.popleft()
            if queue is self._urgent:
                self._urgent_bytes -= head.size
            else:
                self._queued_bytes -= head.size
            if self._rate_bytes_per_s() is not None:
                self._refill(exit_at)
                self._tokens -= head.size
            self._propagate(exit_at, head.arrival, head.size, head.item)

    def _propagate(self, t: float, arrival: float, size: int, item: object) -> None:
        fx = self._fx
        own = (
            t
            + max(
                0.0,
                fx["delay_ms"]
                + self._jitter.draw(fx["jitter_ms"], fx["jitter_dist"], fx["jitter_corr_pct"]),
            )
            / 1000.0
        )
        if bernoulli(self._rng_reorder, fx["reorder_pct"]):
            departure = own  # exempt: may overtake, and does not hold back later items
        else:
            departure = max(own, self._last_departure)
            self._last_departure = departure
        copies = 2 if bernoulli(self._rng_dup, fx["duplicate_pct"]) else 1
        if copies == 2:
            self._c["duplicated"] += 1
        heapq.heappush(
            self._in_flight, _InFlight(departure, next(self._seq), arrival, size, item, copies)
        )


class Link:
    """The WAN between datacenter A and B: two LinkDirections plus the control verbs."""

    def __init__(self, seed: int = 0, **initial_effects: Any) -> None:
        checked = validate_effects(initial_effects)
        self.seed = seed
        self.a_to_b = LinkDirection("a_to_b", seed, checked)
        self.b_to_a = LinkDirection("b_to_a", seed, checked)
        # effect name -> why this shell cannot model it (see restrict()).
        self._restricted: dict[str, str] = {}
        self._listeners: list[Callable[[], None]] = []

    def subscribe(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after every control change (set, clear, chaos, schedule load), so
        a shell sleeping until next_wakeup() can re-plan; timed changes need no callback since
        next_wakeup() already accounts for them."""
        self._listeners.append(callback)

    def unsubscribe(self, callback: Callable[[], None]) -> None:
        if callback in self._listeners:
            self._listeners.remove(callback)

    def _changed(self) -> None:
        for callback in list(self._listeners):
            callback()

    def direction(self, name: str) -> LinkDirection:
        if name == "a_to_b":
            return self.a_to_b
        if name == "b_to_a":
            return self.b_to_a
        raise ValueError(f"unknown direction {name!r} (known: a_to_b, b_to_a, both)")

    def _directions(self, direction: str) -> list[LinkDirection]:
        if direction == "both":
            return [self.a_to_b, self.b_to_a]
        return [self.direction(direction)]

    def restrict(self, effects: Iterable[str], reason: str) -> None:
        """Reject non-neutral values of `effects` from now on (a shell that cannot model them)."""
        for name in effects:
            if name not in EFFECTS:
                raise ValueError(f"unknown effect {name!r}")
            for d in (self.a_to_b, self.b_to_a):
                if not is_neutral(name, d.effects()[name]):
                    raise ValueError(f"{name}={d.effects()[name]!r} on {d.name}: {reason}")
            self._restricted[name] = reason

    def check(self, effects: dict[str, Any]) -> dict[str, Any]:
        """Validate a change (ranges, names, this shell's restrictions); returns it normalised."""
        checked = validate_effects(effects)
        for name, value in checked.items():
            if name in self._restricted and not is_neutral(name, value):
                raise ValueError(
                    f"{name}={value!r} is not supported here: {self._restricted[name]}"
                )
        return checked

    def set(
        self, now: float, direction: str = "both", duration: float | None = None, **effects: Any
    ) -> None:
        """Change effects while traffic flows; with `duration` (s) they revert at now + duration.

        A revert restores each effect's earlier value unless that effect was changed again in
        the meantime (the later change wins)."""
        targets = self._directions(direction)
        duration = _check_duration(duration)
        checked = self.check(effects)
        if not checked:
            raise ValueError("no effects given")
        for d in targets:
            d.apply(now, checked, duration)
        self._changed()

    def clear(self, now: float, direction: str = "both") -> None:
        """Back to the link's initial effects; cancels pending reverts and schedules."""
        for d in self._directions(direction):
            d.reset(now)
        self._changed()

    def partition(self, now: float, duration: float | None = None) -> None:
        """Both directions drop everything (a shell for byte streams holds them instead)."""
        self.set(now, "both", duration, partition=True)

    def heal(self, now: float) -> None:
        """End a partition and any blackhole, on both directions."""
        self.set(now, "both", None, partition=False, blackhole=False)

    def blackhole(self, now: float, direction: str, duration: float | None = None) -> None:
        if direction == "both":
            raise ValueError(
                "blackhole is one direction: a_to_b or b_to_a (use partition for both)"
            )
        self.set(now, direction, duration, blackhole=True)

    # --- chaos verbs: one call each, always with a duration --------------------------------

    def latency_spike(
        self, now: float, duration: float, add_ms: float, direction: str = "both"
    ) -> None:
        """Add `add_ms` to the one-way delay for `duration` seconds."""
        _check_duration_required(duration)
        if isinstance(add_ms, bool) or not isinstance(add_ms, (int, float)) or add_ms <= 0:
            raise ValueError(f"add_ms must be a number of ms > 0, got {add_ms!r}")
        self._set_each(
            now,
            duration,
            [
                (d, {"delay_ms": d.effects()["delay_ms"] + add_ms})
                for d in self._directions(direction)
            ],
        )

    def bandwidth_collapse(
        self, now: float, duration: float, fraction: float, direction: str = "both"
    ) -> None:
        """Cut the rate to `fraction` (0 < fraction <= 1) of its current value for `duration` s."""
        _check_duration_required(duration)
        if (
            isinstance(fraction, bool)
            or not isinstance(fraction, (int, float))
            or not 0 < fraction <= 1
        ):
            raise ValueError(f"fraction must be a number in (0, 1], got {fraction!r}")
        targets = self._directions(direction)
        for d in targets:
            if d.effects()["rate_mbit"] is None:
                raise ValueError(
                    f"bandwidth collapse needs a rate limit on {d.name} (rate_mbit is unlimited)"
                )
        self._set_each(
            now,
            duration,
            [(d, {"rate_mbit": d.effects()["rate_mbit"] * fraction}) for d in targets],
        )

    def loss_burst(
        self, now: float, duration: float, loss_pct: float = 100.0, direction: str = "both"
    ) -> None:
        """Random loss of `loss_pct` percent for `duration` seconds."""
        _check_duration_required(duration)
        self.set(now, direction, duration, loss_pct=loss_pct)

    def jitter_storm(
        self,
        now: float,
        duration: float,
        jitter_ms: float,
        jitter_dist: str | None = None,
        direction: str = "both",
    ) -> None:
        """Jitter of `jitter_ms` (optionally another distribution) for `duration` seconds."""
        _check_duration_required(duration)
        extra = {} if jitter_dist is None else {"jitter_dist": jitter_dist}
        self.set(now, direction, duration, jitter_ms=jitter_ms, **extra)

    def chaos(self, now: float, kind: str, duration: float, **params: Any) -> None:
        """Dispatch a chaos verb by its API name (partition, latency-spike, ...)."""
        verbs: dict[str, Callable[..., None]] = {
            "partition": self._chaos_partition,
            "latency-spike": self.latency_spike,
            "bandwidth-collapse": self.bandwidth_collapse,
            "loss-burst": self.loss_burst,
            "jitter-storm": self.jitter_storm,
        }
        verb = verbs.get(kind)
        if verb is None:
            raise ValueError(f"unknown chaos {kind!r} (known: {', '.join(verbs)})")
        try:
            verb(now, duration, **params)
        except TypeError as exc:
            raise ValueError(f"bad parameters for chaos {kind!r}: {exc}") from None

    def _chaos_partition(self, now: float, duration: float) -> None:
        _check_duration_required(duration)
        self.partition(now, duration)

    def _set_each(
        self, now: float, duration: float, changes: list[tuple[LinkDirection, dict[str, Any]]]
    ) -> None:
        """Per-direction changes, all validated before any is applied."""
        checked = [(d, self.check(c)) for d, c in changes]
        for d, c in checked:
            d.apply(now, c, _check_duration(duration))
        self._changed()

    # --- schedules -------------------------------------------------------------------------

    def load_schedule(
        self,
        now: float,
        steps: list[dict] | str | Path,
        loop: bool = False,
        period: float | None = None,
    ) -> None:
        """Replace the schedule: a list of steps or a trace file; times are relative to `now`.

        Steps: {"at": s, "direction": "both"|"a_to_b"|"b_to_a", "duration": s?, effect: value...}.
        Trace files (.csv with a header, or .jsonl): rows of time (s) and effects, e.g.
        time,rate_mbit,delay_ms. With loop, it repeats every `period` seconds (default: the last
        step's time plus the gap before it, so an evenly spaced trace repeats seamlessly)."""
        from emulation.schedule import build_schedule

        plan = build_schedule(steps, loop=loop, period=period, check=self.check)
        now = max(float(now), self.a_to_b._now, self.b_to_a._now)
        for d in (self.a_to_b, self.b_to_a):
            iterator = plan.iterate(now, d.name)
            d.set_schedule(now, iterator, plan.info(now, d.name))
        self._changed()

    def snapshot(self, now: float) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for d in (self.a_to_b, self.b_to_a):
            d._catch_up(now)  # counters as of `now`; departures stay for poll()
            out[d.name] = {"effects": d.effects(), "counters": d.counters(), "pending": d.pending()}
        if self._restricted:
            out["restricted"] = dict(self._restricted)
        return out


def _check_duration_required(duration: float) -> None:
    if duration is None:
        raise ValueError("duration (s) is required for a chaos verb")
    _check_duration(duration)


def earliest(a: float | None, b: float | None) -> float | None:
    """The sooner of two optional wake-up times (None = nothing scheduled)."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)
