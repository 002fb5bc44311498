"""`pdd sim reproduce`: the source report's scenario end to end, our figure beside the source's.

1. One agent workload (multi-turn, skewed prefix hits, prompts growing to 64K tokens, outputs up
   to 1K) on a Qwen2.5-7B shape, served by same-DC PD (all chip A), naive cross-DC PD, PDD and
   its ablations, every system offered the baseline's send times: the naive cross-DC TTFT
   blow-up, PDD's TTFT against the baseline, RLD's share of output tokens, the handoff gap.
2. The DRC's bandwidth cut: WAN KV bytes of cross-DC PD without and with the DRC.
3. The cost table: the planner searches both deployments for the best goodput per dollar at the
   same SLA on a grid that contains the source's own pool sizes (full run: 88 A against
   43 A + 32 B), so the table shows both the planner's pick and the like-for-like comparison.

Why this scenario (full run) renders the source's setting:
- *Model*: Qwen2.5-7B's KV is 56 KiB per token, the nearest public shape to the source's
  "~4.6 MB for 100 tokens" (46 KiB), and it fits one A, as the source's odd pool sizes
  (43 A) suggest one GPU per instance.
- *Pools*: the source's counts. It gives totals only, so 43 A is split as 40 P + 3 RLD, and
  the baseline's 88 A as the same 40 P + 48 D (P is then the same pool in every system).
- *Traffic*: agent conversations whose prompts only grow (system prompt + task, then output and
  tool results appended every turn) up to a 64K context, so decode-side hits are skewed as in
  the source (most requests above 95%, first turns and large tool outputs low); 128-token units
  so a turn's small tail is not rounded up to a 512-token unit (which alone halves the share of
  requests above 95%).
- *Load and line*: the conversation rate keeps the baseline's decode pool busy but within SLA,
  and the line (34 Gbit/s) is the scarce resource for naive cross-DC PD: at this load its KV
  keeps the line about two-thirds busy. The source's "~1 GB/s" carries a smaller deployment's
  traffic; what transfers to the blow-up is the line's utilisation, not its absolute rate.
Chip profiles (gpu-a / gpu-b) are assumptions, so our numbers differ from the source's; the
*shapes* are what must hold, ``checks`` says whether they do, and every row of ``table`` says
where and why ours differs.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Callable
from typing import Any, Protocol

from pddnet.sim.config import SimConfig, parse_config
from pddnet.sim.parallel import Task, run_tasks
from pddnet.sim.plan import capacity, plan, with_pools
from pddnet.sim.runner import compare, describe_config, run_systems

SOURCE = {
    "baseline_ttft": "P50 ~4.2 s",
    "naive_cross_dc_ttft": "P50 +2.5 s (4.2 s -> 6.7 s), P90 18.3 s, P99 29.7 s",
    "pdd_ttft": "hidden: near the baseline's",
    "rld_token_share": 0.062,
    "hit_distribution": "~90% average hit, 70-80% of requests above 95%",
    "drc_bandwidth_cut": "up to 10x at ~90% average hit",
    "handoff": "token ids: mean 305 ms, max 321.4 ms (flat); direct incremental KV: mean "
    "185 ms, max 512.6 ms",
    "cost_table": "PDD 43 A + 32 B vs 88 A: 3.5-7.1% cheaper hardware, +27.8% goodput under "
    "SLA, BCR up to +37.5%",
    "pools": {"same-dc": {"gpu-a": 88}, "pdd": {"gpu-a": 43, "gpu-b": 32}},
}

# The cost table is planned on a line this many times the latency scenario's (its price is in
# the cost): the latency scenario loads its line on purpose (that is the naive cross-DC
# blow-up), and a capacity search on that line would find only the line's capacity.
PLAN_LINE_X = 2

# (P, D) of the baseline and (P, RLD, MD) of PDD at the source's GPU counts (full run only).
SOURCE_SIZES = {"same-dc": [40, 48], "pdd": [40, 3, 32]}


class Progress(Protocol):
    """What reproduce() reports while it runs (the CLI draws tqdm bars from it)."""

    def stage(self, name: str, total: int, unit: str) -> None: ...

    def advance(self, n: int = 1, note: str | None = None) -> None: ...


class _Silent:
    def stage(self, name: str, total: int, unit: str) -> None:
        pass

    def advance(self, n: int = 1, note: str | None = None) -> None:
        pass


def _pool(chip: str, n: int) -> dict[str, Any]:
    return {"chip": chip, "instances": n, "gpus": 1}


# The token lengths of the long-context agent workload the large simulations share (the scenario
# here, the scale benchmark, the system tests): system prompts of 4-16k tokens, tasks of 1-4k,
# tool results small or of 8-32k, within a 64k context.
AGENT_LENGTHS: dict[str, Any] = {
    "system_prompt_len": [4000, 16000],
    "task_len": [1000, 4000],
    "small_tool_len": [64, 1024],
    "large_tool_len": [8000, 32000],
    "max_context": 65536,
}


def scenario(quick: bool, seed: int = 0) -> dict[str, Any]:
    """The scenario as a config dict (what `pdd sim run` would read from TOML)."""
    common = {
        "seed": seed,
        "model": "qwen2.5-7b",
        "systems": ["same-dc", "cross-dc", "cross-dc-no-drc", "pdd", "pdd-no-drc"],
        "chips": {"a": "gpu-a", "b": "gpu-b"},
        "engine": {"block_tokens": 16, "chunk_tokens": 8192, "max_seqs": 256},
        "policy": {"rld_max_requests": 256},
        "sla": {"ttft_s": 5.0, "tpot_s": 0.1, "attainment": 0.9},
    }
    agent = {
        "arrivals": "baseline",
        "num_conversations": 100000,
        "think_time_s": 2.0,
        **AGENT_LENGTHS,
        "large_tool_prob": 0.18,
        "output_len": [64, 1024],
        "max_turns": [6, 30],
    }
    if quick:
        # A 16-GPU deployment in a ramp-up window (the first ~110 conversations' turns, the
        # same schedule for every system): seconds of CPU, for the test suite.
        return {
            **common,
            "tokens_per_unit": 512,
            "pdd": {"prefill": _pool("a", 8), "relay": _pool("a", 2), "main_decode": _pool("b", 6)},
            "baseline": {"prefill": _pool("a", 8), "decode": _pool("a", 8)},
            "line": {"bw_gbit": 10, "rtt_ms": 30, "jitter_ms": 1, "price_per_gbit_hour": 0.05},
            "workload": {**agent, "requests": 1200, "conversation_rate_per_s": 1.0},
        }
    p, rld, md = SOURCE_SIZES["pdd"]
    bp, bd = SOURCE_SIZES["same-dc"]
    return {
        **common,
        "tokens_per_unit": 128,
        "pdd": {"prefill": _pool("a", p), "relay": _pool("a", rld), "main_decode": _pool("b", md)},
        "baseline": {"prefill": _pool("a", bp), "decode": _pool("a", bd)},
        "line": {"bw_gbit": 34, "rtt_ms": 30, "jitter_ms": 1, "price_per_gbit_hour": 0.05},
        # 1.8 new conversations/s: ~13 req/s, the baseline's 48 D about 80% busy and
        # within SLA; 10,000 requests are ~12 minutes of simulated traffic, past the
        # first-turn ramp (conversations last 1-5 minutes)
        "workload": {**agent, "requests": 10000, "conversation_rate_per_s": 1.8},
    }


def plan_ranges(quick: bool) -> dict[str, list[list[int]]]:
    """The planner's grid. Full: around 88 A-equivalent GPUs, the source's sizes included."""
    if quick:
        return {"same-dc": [[4], [3, 4]], "pdd": [[4], [1], [2, 3]]}
    return {"same-dc": [[16, 40], [48, 72]], "pdd": [[16, 40], [3], [24, 32]]}


def plan_config(quick: bool, seed: int = 0) -> SimConfig:
    """The cost table's config: the scenario with fewer requests per evaluation (a capacity
    search runs each candidate several times) and a line of PLAN_LINE_X times the bandwidth."""
    sc = scenario(quick, seed)
    return parse_config(
        {
            **sc,
            "workload": {**sc["workload"], "requests": 300 if quick else 3000},
            "line": {**sc["line"], "bw_gbit": sc["line"]["bw_gbit"] * PLAN_LINE_X},
        }
    )


def reproduce(
    quick: bool = False, seed: int = 0, progress: Progress | None = None, jobs: int = 1
) -> dict[str, Any]:
    """The scenario, the planner's cost table and the side-by-side table. With ``jobs`` > 1
    the independent simulations (the systems after the baseline, the two systems' plans) run
    in that many processes; the result is the same."""
    bar: Progress = progress or _Silent()
    cfg: SimConfig = parse_config(scenario(quick, seed))
    bar.stage("scenario", len(cfg.systems) * cfg.workload.requests, "req")

    def ran(system: str, n: int) -> None:
        bar.advance(n, system)

    results = run_systems(cfg, cfg.systems, ran, jobs=jobs)
    vs = compare(results)
    base, naive, pdd = results["same-dc"], results["cross-dc"], results["pdd"]
    full_kv = results["cross-dc-no-drc"]["wan"]["kv_bytes"]
    inc_kv = naive["wan"]["kv_bytes"]
    drc_cut = full_kv / inc_kv if inc_kv else None

    plan_cfg = plan_config(quick, seed)
    ranges = plan_ranges(quick)
    systems = list(ranges)
    bar.stage(
        "plan " + " + ".join(systems),
        sum(math.prod(len(axis) for axis in ranges[s]) for s in systems),
        "candidate",
    )
    tasks = [
        Task(
            plan,
            (plan_cfg, s, ranges[s]),
            {"steps": 2, "warm_start": not quick, "factor": 2.0 if quick else 1.5},
            progress_kw="progress",
        )
        for s in systems
    ]
    plans = dict(zip(systems, run_tasks(tasks, jobs, lambda i, m: bar.advance(1, m)), strict=True))
    cost_table = _cost_table(plans, quick)
    if cost_table["at_source_sizes"] is not None:
        # Which resource binds PDD at the source's sizes: the same search on a line with
        # HEADROOM_X times the planned bandwidth (its price included), nothing else changed.
        bar.stage("line headroom", 1, "candidate")
        cost_table["at_source_sizes"]["line_headroom"] = _headroom(
            plan_cfg, cost_table["at_source_sizes"], lambda m: bar.advance(1, m)
        )
    hi = naive["prefix"]["hit_intervals"]
    ours = {
        "ttft_s": {s: r["ttft_s"] for s, r in results.items()},
        "naive_cross_dc_vs_baseline": vs["cross-dc"],
        "pdd_vs_baseline": vs["pdd"],
        "naive_cross_dc_p50_extra_s": round(naive["ttft_s"]["p50"] - base["ttft_s"]["p50"], 4),
        "rld_token_share": pdd["token_share"]["rld"],
        "decode_side_hit_ratio": naive["prefix"]["decode_side_hit_ratio"],
        "hit_intervals": hi,
        "share_above_95": round(hi["95-100%"] / max(sum(hi.values()), 1), 4),
        "drc_bandwidth_cut": round(drc_cut, 3) if drc_cut else None,
        "handoff_gap_s": pdd["handoff_gap_s"],
        "handoffs": pdd["handoffs"],
        "line_utilisation": {s: r["wan"]["utilisation"] for s, r in results.items() if "wan" in r},
        "cost_table": cost_table,
        "chips": chip_summary(cfg),
    }
    checks = {
        "naive cross-DC P99 TTFT >= 2x baseline": (vs["cross-dc"]["ttft_p99_x"] or 0) >= 2.0,
        "PDD P99 TTFT <= 1.2x baseline": (vs["pdd"]["ttft_p99_x"] or 99) <= 1.2,
        "DRC cuts WAN KV bytes >= 5x": (drc_cut or 0) >= 5.0,
        PLANNER_CHECK: (cost_table["bcr_x"] or 0) > 1.0,
    }
    out = {
        "quick": quick,
        "config": describe_config(cfg),
        "plan_config": {
            "line": describe_config(plan_cfg)["line"],
            "requests": plan_cfg.workload.requests,
            "ranges": ranges,
        },
        "source": SOURCE,
        "ours": ours,
        "checks": checks,
        "systems": results,
    }
    out["table"] = table(out)
    return out


HEADROOM_X = 2


def _headroom(
    plan_cfg: SimConfig, at: dict[str, Any], say: Callable[[str], None]
) -> dict[str, Any]:
    line = dataclasses.replace(plan_cfg.line, bw_gbit=plan_cfg.line.bw_gbit * HEADROOM_X)
    cfg = with_pools(dataclasses.replace(plan_cfg, line=line), "pdd", SOURCE_SIZES["pdd"])
    start = min(max(at["pdd"]["rate_scale"], 0.1), 16.0)
    cap = capacity(cfg, "pdd", steps=2, start=start, factor=1.5)
    run = cap["run"]
    row = {
        "line_gbit": line.bw_gbit,
        "rate_scale": cap["rate_scale"],
        "goodput_rps": cap["goodput_rps"],
        "cost_per_hour": run["cost_per_hour"],
        "bcr": round(cap["goodput_rps"] / run["cost_per_hour"], 8),
        "ttft_p99_s": run["ttft_s"]["p99"],
        "wan_utilisation": run["wan"]["utilisation"],
        "rld_refused": run["rld"]["refused"],
        "busy": run["busy"],
    }
    row.update(_ratios(row, at["baseline"]))
    say(
        f"pdd {SOURCE_SIZES['pdd']} on a {line.bw_gbit:g} Gbit/s line: goodput "
        f"{row['goodput_rps']:.3f} rps, cost {row['cost_per_hour']:.1f}/h"
    )
    return row


def _ratios(p: dict[str, Any], b: dict[str, Any]) -> dict[str, float | None]:
    return {
        "cost_x": round(p["cost_per_hour"] / b["cost_per_hour"], 4),
        "goodput_x": round(p["goodput_rps"] / b["goodput_rps"], 4) if b["goodput_rps"] else None,
        "bcr_x": round(p["bcr"] / b["bcr"], 4) if b["bcr"] else None,
    }


def _cost_table(plans: dict[str, dict[str, Any]], quick: bool) -> dict[str, Any]:
    b, p = plans["same-dc"]["best"], plans["pdd"]["best"]
    out: dict[str, Any] = {
        "baseline": b,
        "pdd": p,
        **_ratios(p, b),
        "plans": {
            s: {"candidates": pl["candidates"], "frontier": pl["frontier"]}
            for s, pl in plans.items()
        },
    }
    # Like for like: the source's own pool sizes, when the grid holds them (full run).
    at = {}
    for s, sizes in SOURCE_SIZES.items():
        at[s] = next((c for c in plans[s]["candidates"] if c["sizes"] == sizes), None)
    if not quick and at["same-dc"] and at["pdd"]:
        out["at_source_sizes"] = {
            "baseline": at["same-dc"],
            "pdd": at["pdd"],
            **_ratios(at["pdd"], at["same-dc"]),
        }
    else:
        out["at_source_sizes"] = None
    return out


def _gpus(g: dict[str, int]) -> str:
    return " + ".join(f"{n} {chip.removeprefix('gpu-').upper()}" for chip, n in g.items())


def _q(x: dict[str, Any]) -> str:
    return f"P50 {x['p50']:.2f} s, P90 {x['p90']:.2f} s, P99 {x['p99']:.2f} s"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{(x - 1) * 100:+.1f}%"


def table(r: dict[str, Any]) -> list[dict[str, str]]:
    """The side-by-side rows: figure, ours, source, whether the source's shape holds, and why
    ours differs (from the run's own measurements)."""
    o, s, sy, ck = r["ours"], r["source"], r["systems"], r["checks"]
    base, naive, pdd = sy["same-dc"], sy["cross-dc"], sy["pdd"]
    cfg = r["config"]
    line = cfg["line"]["bw_gbit"]
    ct = o["cost_table"]
    p_hit = base["prefix"]["p_hit_tokens"] / max(base["prefix"]["prompt_tokens"], 1)
    mean_prompt = base["prefix"]["prompt_tokens"] / max(base["requests"], 1)
    wan = naive["wan"]
    gap = o["handoff_gap_s"]
    yes = {True: "yes", False: "NO"}
    rows = [
        {
            "figure": "baseline TTFT (same-DC)",
            "ours": _q(o["ttft_s"]["same-dc"]),
            "source": s["baseline_ttft"],
            "holds": "-",
            "why": f"our P pool is {base['busy']['prefill']:.0%} busy and P's prefix cache hits "
            f"{p_hit:.0%} of prompt tokens (a 7B on the assumed gpu-a prefills a few K "
            f"uncached tokens in well under a second); a 4.2 s median implies a far busier "
            f"or slower P than ours",
        },
        {
            "figure": "naive cross-DC TTFT",
            "ours": f"{_q(o['ttft_s']['cross-dc'])}; P50 {o['naive_cross_dc_p50_extra_s']:+.2f} s, "
            f"P99 {o['naive_cross_dc_vs_baseline']['ttft_p99_x']}x baseline",
            "source": s["naive_cross_dc_ttft"],
            "holds": f"{yes[ck['naive cross-DC P99 TTFT >= 2x baseline']]} (P99 >= 2x)",
            "why": f"the tail is queueing on the line: {line:g} Gbit/s at "
            f"{wan['utilisation']:.0%} mean utilisation, {wan['kv_bytes_per_request'] / 1e6:.0f}"
            f" MB of incremental KV per request on average but whole 8-32K-token tool "
            f"outputs and first turns in bursts; the size of the tail grows steeply with "
            f"the line's utilisation; our baseline's median TTFT is "
            f"{4.2 / max(base['ttft_s']['p50'] or 0.001, 0.001):.0f}x shorter than the "
            f"source's 4.2 s, so ratios to it come out larger than the source's",
        },
        {
            "figure": "PDD TTFT",
            "ours": f"{_q(o['ttft_s']['pdd'])}; P99 {o['pdd_vs_baseline']['ttft_p99_x']}x baseline",
            "source": s["pdd_ttft"],
            "holds": f"{yes[ck['PDD P99 TTFT <= 1.2x baseline']]} (P99 <= 1.2x)",
            "why": f"RLD emits the first token after an RDMA copy; pipelines "
            f"{pdd['pipelines']}, RLD refused {pdd['rld']['refused']} (those wait for "
            f"the line)",
        },
        {
            "figure": "RLD share of output tokens",
            "ours": f"{o['rld_token_share']:.1%}",
            "source": f"{s['rld_token_share']:.1%} (64K in / 1K out)",
            "holds": f"{yes[0 < o['rld_token_share'] < 0.2]} (small, MD the rest)",
            "why": f"RLD decodes while the KV crosses, so its share is the transfer wait over "
            f"the decode time: ours is agent traffic (mean prompt {mean_prompt / 1e3:.0f}K "
            f"tokens, outputs 64-1024, {pdd['prefix']['decode_side_hit_ratio']:.0%} "
            f"decode-side hit) on a line at {pdd['wan']['utilisation']:.0%}, "
            f"not one fixed 64K/1K shape",
        },
        {
            "figure": "decode-side hit distribution",
            "ours": f"{o['decode_side_hit_ratio']:.0%} token hit, {o['share_above_95']:.0%} of "
            f"requests above 95%",
            "source": s["hit_distribution"],
            "holds": "-",
            "why": f"the seeded agent generator in {cfg['tokens_per_unit']}-token units (a "
            f"request's last unit never hits; first turns and large tool outputs are the "
            f"low intervals)",
        },
        {
            "figure": "DRC bandwidth cut",
            "ours": f"{o['drc_bandwidth_cut']}x at {o['decode_side_hit_ratio']:.0%} token hit on MD",
            "source": s["drc_bandwidth_cut"],
            "holds": f"{yes[ck['DRC cuts WAN KV bytes >= 5x']]} (>= 5x)",
            "why": "the cut is about 1 / (1 - hit) over the whole run; the source's 10x is its "
            "best case",
        },
        {
            "figure": "handoff gap (user-visible)",
            "ours": f"P50 {(gap['p50'] or 0) * 1e3:.0f} ms, P99 {(gap['p99'] or 0) * 1e3:.0f} ms, "
            f"max {(gap['max'] or 0) * 1e3:.0f} ms ({o['handoffs']})",
            "source": s["handoff"],
            "holds": "-",
            "why": "ours is the rest of the RLD step TAKEOVER lands in, the HANDOFF's crossing "
            "and MD's first token's way back (one RTT) and one extend step; the source's "
            "includes its engine's own overheads",
        },
    ]
    b, p = ct["baseline"], ct["pdd"]
    rows.append(
        {
            "figure": "cost table: planner's best BCR",
            "ours": f"PDD {_gpus(p['gpus'])} vs {_gpus(b['gpus'])}: cost {_pct(ct['cost_x'])}, "
            f"goodput {_pct(ct['goodput_x'])}, BCR {_pct(ct['bcr_x'])}",
            "source": s["cost_table"],
            "holds": f"{yes[ck[PLANNER_CHECK]]} (BCR > 1)",
            "why": _cost_why(r),
        }
    )
    at = ct.get("at_source_sizes")
    if at:
        rows.append(
            {
                "figure": "cost table at the source's sizes",
                "ours": f"PDD {_gpus(at['pdd']['gpus'])} vs {_gpus(at['baseline']['gpus'])}: cost "
                f"{_pct(at['cost_x'])}, goodput {_pct(at['goodput_x'])}, "
                f"BCR {_pct(at['bcr_x'])}",
                "source": "43 A + 32 B vs 88 A: -3.5..-7.1% cost, +27.8% goodput, BCR +37.5%",
                "holds": f"{yes[(at['bcr_x'] or 0) > 1 and at['cost_x'] < 1]} (cheaper, BCR > 1)",
                "why": _at_source_why(r, at),
            }
        )
        h = at.get("line_headroom")
        if h:
            rows.append(
                {
                    "figure": f"... on a {h['line_gbit']:g} Gbit/s line (headroom)",
                    "ours": f"PDD {_gpus(at['pdd']['gpus'])} vs {_gpus(at['baseline']['gpus'])}: "
                    f"cost {_pct(h['cost_x'])}, goodput {_pct(h['goodput_x'])}, "
                    f"BCR {_pct(h['bcr_x'])}",
                    "source": "(the source's line is not given at this load)",
                    "holds": f"{yes[(h['bcr_x'] or 0) > 1 and h['cost_x'] < 1]} (cheaper, BCR > 1)",
                    "why": f"only the line differs from the row above ({HEADROOM_X}x the bandwidth, "
                    f"its price included): line {h['wan_utilisation']:.0%} busy, RLD refused "
                    f"{h['rld_refused']}, P99 TTFT {h['ttft_p99_s']:.1f} s, pools busy "
                    f"{h['busy']}",
                }
            )
    return rows


PLANNER_CHECK = "planner's PDD mix has BCR > 1 vs baseline"


def _at_source_why(r: dict[str, Any], at: dict[str, Any]) -> str:
    """What binds PDD's capacity at the source's sizes, from the planner's own runs."""
    b, p = at["baseline"], at["pdd"]
    line = r["plan_config"]["line"]
    text = (
        f"the source's own GPU counts, so the cost differs only by our prices and the "
        f"line's ({line['bw_gbit'] * line['price_per_gbit_hour']:.1f} $/h); at capacity "
        f"the baseline's P99 TTFT is {b['ttft_p99_s']:.1f} s, PDD's {p['ttft_p99_s']:.1f} s"
    )
    util = p.get("wan_utilisation")
    if util is not None:
        text += (
            f" with the {line['bw_gbit']:g} Gbit/s line {util:.0%} busy and RLD refusing "
            f"{p['rld_refused']} requests"
        )
    return text


def _cost_why(r: dict[str, Any]) -> str:
    ct = r["ours"]["cost_table"]
    b, p = ct["baseline"], ct["pdd"]
    line = r["plan_config"]["line"]
    line_cost = line["bw_gbit"] * line["price_per_gbit_hour"]
    chips = r["ours"]["chips"]
    a, bb = chips.get("gpu-a"), chips.get("gpu-b")
    edge = ""
    if a and bb:
        edge = (
            f"; our gpu-b is assumed to have {bb['memory_bw_gbs'] / a['memory_bw_gbs']:.1f}x "
            f"gpu-a's memory bandwidth and {bb['memory_gb'] / a['memory_gb']:.2f}x its "
            f"memory at {bb['price_per_hour'] / a['price_per_hour']:.2f}x the price, so "
            f"few B replace many A in decode"
        )
    return (
        f"planned on a {line['bw_gbit']:g} Gbit/s line ({line_cost:.1f} $/h of PDD's "
        f"{p['cost_per_hour']:.1f} $/h) with {p['sizes'][1]} RLD GPU(s); at the source's "
        f"GPU counts our prices give {_pct(source_price_ratio(chips))} hardware cost (the "
        f"source: -3.5..-7.1%), so the prices are in line with the source's; the planner "
        f"picks its own sizes (P {b['sizes'][0]} / {p['sizes'][0]}, D {b['sizes'][1]} vs MD "
        f"{p['sizes'][2]}){edge}"
    )


def source_price_ratio(chips: dict[str, dict[str, Any]]) -> float | None:
    """Hardware cost of the source's 43 A + 32 B over its 88 A at OUR chip prices."""
    try:
        cost = {
            s: sum(chips[c]["price_per_hour"] * n for c, n in g.items())
            for s, g in SOURCE["pools"].items()
        }
    except KeyError:
        return None
    return cost["pdd"] / cost["same-dc"]


def chip_summary(cfg: SimConfig) -> dict[str, dict[str, Any]]:
    out = {}
    for d in (cfg.pdd, cfg.baseline):
        for pool in d.pools().values():
            c = pool.chip
            out[c.name] = {
                "price_per_hour": c.price_per_hour,
                "memory_gb": c.memory_gb,
                "memory_bw_gbs": c.memory_bw_gbs,
                "tflops": dict(c.tflops),
            }
    return dict(sorted(out.items()))


def print_report(r: dict[str, Any]) -> None:
    """The side-by-side table (ours | source | shape holds?), then why each row differs."""
    widths = (26, 50, 44, 22)
    heads = ("figure", "ours", "source", "shape holds?")

    def line(cells: tuple[str, ...]) -> None:
        wrapped = [textwrap.wrap(c, w) or [""] for c, w in zip(cells, widths, strict=True)]
        for i in range(max(len(w) for w in wrapped)):
            print(
                " | ".join(
                    (w[i] if i < len(w) else "").ljust(n)
                    for w, n in zip(wrapped, widths, strict=True)
                ).rstrip()
            )

    print()
    line(heads)
    print("-+-".join("-" * n for n in widths))
    for row in r["table"]:
        line((row["figure"], row["ours"], row["source"], row["holds"]))
        print("-+-".join("-" * n for n in widths))
    print("\nwhere and why ours differs:")
    for row in r["table"]:
        print(
            textwrap.fill(
                f"{row['figure']}: {row['why']}", 110, initial_indent="- ", subsequent_indent="  "
            )
        )
    print("\nchecks (the source's shapes):")
    for k, v in r["checks"].items():
        print(f"  [{'ok' if v else 'FAIL'}] {k}")
