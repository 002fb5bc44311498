"""Link effect settings and the random processes behind them (sans-IO, seeded).

One place defines every effect a link direction understands: its name, unit, default and valid
range. `validate_effects` turns a user's partial change (from Python, JSON or the CLI) into checked
values or raises a ValueError that names the effect and what was wrong with it.

Units, everywhere in emulation/: times in milliseconds (`*_ms`), rates in Mbit/s (`*_mbit`,
1 Mbit = 10**6 bits), sizes in bytes (`*_bytes`), probabilities in percent (`*_pct`, 0..100).
Durations and schedule times (not effects) are in seconds.

Jitter follows netem's shape (a distribution table indexed by a uniform draw) but fixes netem's
correlation, which shrinks the variance as correlation grows: here the uniform draw comes from a
Gaussian copula with AR(1) correlation, so every distribution keeps its marginal shape and its
standard deviation whatever the correlation.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_right
from dataclasses import dataclass
from functools import lru_cache
from statistics import NormalDist
from typing import Any

JITTER_DISTRIBUTIONS = ("uniform", "normal", "pareto-normal")


@dataclass(frozen=True)
class EffectSpec:
    name: str
    kind: str  # "float", "int", "bool", "choice", "rate" (float)
    default: Any
    unit: str
    doc: str
    low: float | None = None  # inclusive lower bound
    high: float | None = None  # inclusive upper bound
    low_exclusive: bool = False
    neutral: Any = None  # the value meaning "this effect is off"
    nullable: bool = False  # None is a valid value (meaning: off / unlimited)


EFFECTS: dict[str, EffectSpec] = {
    s.name: s
    for s in [
        EffectSpec(
            "delay_ms",
            "float",
            0.0,
            "ms",
            "one-way propagation delay",
            low=0.0,
            high=600_000.0,
            neutral=0.0,
        ),
        EffectSpec(
            "jitter_ms",
            "float",
            0.0,
            "ms",
            "delay variation: std for normal/pareto-normal, half-width for uniform",
            low=0.0,
            high=600_000.0,
            neutral=0.0,
        ),
        EffectSpec(
            "jitter_dist",
            "choice",
            "normal",
            "",
            "uniform | normal | pareto-normal",
            neutral="normal",
        ),
        EffectSpec(
            "jitter_corr_pct",
            "float",
            0.0,
            "%",
            "correlation of successive jitter draws (AR(1) on a Gaussian copula)",
            low=0.0,
            high=99.9,
            neutral=0.0,
        ),
        EffectSpec(
            "reorder_pct",
            "float",
            0.0,
            "%",
            "share of items exempt from the in-order rule (0: never reorder, 100: netem-like)",
            low=0.0,
            high=100.0,
            neutral=0.0,
        ),
        EffectSpec(
            "rate_mbit",
            "rate",
            None,
            "Mbit/s",
            "bottleneck rate; null = unlimited",
            low=0.0,
            low_exclusive=True,
            high=10_000_000.0,
            neutral=None,
            nullable=True,
        ),
        EffectSpec(
            "burst_bytes",
            "int",
            15_000,
            "bytes",
            "token bucket depth (burst at line rate)",
            low=1,
            high=1 << 40,
            neutral=15_000,
        ),
        EffectSpec(
            "queue_bytes",
            "int",
            1 << 20,
            "bytes",
            "bottleneck queue limit (each class's); arrivals that do not fit are tail-dropped",
            low=1,
            high=1 << 40,
            neutral=1 << 20,
        ),
        EffectSpec(
            "priority_dscp",
            "int",
            None,
            "",
            "items marked with this DSCP (0-63) go ahead of the rest at the bottleneck (strict "
            "priority, as a QoS class on a datacenter interconnect); null = one FIFO for all",
            low=0,
            high=63,
            neutral=None,
            nullable=True,
        ),
        EffectSpec(
            "loss_pct",
            "float",
            0.0,
            "%",
            "independent random loss at ingress",
            low=0.0,
            high=100.0,
            neutral=0.0,
        ),
        EffectSpec(
            "ge_p_pct",
            "float",
            0.0,
            "%",
            "Gilbert-Elliott: per-item chance good -> bad (0 disables the model)",
            low=0.0,
            high=100.0,
            neutral=0.0,
        ),
        EffectSpec(
            "ge_r_pct",
            "float",
            100.0,
            "%",
            "Gilbert-Elliott: per-item chance bad -> good",
            low=0.0,
            high=100.0,
            low_exclusive=True,
            neutral=100.0,
        ),
        EffectSpec(
            "ge_bad_loss_pct",
            "float",
            100.0,
            "%",
            "Gilbert-Elliott: loss in the bad state",
            low=0.0,
            high=100.0,
            neutral=100.0,
        ),
        EffectSpec(
            "ge_good_loss_pct",
            "float",
            0.0,
            "%",
            "Gilbert-Elliott: loss in the good state",
            low=0.0,
            high=100.0,
            neutral=0.0,
        ),
        EffectSpec(
            "duplicate_pct",
            "float",
            0.0,
            "%",
            "chance an item is delivered twice",
            low=0.0,
            high=100.0,
            neutral=0.0,
        ),
        EffectSpec(
            "partition",
            "bool",
            False,
            "",
            "drop everything at ingress (set on both directions)",
            neutral=False,
        ),
        EffectSpec(
            "blackhole",
            "bool",
            False,
            "",
            "drop everything at ingress (this direction only)",
            neutral=False,
        ),
    ]
}

DEFAULT_EFFECTS: dict[str, Any] = {name: spec.default for name, spec in EFFECTS.items()}

# Effects that drop, duplicate or reorder items: a byte-stream shell cannot model these.
LOSSY_EFFECTS = ("loss_pct", "ge_p_pct", "duplicate_pct", "reorder_pct")


def _check_number(spec: EffectSpec, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{spec.name} must be a number ({spec.unit or 'no unit'}), got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{spec.name} must be finite, got {value!r}")
    unit = f" {spec.unit}" if spec.unit else ""
    if spec.low is not None:
        if spec.low_exclusive and value <= spec.low:
            raise ValueError(f"{spec.name} must be > {spec.low:g}{unit}, got {value:g}")
        if not spec.low_exclusive and value < spec.low:
            raise ValueError(f"{spec.name} must be >= {spec.low:g}{unit}, got {value:g}")
    if spec.high is not None and value > spec.high:
        raise ValueError(f"{spec.name} must be <= {spec.high:g}{unit}, got {value:g}")
    return value


def validate_effect(name: str, value: Any) -> Any:
    """One checked, normalised effect value; ValueError naming the effect when it is invalid."""
    spec = EFFECTS.get(name)
    if spec is None:
        raise ValueError(f"unknown effect {name!r} (known: {', '.join(EFFECTS)})")
    if spec.kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be true or false, got {value!r}")
        return value
    if spec.kind == "choice":
        if value not in JITTER_DISTRIBUTIONS:
            raise ValueError(
                f"unknown distribution {value!r} for {name} "
                f"(known: {', '.join(JITTER_DISTRIBUTIONS)})"
            )
        return value
    if spec.nullable and value is None:
        return None
    number = _check_number(spec, value)
    if spec.kind == "int":
        if number != int(number):
            raise ValueError(f"{name} must be a whole number of {spec.unit}, got {value!r}")
        return int(number)
    return number


def validate_effects(changes: dict[str, Any]) -> dict[str, Any]:
    """Check a partial set of effect changes; returns the normalised dict (same keys)."""
    if not isinstance(changes, dict):
        raise ValueError(f"effects must be an object of name: value, got {type(changes).__name__}")
    return {name: validate_effect(name, value) for name, value in changes.items()}


def is_neutral(name: str, value: Any) -> bool:
    return value == EFFECTS[name].neutral


# ---------------------------------------------------------------------------------------------
# Jitter


def implied_jitter_std_ms(jitter_ms: float, dist: str) -> float:
    """Standard deviation of the jitter term the model draws (before clamping at zero delay)."""
    if dist == "uniform":
        return jitter_ms / math.sqrt(3.0)
    if dist in ("normal", "pareto-normal"):
        return jitter_ms
    raise ValueError(f"unknown distribution {dist!r} (known: {', '.join(JITTER_DISTRIBUTIONS)})")


_TABLE_SIZE = 4096
_NORMAL = NormalDist()


@lru_cache(maxsize=1)
def pareto_normal_table() -> tuple[float, ...]:
    """Inverse CDF (4096 quantiles) of netem's pareto-normal mix, scaled to mean 0 and std 1.

    netem's paretonormal table mixes 3/4 normal and 1/4 Pareto (alpha 3). It is built here the
    way netem's maketable builds tables from data: a large fixed-seed sample, sorted, read at
    evenly spaced quantiles. Deterministic: only `random.random()` (stable across Pythons) and
    exact inverse CDFs are used.
    """
    rng = random.Random(0x9E7E)
    n = 1 << 16
    alpha = 3.0
    pareto_mean = alpha / (alpha - 1.0)
    pareto_std = math.sqrt(alpha / ((alpha - 1.0) ** 2 * (alpha - 2.0)))
    samples = []
    for _ in range(n):
        u1 = min(max(rng.random(), 1e-12), 1 - 1e-12)
        u2 = rng.random()
        normal = _NORMAL.inv_cdf(u1)
        pareto = ((1.0 - u2) ** (-1.0 / alpha) - pareto_mean) / pareto_std
        samples.append(0.75 * normal + 0.25 * pareto)
    samples.sort()
    mean = sum(samples) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in samples) / n)
    table = [(samples[int((i + 0.5) * n / _TABLE_SIZE)] - mean) / std for i in range(_TABLE_SIZE)]
    # Re-standardise the table itself so a uniform read of it has exactly mean 0, std 1.
    tmean = sum(table) / _TABLE_SIZE
    tstd = math.sqrt(sum((x - tmean) ** 2 for x in table) / _TABLE_SIZE)
    return tuple((x - tmean) / tstd for x in table)


class JitterSource:
    """Seeded jitter draws in ms for one direction, with correlation that keeps the marginal."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self._z = 0.0  # last latent normal of the AR(1) copula
        self._started = False

    def draw(self, jitter_ms: float, dist: str, corr_pct: float) -> float:
        if jitter_ms <= 0.0:
            return 0.0
        rho = corr_pct / 100.0
        fresh = self._rng.gauss(0.0, 1.0)
        if self._started and rho > 0.0:
            self._z = rho * self._z + math.sqrt(1.0 - rho * rho) * fresh
        else:
            self._z = fresh
        self._started = True
        z = self._z
        if dist == "normal":
            return jitter_ms * z
        u = _NORMAL.cdf(z)
        if dist == "uniform":
            return jitter_ms * (2.0 * u - 1.0)
        if dist == "pareto-normal":
            table = pareto_normal_table()
            pos = u * (_TABLE_SIZE - 1)
            i = int(pos)
            frac = pos - i
            hi = table[min(i + 1, _TABLE_SIZE - 1)]
            return jitter_ms * (table[i] * (1.0 - frac) + hi * frac)
        raise ValueError(
            f"unknown distribution {dist!r} (known: {', '.join(JITTER_DISTRIBUTIONS)})"
        )


# ---------------------------------------------------------------------------------------------
# Loss


class GilbertElliott:
    """Two-state burst loss (netem's `loss gemodel p r 1-h 1-k`), one step per item."""

    def __init__(self, rng: random.Random) -> None:
        self._rng = rng
        self.bad = False

    def drops(self, p_pct: float, r_pct: float, bad_loss_pct: float, good_loss_pct: float) -> bool:
        if p_pct <= 0.0 and not self.bad:
            return False
        if self.bad:
            if self._rng.random() * 100.0 < r_pct:
                self.bad = False
        elif self._rng.random() * 100.0 < p_pct:
            self.bad = True
        loss = bad_loss_pct if self.bad else good_loss_pct
        return self._rng.random() * 100.0 < loss


def bernoulli(rng: random.Random, pct: float) -> bool:
    return pct > 0.0 and rng.random() * 100.0 < pct


# ---------------------------------------------------------------------------------------------
# Delay histogram


# Fixed log-spaced bucket upper edges in ms: four per decade, 10 us .. 100 s, then +Inf.
DELAY_BUCKETS_MS: tuple[float, ...] = tuple(round(10.0 ** (k / 4.0), 6) for k in range(-8, 21))


class DelayHistogram:
    """Histogram of the delay departed items got, plus exact count/min/mean/max."""

    def __init__(self) -> None:
        self.counts = [0] * (len(DELAY_BUCKETS_MS) + 1)
        self.count = 0
        self.total_ms = 0.0
        self.min_ms = math.inf
        self.max_ms = 0.0

    def add(self, delay_ms: float) -> None:
        self.counts[bisect_right(DELAY_BUCKETS_MS, delay_ms - 1e-12)] += 1
        self.count += 1
        self.total_ms += delay_ms
        self.min_ms = min(self.min_ms, delay_ms)
        self.max_ms = max(self.max_ms, delay_ms)

    def to_dict(self) -> dict[str, Any]:
        buckets: list[dict[str, Any]] = [
            {"le_ms": edge, "count": c}
            for edge, c in zip(DELAY_BUCKETS_MS, self.counts[:-1], strict=True)
        ]
        buckets.append({"le_ms": "+Inf", "count": self.counts[-1]})
        return {
            "count": self.count,
            "min_ms": self.min_ms if self.count else None,
            "mean_ms": self.total_ms / self.count if self.count else None,
            "max_ms": self.max_ms if self.count else None,
            "buckets": [b for b in buckets if b["count"]],
        }
