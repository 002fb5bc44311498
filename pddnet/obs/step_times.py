"""Engine step durations as the daemon measured them, for /metrics and for calibration.

Each daemon's engine thread observes every step it ran (`Engine.last_step`): the wall time of
the forward with whatever contention the host had at that moment (on a shared box that is what
a simulator fitted to the daemons must reproduce, not a step timed alone). Pure decode steps are
kept apart from steps that forwarded prefill / extend chunks, and decode steps are also summed
by batch size (power-of-two buckets), so a step-cost model `t(batch)` can be fitted from stats()
alone. Written from the engine thread, read from the event loop: plain ints and floats, so a
reader sees at worst one step's update half applied (harmless for monitoring).
"""

from __future__ import annotations

from typing import Any

from pddnet.engine.engine import StepStats
from pddnet.obs.metrics import LatencyHistogram

STEP_BUCKETS_S = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_EDGES = (1, 2, 4, 8, 16, 32, 64, 128)  # a bucket holds batches in [edge, next edge)


def batch_bucket(batch: int) -> str:
    """The label of the power-of-two bucket a decode batch falls in ("1", "2-3", ..., "128+")."""
    if batch < 1:
        raise ValueError(f"a decode step has at least one sequence, got {batch}")
    for lo, hi in zip(BATCH_EDGES, BATCH_EDGES[1:], strict=False):
        if batch < hi:
            return str(lo) if hi == lo + 1 else f"{lo}-{hi - 1}"
    return f"{BATCH_EDGES[-1]}+"


class StepTimes:
    """`observe(step)` per engine step; `to_stats()` goes into a daemon's stats()."""

    def __init__(self, scale: float = 1.0) -> None:
        # durations are multiplied by this: 1 / dilation on a paced daemon, so that they are
        # the modelled device's seconds (pddnet.device.dilation)
        self.scale = scale
        self.decode = LatencyHistogram(STEP_BUCKETS_S)  # steps of one-token chunks only
        self.prefill = LatencyHistogram(STEP_BUCKETS_S)  # steps with a prefill/extend chunk
        self.prefill_tokens = 0
        self._by_batch: dict[str, list[float]] = {}  # label -> [steps, seconds, seqs]

    def observe(self, step: StepStats) -> None:
        seconds = step.duration_s * self.scale
        if step.num_prefill_tokens:
            self.prefill.observe(seconds)
            self.prefill_tokens += step.num_prefill_tokens
            return
        if not step.num_seqs:
            return
        self.decode.observe(seconds)
        acc = self._by_batch.setdefault(batch_bucket(step.num_seqs), [0, 0.0, 0])
        acc[0] += 1
        acc[1] += seconds
        acc[2] += step.num_seqs

    def to_stats(self) -> dict[str, Any]:
        by_batch = {
            label: {"steps": int(n), "seconds": s, "mean_batch": seqs / n, "mean_ms": s / n * 1e3}
            for label, (n, s, seqs) in sorted(
                self._by_batch.items(), key=lambda kv: int(kv[0].split("-")[0].rstrip("+"))
            )
            if n
        }
        return {
            "histograms": {
                "engine_decode_step_s": self.decode.to_stats(),
                "engine_prefill_step_s": self.prefill.to_stats(),
            },
            "decode_step_ms_by_batch": {k: v["mean_ms"] for k, v in by_batch.items()},
            "engine_steps": {"decode_by_batch": by_batch, "prefill_tokens": self.prefill_tokens},
        }
