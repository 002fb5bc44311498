"""How the simulator's cost grows with requests and with GPUs (CPU time, events, memory).

Runs PDD on a DeepSeek-V3-shaped deployment scaled to --gpus (P : RLD : MD GPUs about
55 : 3 : 42, 16-GPU A instances, 8-GPU B instances, the line and the conversation rate scaled
with it) for each --requests size, each point in a fresh process (so its peak RSS is its own),
and prints CPU seconds, microseconds per request, events, peak RSS and the load average of the
(shared) machine, then fits how the CPU time grows: the exponent of requests (at the largest
GPU count) and of GPUs (at the largest request count), and extrapolates to 1M requests on 1000
GPUs. The issue's target: under 5 minutes on this 2-core machine (one system is one process:
one core). Pass `--requests 1000000 --gpus 1000` to run it for real.

`--mode both` (the default) runs every point twice, pure Python and compiled with mypyc
(pddnet/sim/compiled.py, built once), back to back, and prints the speed-up measured side by
side; `--mode compiled` or `--mode pure` runs one of them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

try:
    import pddnet  # noqa: F401
except ImportError:  # run from a checkout: the repository root holds the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pddnet.sim import compiled
from pddnet.sim.config import parse_config
from pddnet.sim.reproduce import AGENT_LENGTHS
from pddnet.sim.runner import simulate

MODES = ("pure", "compiled")


def deployment(gpus: int, requests: int, tokens_per_unit: int, rate_per_gpu: float = 0.01) -> dict:
    # P's share sized (session 5) so that P stays below ~85% busy at 100K requests on 1000 GPUs
    # with the cost model's one-direction all-reduce: at 45% it was 93% busy and missed the SLA
    p = max(1, round(gpus * 0.55 / 16))
    r = max(1, round(gpus * 0.03 / 16))
    md = max(1, round((gpus - 16 * (p + r)) / 8))  # MD: the rest (so 1000 means 1000)
    return {
        "seed": 0,
        "model": "deepseek-v3",
        "tokens_per_unit": tokens_per_unit,
        "systems": ["pdd"],
        "chips": {"a": "gpu-a", "b": "gpu-b"},
        "pdd": {
            "prefill": {"chip": "a", "instances": p, "gpus": 16},
            "relay": {"chip": "a", "instances": r, "gpus": 16},
            "main_decode": {"chip": "b", "instances": md, "gpus": 8},
        },
        "baseline": {
            "prefill": {"chip": "a", "instances": p, "gpus": 16},
            "decode": {"chip": "a", "instances": md, "gpus": 16},
        },
        "line": {"bw_gbit": max(10, gpus * 0.4), "rtt_ms": 30},
        "policy": {"rld_max_requests": 256},
        "workload": {
            "requests": requests,
            "num_conversations": 10_000_000,
            "conversation_rate_per_s": rate_per_gpu * gpus,
            "think_time_s": 2.0,
            **AGENT_LENGTHS,
            "output_len": [64, 1024],
        },
    }


def run_point(
    gpus: int, requests: int, tokens_per_unit: int, rate_per_gpu: float, progress: bool = False
) -> dict:
    """One simulation in this process; the row of the table."""
    cfg = parse_config(deployment(gpus, requests, tokens_per_unit, rate_per_gpu))
    bar = None
    if progress and sys.stderr.isatty():
        try:
            from tqdm import tqdm

            bar = tqdm(total=requests, desc=f"{gpus} GPUs", unit="req", leave=False)
        except ImportError:  # pragma: no cover
            bar = None
    load0 = os.getloadavg()[0]
    t0, w0 = time.process_time(), time.perf_counter()
    r = simulate(cfg, "pdd", bar.update if bar is not None else None)
    cpu, wall = time.process_time() - t0, time.perf_counter() - w0
    if bar is not None:
        bar.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "gpus": sum(r["gpus"].values()),
        "requests": requests,
        "cpu_s": round(cpu, 2),
        "wall_s": round(wall, 2),
        "us_per_request": round(cpu / requests * 1e6, 1),
        "events": r["events"],
        "events_per_request": round(r["events"] / requests, 2),
        "sim_time_s": r["sim_time_s"],
        "max_rss_mb": round(rss, 1),
        "load_before": round(load0, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "ttft_p50_s": r["ttft_s"]["p50"],
        "rld_share": r["token_share"]["rld"],
        "attainment": r["sla"]["attainment"],
        "mode": "compiled" if compiled.compiled_modules() else "pure",
        "result_digest": _digest(r),
    }


def _digest(result: dict) -> str:
    """Names a result: the pure and the compiled run of a point must give the same one."""
    import hashlib

    from pddnet.sim.cli import dumps

    return hashlib.sha256(dumps(result).encode()).hexdigest()[:12]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, nargs="+", default=[5000, 20000])
    ap.add_argument("--gpus", type=int, nargs="+", default=[250, 1000])
    ap.add_argument("--tokens-per-unit", type=int, default=512)
    ap.add_argument(
        "--rate-per-gpu",
        type=float,
        default=0.01,
        help="new conversations per second per GPU (keeps the load per GPU fixed)",
    )
    ap.add_argument(
        "--mode",
        choices=["both", *MODES],
        default="both",
        help="pure Python, compiled with mypyc, or both side by side (default)",
    )
    ap.add_argument("--out", default=None, help="write the table as JSON here")
    ap.add_argument(
        "--in-process",
        action="store_true",
        help="run every point in this process (peak RSS is then cumulative)",
    )
    ap.add_argument(
        "--point", nargs=2, type=int, metavar=("GPUS", "REQUESTS"), help=argparse.SUPPRESS
    )  # internal: one point, its row as JSON
    args = ap.parse_args()
    if args.point:
        row = run_point(*args.point, args.tokens_per_unit, args.rate_per_gpu, progress=True)
        print(json.dumps(row))
        return 0
    modes = MODES if args.mode == "both" else (args.mode,)
    if args.in_process and modes != (("compiled",) if compiled.compiled_modules() else ("pure",)):
        ap.error(
            "--in-process runs this process's mode only: pass --mode pure (or run this "
            "script from the compiled copy with --mode compiled)"
        )
    tree = None
    if "compiled" in modes and not args.in_process:
        try:
            tree = compiled.build(log=lambda s: print(s, flush=True))
        except compiled.CompileError as exc:
            print(exc, file=sys.stderr)
            return 1
    rows = []
    print(
        f"machine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} at start; "
        f"each point is one single-threaded simulation in a fresh process"
    )
    print(
        f"{'mode':>8} {'gpus':>6} {'requests':>9} {'CPU s':>8} {'us/req':>8} {'events':>10} "
        f"{'ev/req':>6} {'sim s':>8} {'peakRSS MB':>10} {'load':>9} {'TTFT p50':>9} "
        f"{'RLD share':>9} {'SLA met':>8}",
        flush=True,
    )
    for gpus in args.gpus:
        for n in args.requests:
            point = {}
            for mode in modes:
                if args.in_process:
                    row = run_point(gpus, n, args.tokens_per_unit, args.rate_per_gpu, True)
                else:
                    row = _child(
                        gpus,
                        n,
                        args.tokens_per_unit,
                        args.rate_per_gpu,
                        tree if mode == "compiled" else None,
                    )
                if row["mode"] != mode:
                    raise RuntimeError(f"asked for a {mode} run, the child ran {row['mode']}")
                rows.append(row)
                point[mode] = row
                print(
                    f"{mode:>8} {row['gpus']:>6} {n:>9} {row['cpu_s']:8.1f} "
                    f"{row['us_per_request']:8.1f} {row['events']:>10} "
                    f"{row['events_per_request']:6.1f} {row['sim_time_s']:8.0f} "
                    f"{row['max_rss_mb']:10.1f} "
                    f"{row['load_before']:4.1f}-{row['load_after']:<4.1f} "
                    f"{row['ttft_p50_s']:9.3f} {row['rld_share']:9.1%} "
                    f"{row['attainment']:8.1%}",
                    flush=True,
                )
            if len(point) == 2:
                same = point["pure"]["result_digest"] == point["compiled"]["result_digest"]
                print(
                    f"{'':>8} compiled is {point['pure']['cpu_s'] / point['compiled']['cpu_s']:.2f}x "
                    f"faster; results {'identical' if same else 'DIFFER'}",
                    flush=True,
                )
                if not same:
                    raise RuntimeError(
                        "the compiled simulator's result differs from the pure "
                        "one's: a bug (tests/test_sim_compiled.py)"
                    )
    for mode in modes:
        print(f"{mode}:")
        print(_growth([r for r in rows if r["mode"] == mode]))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def _child(
    gpus: int, requests: int, tokens_per_unit: int, rate_per_gpu: float, tree: Path | None = None
) -> dict:
    """One point in a fresh interpreter: its own peak RSS, no heap left by the previous.
    ``tree``: the compiled copy to run it on (None: the pure package of this checkout)."""
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--point",
        str(gpus),
        str(requests),
        "--tokens-per-unit",
        str(tokens_per_unit),
        "--rate-per-gpu",
        str(rate_per_gpu),
    ]
    if tree is not None:
        env = compiled.compiled_env(tree)
    else:
        env = dict(os.environ)
        env.pop(compiled.TREE_ENV, None)
        root = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    out = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, check=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _exponent(pairs: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of log(cpu) against log(size): 1.0 is linear growth."""
    pts = [(math.log(x), math.log(y)) for x, y in pairs if x > 0 and y > 0]
    if len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)


def _growth(rows: list[dict]) -> str:
    top_g = max(r["gpus"] for r in rows)
    top_n = max(r["requests"] for r in rows)
    by_n = [(r["requests"], r["cpu_s"]) for r in rows if r["gpus"] == top_g]
    by_g = [(r["gpus"], r["cpu_s"]) for r in rows if r["requests"] == top_n]
    a, b = _exponent(by_n), _exponent(by_g)
    lines = [
        f"CPU time grows as requests^{a:.2f} (at {top_g} GPUs)"
        if a is not None
        else "one request size only: no growth exponent in requests",
        f"CPU time grows as GPUs^{b:.2f} (at {top_n} requests)"
        if b is not None
        else "one GPU count only: no growth exponent in GPUs",
    ]
    big = max((r for r in rows if r["gpus"] == top_g), key=lambda r: r["requests"])
    exp = a if a is not None else 1.0
    minutes = big["cpu_s"] * (1e6 / big["requests"]) ** exp / 60
    what = "measured" if big["requests"] >= 1e6 else "extrapolated"
    lines.append(
        f"{what}: 1M requests at {top_g} GPUs take {minutes:.1f} min of one core (target: < 5 min)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
