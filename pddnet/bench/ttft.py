"""TTFT benchmark: same-dc, cross-dc and pdd on the same workload and link, in one run.

Each system is brought up in turn as a real LocalCluster (separate daemon processes, the
emulated WAN between the datacenters), fed the same seeded Poisson workload, and measured from
the client's side. Ratios are against same-dc (the ideal), from this one run.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from pddnet.bench.client import StreamRecord, stream_completion
from pddnet.bench.results import summary, write_result
from pddnet.bench.workload import BenchRequest, poisson_long_prompts

MODES = ("same-dc", "cross-dc", "pdd")


async def run_mode(mode: str, workload: list[BenchRequest], args: argparse.Namespace,
                   progress: Any = None) -> list[StreamRecord]:
    import aiohttp

    from pddnet.cluster.local import LocalCluster

    overrides = {"model.threads": args.threads, "policy.handoff": args.handoff}
    async with LocalCluster(mode=mode, model=args.model, wan=args.wan, rtt_ms=args.rtt_ms,
                            jitter_ms=args.jitter_ms, bw_mbit=args.bw_mbit,
                            overrides=overrides) as cluster:
        timeout = aiohttp.ClientTimeout(total=args.request_timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            # One warm-up request so that model loading and first-touch costs are not measured.
            await stream_completion(session, cluster.url, {"prompt": [1, 2, 3], "max_tokens": 2})
            start = time.monotonic()

            async def one(req: BenchRequest) -> StreamRecord:
                await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - start)))
                rec = await stream_completion(session, cluster.url, {
                    "model": args.model, "prompt": list(req.prompt_token_ids),
                    "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True})
                if progress is not None:
                    progress.update(1)
                return rec

            return await asyncio.gather(*(one(r) for r in workload))


def mode_summary(records: list[StreamRecord]) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    itl = [g for r in ok for g in r.inter_token_s()]
    relay = sum(r.pdd.get("relay_tokens", 0) for r in ok)
    main = sum(r.pdd.get("main_tokens", 0) for r in ok)
    total = relay + main
    return {
        "requests": len(records), "completed": len(ok),
        "errors": [r.error for r in records if r.error is not None][:5],
        "ttft_s": summary([r.ttft_s for r in ok]),
        "router_ttft_s": summary([r.pdd["ttft_s"] for r in ok if r.pdd.get("ttft_s") is not None]),
        "itl_s": summary(itl),
        "relay_token_share": relay / total if total else 0.0,
        "main_token_share": main / total if total else 0.0,
        "wan_kv_bytes": sum(r.pdd.get("wan_kv_bytes", 0) for r in ok),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def plot_cdfs(per_mode: dict[str, list[StreamRecord]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, records in per_mode.items():
        xs = sorted(r.ttft_s for r in records if r.ttft_s is not None)
        if xs:
            ax.step([x * 1e3 for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                    where="post", label=mode)
    ax.set_xlabel("TTFT (ms), measured by the client")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF: same-dc vs cross-dc vs pdd (one run, same workload and link)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, few requests (smoke test)")
    p.add_argument("--model", default="small")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(256, 768), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(16, 48), metavar=("MIN", "MAX"))
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--jitter-ms", type=float, default=2.0)
    p.add_argument("--bw-mbit", type=float, default=100.0)
    p.add_argument("--wan", default="proxy", choices=("auto", "kernel", "packet", "proxy"))
    p.add_argument("--handoff", default="dynamic", choices=("one-shot", "streaming", "dynamic"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", default="results")


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.requests, args.rate = "tiny", 6, 4.0
        args.prompt_len, args.max_tokens, args.bw_mbit = (64, 256), (8, 16), 4.0


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args)
    workload = poisson_long_prompts(args.requests, args.rate, tuple(args.prompt_len),
                                    tuple(args.max_tokens), seed=args.seed)
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    per_mode: dict[str, list[StreamRecord]] = {}
    for mode in MODES:
        bar = tqdm(total=len(workload), desc=f"{mode:>8}", unit="req") if tqdm else None
        try:
            per_mode[mode] = await run_mode(mode, workload, args, bar)
        finally:
            if bar is not None:
                bar.close()
    summaries = {m: mode_summary(r) for m, r in per_mode.items()}
    base = summaries["same-dc"]["ttft_s"]
    ratios = {
        f"{m}/same-dc": {q: ratio(summaries[m]["ttft_s"][q], base[q]) for q in ("p50", "p90", "p99")}
        for m in ("pdd", "cross-dc")
    }
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
              if k != "handler"}
    path = write_result("ttft", {"config": config, "threads_per_daemon": args.threads,
                                 "modes": summaries, "ratios": ratios}, args.out)
    plot_cdfs(per_mode, path.with_suffix(".png"))
    print_table(summaries, ratios, args, path)
    return {"path": str(path), "modes": summaries, "ratios": ratios}


def print_table(summaries: dict[str, Any], ratios: dict[str, Any], args: argparse.Namespace,
                path: Path) -> None:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:8.1f}"

    print(f"\nTTFT benchmark: model {args.model}, {args.requests} requests at {args.rate}/s, "
          f"WAN {args.wan} shell rtt {args.rtt_ms} ms jitter {args.jitter_ms} ms "
          f"bw {args.bw_mbit} Mbit/s, {args.threads} torch thread(s) per daemon")
    print(f"{'mode':>9} {'ok':>5} {'TTFT p50':>9} {'p90':>9} {'p99':>9} {'ITL p50':>9} "
          f"{'ITL p99':>9} {'RLD share':>9}  (ms)")
    for mode, s in summaries.items():
        t, i = s["ttft_s"], s["itl_s"]
        print(f"{mode:>9} {s['completed']:>2}/{s['requests']:<2} {ms(t['p50'])} {ms(t['p90'])} "
              f"{ms(t['p99'])} {ms(i['p50'])} {ms(i['p99'])} {s['relay_token_share']:9.1%}")
    for name, r in ratios.items():
        parts = ", ".join(f"{q} {v:.2f}x" for q, v in r.items() if v is not None)
        print(f"TTFT {name}: {parts}")
    print(f"wrote {path} and {path.with_suffix('.png')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    asyncio.run(run(args))
    return 0
