"""How the simulator's cost grows with requests and with GPUs (wall time, events, memory).

Runs PDD on a DeepSeek-V3-shaped deployment scaled to --gpus (P : RLD : MD GPUs about
45 : 3 : 52, 16-GPU A instances, 8-GPU B instances, the line and the conversation rate scaled
with it) for each --requests size, and prints wall seconds, microseconds per request, events and
peak RSS, then fits how the CPU time grows: the exponent of requests (at the largest GPU count)
and of GPUs (at the largest request count), and extrapolates to 1M requests on 1000 GPUs. The
issue's target: under 5 minutes on 2 cores (one system is one process: one core). Pass
`--requests 1000000 --gpus 1000` to run it for real (tens of minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time

from pddnet.sim.config import parse_config
from pddnet.sim.runner import simulate


def deployment(gpus: int, requests: int, tokens_per_unit: int,
               rate_per_gpu: float = 0.01) -> dict:
    p = max(1, round(gpus * 0.45 / 16))
    r = max(1, round(gpus * 0.03 / 16))
    md = max(1, round(gpus * 0.52 / 8))
    return {
        "seed": 0, "model": "deepseek-v3", "tokens_per_unit": tokens_per_unit,
        "systems": ["pdd"], "chips": {"a": "gpu-a", "b": "gpu-b"},
        "pdd": {"prefill": {"chip": "a", "instances": p, "gpus": 16},
                "relay": {"chip": "a", "instances": r, "gpus": 16},
                "main_decode": {"chip": "b", "instances": md, "gpus": 8}},
        "baseline": {"prefill": {"chip": "a", "instances": p, "gpus": 16},
                     "decode": {"chip": "a", "instances": md, "gpus": 16}},
        "line": {"bw_gbit": max(10, gpus * 0.4), "rtt_ms": 30},
        "policy": {"rld_max_requests": 256},
        "workload": {"requests": requests, "num_conversations": 10_000_000,
                     "conversation_rate_per_s": rate_per_gpu * gpus, "think_time_s": 2.0,
                     "system_prompt_len": [4000, 16000], "task_len": [1000, 4000],
                     "small_tool_len": [64, 1024], "large_tool_len": [8000, 32000],
                     "output_len": [64, 1024], "max_context": 65536},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[5000, 20000])
    ap.add_argument("--gpus", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--tokens-per-unit", type=int, default=512)
    ap.add_argument("--rate-per-gpu", type=float, default=0.01,
                    help="new conversations per second per GPU (keeps the load per GPU fixed)")
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    rows = []
    print(f"{'gpus':>6} {'requests':>9} {'CPU s':>8} {'us/req':>8} {'events':>10} "
          f"{'sim s':>8} {'maxRSS MB':>9} {'TTFT p50':>9} {'RLD share':>9} {'SLA met':>8}")
    for gpus in args.gpus:
        for n in args.requests:
            cfg = parse_config(deployment(gpus, n, args.tokens_per_unit, args.rate_per_gpu))
            bar = (tqdm(total=n, desc=f"{gpus} GPUs", unit="req", leave=False,
                        disable=not sys.stderr.isatty()) if tqdm else None)
            t0 = time.process_time()
            r = simulate(cfg, "pdd", (lambda k, b=bar: b.update(k)) if bar else None)
            wall = time.process_time() - t0
            if bar is not None:
                bar.close()
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            row = {"gpus": sum(r["gpus"].values()), "requests": n, "cpu_s": round(wall, 2),
                   "us_per_request": round(wall / n * 1e6, 1), "events": r["events"],
                   "sim_time_s": r["sim_time_s"], "max_rss_mb": round(rss, 1),
                   "ttft_p50_s": r["ttft_s"]["p50"], "rld_share": r["token_share"]["rld"],
                   "attainment": r["sla"]["attainment"]}
            rows.append(row)
            print(f"{row['gpus']:>6} {n:>9} {wall:8.1f} {row['us_per_request']:8.1f} "
                  f"{r['events']:>10} {r['sim_time_s']:8.0f} {rss:9.1f} "
                  f"{r['ttft_s']['p50']:9.3f} {r['token_share']['rld']:9.1%} "
                  f"{r['sla']['attainment']:8.1%}")
    print(_growth(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _exponent(pairs: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(cpu) against log(size): 1.0 is linear growth."""
    pts = [(math.log(x), math.log(y)) for x, y in pairs if x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return (sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts))


def _growth(rows: list[dict]) -> str:
    top_g = max(r["gpus"] for r in rows)
    top_n = max(r["requests"] for r in rows)
    by_n = [(r["requests"], r["cpu_s"]) for r in rows if r["gpus"] == top_g]
    by_g = [(r["gpus"], r["cpu_s"]) for r in rows if r["requests"] == top_n]
    a, b = _exponent(by_n), _exponent(by_g)
    lines = [f"CPU time grows as requests^{a:.2f} (at {top_g} GPUs)" if a is not None else
             "one request size only: no growth exponent in requests",
             f"CPU time grows as GPUs^{b:.2f} (at {top_n} requests)" if b is not None else
             "one GPU count only: no growth exponent in GPUs"]
    big = max((r for r in rows if r["gpus"] == top_g), key=lambda r: r["requests"])
    exp = a if a is not None else 1.0
    minutes = big["cpu_s"] * (1e6 / big["requests"]) ** exp / 60
    lines.append(f"extrapolated to 1M requests at {top_g} GPUs: {minutes:.1f} min of one core "
                 f"(target: < 5 min)")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
