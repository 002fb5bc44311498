"""Per-request prefix-cache hit ratios, counted in the source report's seven intervals (MD's
stats, the simulator's report and the DRC benchmark all use these)."""

from __future__ import annotations

# The first interval is closed [0, 20%]; the others are (lo, hi], so the top one is exactly
# "hit more than 95%".
HIT_INTERVAL_EDGES: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0)
HIT_INTERVAL_LABELS: tuple[str, ...] = (
    "0-20%",
    "20-40%",
    "40-60%",
    "60-80%",
    "80-90%",
    "90-95%",
    "95-100%",
)


def hit_interval(ratio: float) -> int:
    """Index (0..6) of the interval a hit ratio in [0, 1] falls in."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"hit ratio must be in [0, 1], got {ratio!r}")
    for i in range(1, len(HIT_INTERVAL_EDGES)):
        if ratio <= HIT_INTERVAL_EDGES[i]:
            return i - 1
    raise AssertionError("unreachable: ratio <= 1.0")
