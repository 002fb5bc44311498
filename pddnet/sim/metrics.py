"""Streaming statistics with bounded memory: log-bucketed histograms and a downsampling series.

A million requests never become a list: every latency goes into a ``Histogram`` (buckets of
constant relative width, 0.5% by default, so a quantile is within 0.25% of the exact value plus
the exact min / max / mean), and time series (RLD queue depth) into a ``Series`` that halves its
resolution whenever it would exceed its point budget. Both are deterministic.
"""

from __future__ import annotations

import math
from typing import Any


class Histogram:
    """Weighted histogram of non-negative values with relative-width buckets."""

    def __init__(self, rel_width: float = 0.005, floor: float = 1e-6) -> None:
        if not 0 < rel_width < 1:
            raise ValueError(f"rel_width must be in (0, 1), got {rel_width!r}")
        self._log_base = math.log1p(rel_width)
        self._floor = floor
        # weight per bucket b at index b + 1 (b = -1: at or below the floor); a list, not a
        # dict: the hottest call of a run then boxes no key and hashes nothing. Its length is
        # bounded by the largest float: ~145K buckets at 0.5%, a few thousand for latencies.
        self._weights: list[float] = []
        self.n = 0.0
        self.total = 0.0
        self.min = math.inf
        self.max = -math.inf

    @property
    def counts(self) -> dict[int, float]:
        """Weight per bucket, for the buckets holding any, in bucket order."""
        return {i - 1: c for i, c in enumerate(self._weights) if c}

    def _bucket(self, value: float) -> int:
        if value <= self._floor:
            return -1
        r = value / self._floor
        # (past ~1e302 the ratio overflows: the difference of logs is finite)
        return int(
            (math.log(r) if r != math.inf else math.log(value) - math.log(self._floor))
            / self._log_base
        )

    def add(self, value: float, weight: float = 1.0) -> None:
        if weight <= 0:
            return
        if value < 0 or value != value or value == math.inf:
            raise ValueError(f"histogram values must be finite and >= 0, got {value!r}")
        # _bucket + 1, inlined (the hottest call of a run)
        if value <= self._floor:
            i = 0
        else:
            r = value / self._floor
            i = int(math.log(r) / self._log_base) + 1 if r != math.inf else self._bucket(value) + 1
        w = self._weights
        if i >= len(w):
            w.extend([0.0] * (i + 1 - len(w)))
        w[i] += weight
        self.n += weight
        self.total += value * weight
        if value < self.min:
            self.min = value
        if value > self.max:
            self.max = value

    def add_each(self, values: list[float], weight: float) -> None:
        """``add(value, weight)`` for every value (one call for a run of them: a hot path)."""
        if weight <= 0 or not values:
            return
        total = sum(values)  # (nan or inf if any value is)
        if not math.isfinite(total) or min(values) < 0:
            raise ValueError(f"histogram values must be finite and >= 0, got {values!r}")
        w, floor, log_base, log, inf = (
            self._weights,
            self._floor,
            self._log_base,
            math.log,
            math.inf,
        )
        for value in values:  # add()'s bucket, inlined
            if value <= floor:
                i = 0
            else:
                r = value / floor
                i = int(log(r) / log_base) + 1 if r != inf else self._bucket(value) + 1
            if i >= len(w):
                w.extend([0.0] * (i + 1 - len(w)))
            w[i] += weight
        self.n += weight * len(values)
        self.total += total * weight
        self.min = min(self.min, min(values))
        self.max = max(self.max, max(values))

    def merge(self, other: Histogram) -> None:
        if other._log_base != self._log_base or other._floor != self._floor:
            raise ValueError("cannot merge histograms with different buckets")
        w = self._weights
        if len(other._weights) > len(w):
            w.extend([0.0] * (len(other._weights) - len(w)))
        for i, c in enumerate(other._weights):
            if c:
                w[i] += c
        self.n += other.n
        self.total += other.total
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)

    def _value(self, b: int) -> float:
        if b < 0:
            return self._floor / 2
        x = (b + 0.5) * self._log_base
        if x < 709.0:
            return self._floor * math.exp(x)  # the bucket's midpoint
        y = math.log(self._floor) + x  # (exp(x) alone would overflow)
        return math.exp(y) if y < 709.0 else math.inf

    def quantile(self, q: float) -> float | None:
        """Value at quantile q in [0, 1] (bucket midpoint, clamped to the exact min / max)."""
        if not 0 <= q <= 1:
            raise ValueError(f"quantile must be in [0, 1], got {q!r}")
        if self.n <= 0:
            return None
        if q >= 1.0:
            return self.max
        rank, seen = q * self.n, 0.0
        for b, c in self.counts.items():
            seen += c
            if seen >= rank:
                return min(max(self._value(b), self.min), self.max)
        return self.max

    def fraction_le(self, value: float) -> float:
        """Share of the weight at or below ``value`` (bucket resolution)."""
        if self.n <= 0:
            return 0.0
        lim = self._bucket(value)
        return sum(c for b, c in self.counts.items() if b <= lim) / self.n

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None

    def summary(self, scale: float = 1.0, digits: int = 6) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v * scale, digits)

        return {
            "n": round(self.n),
            "mean": r(self.mean),
            "p50": r(self.quantile(0.5)),
            "p90": r(self.quantile(0.9)),
            "p99": r(self.quantile(0.99)),
            "max": r(self.max if self.n else None),
        }

    def cdf_points(self, max_points: int = 400) -> list[tuple[float, float]]:
        """(value, cumulative share) pairs for plots."""
        if self.n <= 0:
            return []
        counts = self.counts
        step = max(1, len(counts) // max_points)
        out, seen = [], 0.0
        for i, (b, c) in enumerate(counts.items()):
            seen += c
            if i % step == 0 or i == len(counts) - 1:
                out.append((self._value(b), seen / self.n))
        return out


class Series:
    """(time, value) samples at a fixed interval, keeping the max per interval; when the point
    budget is exceeded, neighbours merge (max) and the interval doubles."""

    def __init__(self, interval_s: float = 1.0, max_points: int = 1024) -> None:
        if interval_s <= 0 or max_points < 2:
            raise ValueError("interval_s must be > 0 and max_points >= 2")
        self.interval_s = interval_s
        self.max_points = max_points
        self.values: list[float] = []
        self._level = 0.0  # the last value observed: it holds until the next observation

    def observe(self, t: float, value: float) -> None:
        value = float(value)  # an int count too: the same JSON whether compiled or not
        i = int(t / self.interval_s)
        while i >= self.max_points:
            self._halve()
            i = int(t / self.interval_s)
        if i >= len(self.values):
            self.values.extend([self._level] * (i + 1 - len(self.values)))
            # the level held until now inside this interval too: its max is at least that
            self.values[i] = max(self._level, value)
        elif value > self.values[i]:
            self.values[i] = value
        self._level = value

    def _halve(self) -> None:
        v = self.values
        self.values = [max(v[i : i + 2]) for i in range(0, len(v), 2)]
        self.interval_s *= 2

    def to_dict(self) -> dict[str, Any]:
        return {"interval_s": self.interval_s, "max": list(self.values)}
