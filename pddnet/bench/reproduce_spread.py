"""How far `pdd bench reproduce`'s TTFT ratios move from one draw of its workload to another,
in the simulator.

The live clusters serve one draw of the agent workload (--seed): a few dozen requests, whose
P99 lies between the two slowest. A target stated on that P99 then says as much about the draw
(which turn happens to land on another conversation's cold prefill) as about the system. So
beside the live run the simulator, with the run's own settings and measured host latency,
serves the next --spread-seeds draws (the same generator and scale, other seeds) in every mode,
and the bench prints how the ratios to same-DC spread over them, and how many draws meet each
target, beside this draw's live and simulated ratios. The live figures and the targets' checks
are the live run's alone; this is the context they are read in.
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pddnet.bench.reproduce_sim import simulate_beside, vllm_figures
from pddnet.bench.reproduce_workload import workload_hits
from pddnet.workload.agent import AgentRequest

# draws beside the run's: (--quick's, a full run's); a full run's take ~0.5 s of CPU each
SPREAD_SEEDS = (3, 20)
STATS = ("median", "p90", "p99")


def ratio_name(mode: str, stat: str) -> str:
    """The name a ratio to same-DC goes by (the result's `ttft_p99_ratios` keys' form)."""
    return f"{mode}/same-dc {stat}"


def draw_ratios(ttft_ms: dict[str, dict[str, float | None]]) -> dict[str, float]:
    """Every mode's TTFT statistics (mode -> stat -> ms) over same-DC's, by `ratio_name`;
    a statistic missing on either side is left out."""
    base = ttft_ms.get("same-dc") or {}
    return {
        ratio_name(mode, stat): v / b
        for mode, stats in ttft_ms.items()
        if mode != "same-dc"
        for stat in STATS
        if (v := stats.get(stat)) is not None and (b := base.get(stat))
    }


def this_draw(result: dict[str, Any]) -> tuple[dict[str, float], dict[str, float]]:
    """The run's own ratios to same-DC, live and simulated, from a reproduce result's
    per-mode summaries (`live`: the live side's, `sim`: the simulator's, vLLM's key names)."""

    def ttft(summaries: dict[str, Any]) -> dict[str, dict[str, float | None]]:
        return {m: {st: s.get(f"{st}_ttft_ms") for st in STATS} for m, s in summaries.items()}

    return draw_ratios(ttft(result.get("live") or {})), draw_ratios(ttft(result.get("sim") or {}))


def simulate_draws(
    config: dict[str, Any],
    args: argparse.Namespace,
    systems: dict[str, str],
    seeds: Sequence[int],
    workload: Callable[[argparse.Namespace], list[AgentRequest]],
) -> list[dict[str, Any]]:
    """Each seed's draw of the workload (`workload(args)` with that seed) through the
    simulator's `systems` (same-DC among them) on `config`, the simulator's own seed set alike:
    the draw's warmth (an ideal cache's hits), its TTFT median, P90 and P99 per mode (ms, over
    its requests as the live side takes them) and their ratios to same-DC's."""
    if "same-dc" not in systems:
        raise ValueError("the spread's ratios are to same-DC: it must be among the systems")
    out = []
    for seed in seeds:
        requests = workload(argparse.Namespace(**{**vars(args), "seed": seed}))
        reports = simulate_beside({**config, "seed": seed}, requests, systems)
        ttft: dict[str, dict[str, float | None]] = {}
        for mode, report in reports.items():
            figures = vllm_figures(report)
            ttft[mode] = {stat: figures[f"{stat}_ttft_ms"] for stat in STATS}
        out.append(
            {
                "seed": seed,
                "requests": len(requests),
                "prefix_hit": workload_hits(requests),
                "ttft_ms": ttft,
                "ratios": draw_ratios(ttft),
            }
        )
    return out


def meets(value: float, kind: str, bound: float) -> bool:
    """Whether a ratio meets a target stated as ("max" | "min", bound)."""
    return value <= bound if kind == "max" else value >= bound


def summarise(
    draws: list[dict[str, Any]], bounds: dict[str, tuple[str, float]]
) -> dict[str, dict[str, Any]]:
    """Per ratio over the draws: median, min, max; for a ratio a target bounds (`bounds`: name
    -> ("max" | "min", bound)), how many draws meet it."""
    out: dict[str, dict[str, Any]] = {}
    for name in draws[0]["ratios"] if draws else ():
        values = [d["ratios"][name] for d in draws if name in d["ratios"]]
        if not values:
            continue
        s: dict[str, Any] = {
            "median": statistics.median(values),
            "min": min(values),
            "max": max(values),
            "draws": len(values),
        }
        if name in bounds:
            kind, bound = bounds[name]
            s["target"] = {"kind": kind, "bound": bound}
            s["met"] = sum(meets(v, kind, bound) for v in values)
        out[name] = s
    return out


def spread(
    config: dict[str, Any],
    args: argparse.Namespace,
    systems: dict[str, str],
    bounds: dict[str, tuple[str, float]],
    workload: Callable[[argparse.Namespace], list[AgentRequest]],
) -> dict[str, Any]:
    """The next `args.spread_seeds` draws after the run's seed, simulated, and their summary."""
    seeds = [args.seed + 1 + i for i in range(args.spread_seeds)]
    draws = simulate_draws(config, args, systems, seeds, workload)
    return {"seeds": seeds, "draws": draws, "ratios": summarise(draws, bounds)}


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def spread_notes(run: dict[str, Any]) -> list[str]:
    """The lines under the table (`run`: a reproduce result, its `spread` this module's): per
    targeted ratio its median and range over the draws, how many meet the target, and this
    draw's live and simulated ratio beside them."""
    result = run.get("spread")
    if not result or not result["draws"]:
        return []
    live, sim = this_draw(run)
    seeds, n = result["seeds"], result["draws"][0]["requests"]
    out = [
        f"other draws of the workload (simulator, seeds {seeds[0]}-{seeds[-1]}, {n} requests "
        "each; this run's settings and host latency):"
    ]
    for name, s in result["ratios"].items():
        if "target" not in s:
            continue
        sign = "<=" if s["target"]["kind"] == "max" else ">="
        out.append(
            f"  TTFT {name}: median {_x(s['median'])} ({_x(s['min'])}-{_x(s['max'])}), "
            f"{sign} {s['target']['bound']:g}x in {s['met']} of {s['draws']}; this draw "
            f"live {_x(live.get(name))}, simulated {_x(sim.get(name))}"
        )
    return out


def spread_plot(run: dict[str, Any], path: Path) -> Path | None:
    """One strip per targeted ratio: the draws' values, the target's bound, this draw's live
    and simulated ratio (`run`: a reproduce result)."""
    from pddnet.bench.plots import strip_plot

    result = run.get("spread")
    if not result or not result["draws"]:
        return None
    live, sim = this_draw(run)
    rows = [
        (
            f"TTFT {name}",
            [d["ratios"][name] for d in result["draws"] if name in d["ratios"]],
            {"this draw, live": live.get(name), "this draw, simulated": sim.get(name)},
            s["target"]["bound"],
        )
        for name, s in result["ratios"].items()
        if "target" in s
    ]
    seeds = result["seeds"]
    return strip_plot(
        rows,
        path,
        "ratio to same-DC",
        f"The workload's other draws in the simulator (seeds {seeds[0]}-{seeds[-1]})",
    )
