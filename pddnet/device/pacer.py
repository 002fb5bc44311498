"""A modelled accelerator's clock for one engine: how long each forward must last, sans-IO.

The engine runs the real small model, so tokens and KV are real; what it does not have is the
target accelerator's speed. After each forward the pacer is told the forward's shape (one
``(start, end)`` chunk of positions per sequence: a prefill chunk, an extend, a decode token
``(p, p + 1)``) and when the real compute started and ended; it answers how long to wait so
that the forward ends ``dilation x`` the roofline time of that forward of the target model on
the chip after it started (``pddnet.device.cost``, the simulator's cost function).

When the real compute alone took longer than that, the step **overran**: nothing can be waited
back, the device ran slow. Overruns are counted, with the time lost, and never hidden: a run
whose overrun share is above ``VALID_OVERRUN_SHARE`` is not a valid measurement of the modelled
device, and ``dilation_needed`` says which k would have made it one (each step's real time over
its undilated modelled time is the k at which that step would just not overrun).

No clock of its own: times are passed in (``time.perf_counter`` in the engine worker, a fake
clock in tests).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from pddnet.device.cost import InstanceCost

VALID_OVERRUN_SHARE = 0.01  # above this share of overrun steps a run's times are not valid
RATIO_SAMPLES = 4096  # recent steps kept to say which dilation would have been enough


class StepPacer:
    """Paces one engine's forwards to ``cost`` (the target model on the role's chip) x k."""

    def __init__(self, cost: InstanceCost, dilation: float = 1.0) -> None:
        if (
            isinstance(dilation, bool)
            or not isinstance(dilation, (int, float))
            or not 1 <= dilation < math.inf
        ):
            raise ValueError(f"dilation must be a number >= 1, got {dilation!r}")
        self.cost = cost
        self.dilation = float(dilation)
        self.steps = 0
        self.overruns = 0
        self.modelled_s = 0.0  # undilated modelled time of every step: the device's busy time
        self.real_s = 0.0  # wall time the real compute took
        self.waited_s = 0.0  # wall time spent waiting out the model
        self.lost_s = 0.0  # wall time by which overrun steps exceeded their paced time
        self.worst_ratio = 0.0
        self._ratios: deque[float] = deque(maxlen=RATIO_SAMPLES)

    def modelled(self, chunks: Sequence[tuple[int, int]]) -> float:
        """Undilated seconds of one forward over these chunks on the modelled device."""
        return self.cost.prefill_step_time(list(chunks))

    def pace(self, chunks: Sequence[tuple[int, int]], started: float, ended: float) -> float:
        """Account one forward that computed from ``started`` to ``ended`` (wall seconds);
        return the seconds still to wait so it lasts k x its modelled time (0 on an overrun)."""
        if ended < started:
            raise ValueError(f"a forward cannot end ({ended}) before it starts ({started})")
        model = self.modelled(chunks)
        real = ended - started
        target = model * self.dilation
        self.steps += 1
        self.modelled_s += model
        self.real_s += real
        ratio = real / model if model > 0 else math.inf
        self._ratios.append(ratio)
        self.worst_ratio = max(self.worst_ratio, ratio)
        if real > target:
            self.overruns += 1
            self.lost_s += real - target
            return 0.0
        self.waited_s += target - real
        return target - real

    @property
    def overrun_share(self) -> float:
        return self.overruns / self.steps if self.steps else 0.0

    @property
    def valid(self) -> bool:
        return self.overrun_share <= VALID_OVERRUN_SHARE

    def dilation_needed(self) -> float:
        """The smallest k at which at most VALID_OVERRUN_SHARE of the recent steps would have
        overrun (at least 1; rounded up to a tenth)."""
        return dilation_for(list(self._ratios))

    def to_stats(self) -> dict[str, float | int | bool]:
        return {
            "steps": self.steps,
            "overruns": self.overruns,
            "overrun_share": round(self.overrun_share, 6),
            "valid": self.valid,
            "overrun_lost_s": round(self.lost_s, 6),
            "modelled_busy_s": round(self.modelled_s, 6),
            "real_compute_s": round(self.real_s, 6),
            "waited_s": round(self.waited_s, 6),
            "worst_ratio": round(self.worst_ratio, 3),
            "dilation": self.dilation,
            "dilation_needed": self.dilation_needed(),
        }


def dilation_for(ratios: Sequence[float], share: float = VALID_OVERRUN_SHARE) -> float:
    """The smallest k (>= 1, rounded up to a tenth) for which at most ``share`` of the steps
    whose real/modelled ``ratios`` are given would overrun."""
    k = ratio_within(ratios, share)
    if not math.isfinite(k):
        return math.inf
    return max(1.0, math.ceil(k * 10 - 1e-9) / 10)


def ratio_within(ratios: Sequence[float], share: float) -> float:
    """The smallest ratio that at most ``share`` of ``ratios`` exceed (unrounded; 0 without
    ratios): the k at which at most that share of these steps would overrun."""
    if not ratios:
        return 0.0
    xs = sorted(ratios)
    allowed = min(math.floor(share * len(xs)), len(xs) - 1)  # steps that may still overrun
    return xs[len(xs) - 1 - allowed]
