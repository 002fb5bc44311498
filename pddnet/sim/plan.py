"""The planner: search pool sizes for the best benefit-cost ratio (BCR) at a given SLA.

For every candidate deployment it finds the *capacity*: the largest arrival rate (as a multiple
of the workload's own rate) at which at least ``sla.attainment`` of the requests meet both the
TTFT and the TPOT bound, by stepping up or down by ``factor`` from ``start`` until the bound is
bracketed and then bisecting. Neighbouring candidates of a grid have similar capacities, so
``plan(warm_start=True)`` starts each search at the previous candidate's capacity with a finer
step: fewer simulations per candidate at the same resolution (a simulation at a datacenter-sized
load costs tens of seconds). Goodput under SLA is that
rate times the attainment; BCR is goodput per dollar-hour. The frontier is the set of candidates
no other candidate beats on both cost and goodput.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from typing import Any

from pddnet.sim.config import Deployment, Pool, SimConfig
from pddnet.sim.runner import simulate


def capacity(
    cfg: SimConfig,
    system: str,
    lo: float = 0.1,
    hi: float = 16.0,
    steps: int = 3,
    start: float = 1.0,
    factor: float = 2.0,
) -> dict[str, Any]:
    """Largest rate_scale meeting the SLA attainment (and the run at that scale); the answer
    is within ``factor ** (1 / 2 ** steps)`` of the true one."""
    if factor <= 1.0:
        raise ValueError(f"factor must be > 1, got {factor!r}")
    if not lo <= start <= hi:
        raise ValueError(f"start {start!r} outside [{lo!r}, {hi!r}]")
    target = cfg.sla.attainment
    cache: dict[float, dict[str, Any]] = {}

    def run(scale: float) -> dict[str, Any]:
        # Conversations start `scale` times as often and the request budget grows with it, so
        # the run covers the same stretch of time at a `scale` times higher load (a closed-loop
        # agent workload with a fixed budget would otherwise only end sooner).
        if scale not in cache:
            c = cfg.with_rate(scale)
            c = dataclasses.replace(
                c,
                workload=dataclasses.replace(
                    c.workload, requests=max(1, round(cfg.workload.requests * scale))
                ),
            )
            cache[scale] = simulate(c, system)
        return cache[scale]

    def ok(scale: float) -> bool:
        r = run(scale)
        return r["unfinished"] == 0 and r["sla"]["attainment"] >= target

    scale = round(start, 6)
    if ok(scale):
        good, bad = scale, None
        while bad is None and good * factor <= hi:
            if ok(good * factor):
                good *= factor
            else:
                bad = good * factor
    else:
        good, bad = None, scale
        while good is None and bad / factor >= lo:
            if ok(bad / factor):
                good = bad / factor
            else:
                bad /= factor
    if good is None:
        return {"rate_scale": 0.0, "goodput_rps": 0.0, "run": run(lo if lo in cache else bad)}
    if bad is not None:
        for _ in range(steps):
            mid = (good * bad) ** 0.5
            if ok(mid):
                good = mid
            else:
                bad = mid
    r = run(good)
    return {"rate_scale": round(good, 4), "goodput_rps": round(r["goodput_rps"], 6), "run": r}


def with_pools(cfg: SimConfig, system: str, sizes: Sequence[int]) -> SimConfig:
    """The config with the system's pools resized: (P, RLD, MD) for PDD, (P, D) for baseline."""

    def pool(p: Pool, n: int) -> Pool:
        return dataclasses.replace(p, instances=n)

    if system == "same-dc":
        d = cfg.baseline
        return dataclasses.replace(
            cfg, baseline=Deployment(pool(d.prefill, sizes[0]), pool(d.decode, sizes[1]))
        )
    d = cfg.pdd
    relay = pool(d.relay, sizes[1]) if d.relay is not None else None
    return dataclasses.replace(
        cfg, pdd=Deployment(pool(d.prefill, sizes[0]), pool(d.decode, sizes[2]), relay)
    )


def plan(
    cfg: SimConfig,
    system: str,
    ranges: Sequence[Sequence[int]],
    progress: Callable[[str], None] | None = None,
    steps: int = 3,
    warm_start: bool = False,
    factor: float = 2.0,
) -> dict[str, Any]:
    """Evaluate every combination of pool sizes in ``ranges``; returns candidates (cost,
    goodput, BCR), the frontier and the best-BCR candidate. With ``warm_start`` each
    capacity search starts at the previous candidate's capacity (see the module docstring)."""
    want = 2 if system == "same-dc" else 3
    if len(ranges) != want:
        names = "P, D" if want == 2 else "P, RLD, MD"
        raise ValueError(f"{system}: give {want} ranges of pool sizes ({names})")
    candidates = []
    start = 1.0
    for sizes in itertools.product(*ranges):
        c = with_pools(cfg, system, sizes)
        cap = capacity(c, system, steps=steps, start=start, factor=factor)
        if warm_start and cap["rate_scale"] > 0:
            start = min(max(cap["rate_scale"], 0.1), 16.0)
        run = cap["run"]
        cost = run["cost_per_hour"]
        row = {
            "sizes": list(sizes),
            "gpus": run["gpus"],
            "cost_per_hour": cost,
            "rate_scale": cap["rate_scale"],
            "goodput_rps": cap["goodput_rps"],
            "bcr": round(cap["goodput_rps"] / cost, 8) if cost else 0.0,
            "ttft_p99_s": run["ttft_s"]["p99"],
            "tpot_p50_s": run["tpot_s"]["p50"],
            # what binds at capacity: the line, RLD or the pools
            "wan_utilisation": run["wan"]["utilisation"] if "wan" in run else None,
            "rld_refused": run["rld"]["refused"],
            "busy": run["busy"],
        }
        candidates.append(row)
        if progress is not None:
            progress(
                f"{system} {sizes}: goodput {row['goodput_rps']:.3f} rps, "
                f"cost {cost:.1f}/h, BCR {row['bcr']:.5f}"
            )
    frontier = [
        r
        for r in candidates
        if not any(
            o is not r
            and o["cost_per_hour"] <= r["cost_per_hour"]
            and o["goodput_rps"] >= r["goodput_rps"]
            and (o["cost_per_hour"], -o["goodput_rps"]) != (r["cost_per_hour"], -r["goodput_rps"])
            for o in candidates
        )
    ]
    frontier.sort(key=lambda r: r["cost_per_hour"])
    best = max(candidates, key=lambda r: (r["bcr"], -r["cost_per_hour"]))
    return {"system": system, "candidates": candidates, "frontier": frontier, "best": best}


def parse_range(text: str) -> list[int]:
    """'2-6' or '2,4,8' or '3' -> a list of pool sizes (>= 1)."""
    try:
        if "-" in text:
            a, b = (int(x) for x in text.split("-", 1))
            out = list(range(a, b + 1))
        else:
            out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"bad pool size range {text!r}: use N, A-B or A,B,C") from None
    if not out or min(out) < 1:
        raise ValueError(f"bad pool size range {text!r}: sizes must be >= 1")
    return out
