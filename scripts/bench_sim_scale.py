"""How the simulator's cost grows with requests and with GPUs (wall time, events, memory).

Runs PDD on a DeepSeek-V3-shaped deployment scaled to --gpus (P : RLD : MD GPUs about
45 : 3 : 52, 16-GPU A instances, 8-GPU B instances, the line and the conversation rate scaled
with it) for each --requests size, and prints wall seconds, microseconds per request, events and
peak RSS. The issue's target: 1M requests on 1000 GPUs in under 5 minutes on 2 cores; pass
`--requests 1000000 --gpus 1000` to run it (minutes), or extrapolate from smaller sizes.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time

from pddnet.sim.config import parse_config
from pddnet.sim.runner import simulate


def deployment(gpus: int, requests: int, tokens_per_unit: int) -> dict:
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
                     "conversation_rate_per_s": 0.02 * gpus, "think_time_s": 2.0,
                     "system_prompt_len": [4000, 16000], "task_len": [1000, 4000],
                     "small_tool_len": [64, 1024], "large_tool_len": [8000, 32000],
                     "output_len": [64, 1024], "max_context": 65536},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[5000, 20000])
    ap.add_argument("--gpus", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--tokens-per-unit", type=int, default=512)
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    args = ap.parse_args()
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    rows = []
    print(f"{'gpus':>6} {'requests':>9} {'wall s':>8} {'us/req':>8} {'events':>10} "
          f"{'sim s':>8} {'maxRSS MB':>9} {'TTFT p50':>9} {'RLD share':>9}")
    for gpus in args.gpus:
        for n in args.requests:
            cfg = parse_config(deployment(gpus, n, args.tokens_per_unit))
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
                  f"{r['ttft_s']['p50']:9.3f} {r['token_share']['rld']:9.1%}")
    big = max(rows, key=lambda x: (x["gpus"], x["requests"]))
    print(f"extrapolated to 1M requests at {big['gpus']} GPUs: "
          f"{big['us_per_request'] / 60:.1f} min of CPU if linear in requests")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
