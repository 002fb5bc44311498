"""The testbed's per-request host path as the simulator's [engine] host latency, fitted from
measured points (sans IO: `pdd bench reproduce` measures, pddnet/bench/reproduce_sim.py
assembles the points).

The host latency has a part per request, paid before P (``fixed + per_token x prompt
tokens``: the client's JSON, the router, the daemons' event loops, the engine's admission), and
a part per engine step (``per_step``: the engine loop's time between two forwards, which the
pacer does not cover; measured apart, from the decode side: pddnet/bench/reproduce_sim.py's
``host_step_latency``). Every prefill chunk pays the per-step part too, so a prompt P computes
in full pays it once per chunk and one mostly cached at P about once: charging it per prompt
token instead overstated the host path of every cached prompt (most of an agent workload's).

A point is one idle request: its prompt length and its host overhead, the live TTFT (modelled
time, wall / k) less what the simulator gives for the same request alone with the per-step
part only. The fit is ``overhead = fixed + per_token x prompt tokens`` by least squares with
both parts kept >= 0 (a host path takes no negative time, and a cost that shrinks with the
prompt is noise): the unconstrained optimum when it is feasible, else the better of the two
boundary fits (through the origin; flat at the mean), each clamped at 0.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pddnet.sim.calibrate_fit import lstsq


@dataclass(frozen=True)
class HostLatency:
    """The host's time in modelled seconds: ``fixed_s + per_token_s x prompt tokens`` per
    request before P, and ``per_step_s`` per engine step."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0
    per_step_s: float = 0.0

    def at(self, prompt_tokens: int) -> float:
        """The per-request part (before P) of a prompt of ``prompt_tokens``."""
        return self.fixed_s + self.per_token_s * prompt_tokens

    def engine_settings(self) -> dict[str, float]:
        """As the simulator's config keys ([engine], microseconds)."""
        return {
            "host_latency_us": self.fixed_s * 1e6,
            "host_latency_per_token_us": self.per_token_s * 1e6,
            "host_latency_per_step_us": self.per_step_s * 1e6,
        }

    def to_dict(self) -> dict[str, float]:
        """For the result JSON: ms, ms per 1K prompt tokens, ms per engine step."""
        return {
            "fixed_ms": self.fixed_s * 1e3,
            "per_1k_tokens_ms": self.per_token_s * 1e6,
            "per_step_ms": self.per_step_s * 1e3,
        }


def _sse(points: Sequence[tuple[int, float]], fixed: float, per_token: float) -> float:
    return sum((y - fixed - per_token * n) ** 2 for n, y in points)


def fit_host_latency(points: Sequence[tuple[int, float]]) -> HostLatency:
    """``points``: (prompt tokens, host overhead in modelled seconds) of idle requests; the
    least-squares fit with both parts >= 0. Needs at least one point; with one prompt length
    only, the per-token part is 0 and the fixed part their mean (clamped)."""
    if not points:
        raise ValueError("fit_host_latency: no points")
    ys = [y for _, y in points]
    flat = HostLatency(max(0.0, sum(ys) / len(ys)), 0.0)
    if len({n for n, _ in points}) < 2:
        return flat
    fixed, per_token = lstsq([[1.0] * len(points), [float(n) for n, _ in points]], ys)
    if fixed >= 0 and per_token >= 0:
        return HostLatency(fixed, per_token)
    through_origin = HostLatency(0.0, max(0.0, lstsq([[float(n) for n, _ in points]], ys)[0]))
    return min((through_origin, flat), key=lambda h: _sse(points, h.fixed_s, h.per_token_s))


def host_latency_from_dict(data: dict[str, Any] | None) -> HostLatency:
    """`HostLatency.to_dict`'s inverse (a result without ``per_step_ms``, from before it was
    measured: 0); None (nothing measured): no host latency."""
    if not data:
        return HostLatency()
    return HostLatency(
        data["fixed_ms"] / 1e3, data["per_1k_tokens_ms"] / 1e6, data.get("per_step_ms", 0.0) / 1e3
    )
