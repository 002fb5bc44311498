"""`pdd demo`: the main job in one command.

Brings up a whole cluster in each mode -- pdd, then the cross-dc and same-dc baselines -- on
the testbed (LocalCluster's wan="auto": the packet shell when root and /dev/net/tun are there,
the proxy shell otherwise; it says which), sends each the same short mixed workload (Poisson
long prompts plus a few multi-turn agent conversations), shows live progress, prints a side by
side table (TTFT percentiles, RLD's share of output tokens, WAN bytes, handoff latency) and
writes its plots, the result JSON and a Perfetto trace of one PDD request into a folder it
names. About 1.5-2.5 minutes on 2 cores with the small model.

With emulated devices (--target-model, --device ROLE=CHIP[:GPUS], --dilation K|auto) the three
clusters run paced at one k (auto is probed once, before the first cluster): the workload's time
is stretched by k, every time shown is the modelled one (/ k), and a mode whose daemons overran
more than 1% of their forwards is flagged NOT VALID at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from pddnet.bench.agent_workload import AgentWorkloadParams, generate_agent_workload
from pddnet.bench.plots import cdf_plot, grouped_bars
from pddnet.bench.results import write_result
from pddnet.bench.workload import poisson_long_prompts
from pddnet.device import flags as device_flags

MODES = ("pdd", "cross-dc", "same-dc")


def demo_workloads(args: argparse.Namespace) -> dict[str, list[Any]]:
    long = poisson_long_prompts(args.requests, args.rate, tuple(args.prompt_len),
                                tuple(args.max_tokens), seed=args.seed)
    small = args.quick
    agent = generate_agent_workload(AgentWorkloadParams(
        num_conversations=args.conversations, conversation_rate_per_s=1.0, think_time_s=0.5,
        num_system_prompts=1, system_prompt_len=(96, 160) if small else (300, 600),
        task_len=(16, 48) if small else (50, 150), max_turns=(2, 3),
        small_tool_len=(4, 24), large_tool_len=(64, 128) if small else (200, 400),
        output_len=(4, 8) if small else (16, 32), max_context=2000), seed=args.seed)
    return {"long": long, "agent": agent}


def ttft_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """The TTFT benchmark's options, for its cluster driver (pddnet.bench.ttft.run_mode)."""
    from pddnet.bench import ttft

    p = argparse.ArgumentParser()
    ttft.add_arguments(p)
    ns = p.parse_args([])
    for key in ("model", "wan", "rtt_ms", "jitter_ms", "bw_mbit", "threads", "seed", "quick",
                "target_model", "device", "dilation"):
        setattr(ns, key, getattr(args, key))
    return ns


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from pddnet.bench import ttft
    from pddnet.bench.devices import print_validity, setup_devices
    from pddnet.obs.trace import write_trace

    apply_quick(args)
    targs = ttft_namespace(args)
    try:   # the device flags, checked against every mode (and auto probed) before any cluster
        devices = setup_devices(targs, {m: ttft.cluster_overrides(m, targs) for m in args.modes})
    except ValueError as exc:
        print(f"pdd demo: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    t0 = time.monotonic()
    folder = Path(args.out) / "demo" / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    workloads = demo_workloads(args)
    n = sum(map(len, workloads.values()))
    print(f"pdd demo: model {args.model}, {n} requests per mode ({len(workloads['long'])} long "
          f"prompts, {len(workloads['agent'])} agent turns), WAN rtt {args.rtt_ms:g} ms, jitter "
          f"{args.jitter_ms:g} ms, {args.bw_mbit:g} Mbit/s; writing to {folder}/", flush=True)
    print(devices.line(), flush=True)
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        t_mode = time.monotonic()
        per_mode[mode] = await ttft.run_mode(mode, workloads, targs, not args.no_progress,
                                             devices)
        shell = per_mode[mode].get("wan_shell") or "none"
        print(f"  {mode}: done in {time.monotonic() - t_mode:.0f} s (WAN shell: {shell})",
              flush=True)
    sla = (args.sla_ttft_ms / 1e3, args.sla_tpot_ms / 1e3)
    table: dict[str, dict[str, Any]] = {}
    for mode, res in per_mode.items():
        records = [r for w in workloads for r in res["records"][w]]
        s = ttft.mode_summary(records, *sla, sum(res["makespan_s"].values()))
        s["md_wan_bytes"] = sum(res["md_wan_bytes"].values())
        table[mode] = s
    ratios = ttft.ttft_ratios(table) if "same-dc" in table else {}
    files = write_plots(folder, per_mode, table, workloads)
    pdd_recs = [r for w in workloads for r in per_mode.get("pdd", {}).get("records", {}).get(w, [])
                if r.pdd.get("handoff_mode")]
    if pdd_recs:
        rec = max(pdd_recs, key=lambda r: len(r.token_ids))
        files.append(write_trace(folder / f"trace-{rec.pdd['request_id']}.json", rec.pdd,
                                 {rec.pdd["request_id"]: rec.token_times}))
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
              if k != "handler"}
    config["wan_shell"] = {m: r.get("wan_shell") for m, r in per_mode.items()}
    config["dilation_k"] = devices.dilation
    requests = {m: [ttft.request_row(r, w) for w in workloads for r in res["records"][w]]
                for m, res in per_mode.items()}
    reports = {m: res["devices"] for m, res in per_mode.items()}
    path = write_result("demo", {"config": config, "threads_per_daemon": args.threads,
                                 "modes": table, "ratios": ratios, "folder": str(folder),
                                 "emulation": devices.to_dict(), "devices": reports,
                                 "requests": requests,
                                 "elapsed_s": time.monotonic() - t0}, args.out)
    final = folder / "result.json"
    path.replace(final)
    print_table(table, ratios, devices.line())
    print(f"\nresults and plots in {folder}/ ({time.monotonic() - t0:.0f} s):")
    for f in [final, *files]:
        print(f"  {f}")
    warnings = print_validity(reports, "demo")
    return {"folder": str(folder), "path": str(final), "modes": table, "ratios": ratios,
            "files": [str(f) for f in files], "devices": reports, "warnings": warnings}


def write_plots(folder: Path, per_mode: dict[str, dict[str, Any]],
                table: dict[str, dict[str, Any]], workloads: dict[str, Any]) -> list[Path]:
    out: list[Path | None] = []
    ttfts = {m: [r.ttft_s for w in workloads for r in res["records"][w] if r.ttft_s is not None]
             for m, res in per_mode.items()}
    out.append(cdf_plot(ttfts, folder / "ttft-cdf.png", "TTFT (ms), measured by the client",
                        "TTFT CDF: pdd vs cross-dc vs same-dc (same workload and WAN)"))
    out.append(grouped_bars({m: {"RLD": s["token_share"]["relay"],
                                 "MD": s["token_share"]["main_decode"],
                                 "P": s["token_share"]["prefill"]} for m, s in table.items()},
                            folder / "token-share.png", "share of output tokens",
                            "Who produced the output tokens"))
    out.append(grouped_bars({m: {"WAN KV bytes (MiB)": s["wan_kv_bytes"] / 2**20,
                                 "all bytes MD received (MiB)": s["md_wan_bytes"] / 2**20}
                             for m, s in table.items()},
                            folder / "wan-bytes.png", "MiB", "Bytes over the WAN"))
    return [p for p in out if p is not None]


def print_table(table: dict[str, dict[str, Any]], ratios: dict[str, Any],
                devices_line: str | None = None) -> None:
    def ms(v: float | None) -> str:
        return f"{'-':>8}" if v is None else f"{v * 1e3:8.0f}"

    if devices_line:
        print(f"\n{devices_line}", end="")
    print(f"\n{'mode':>9} {'ok':>5} {'TTFT p50':>8} {'p90':>8} {'p99':>8} {'RLD share':>9} "
          f"{'WAN MiB':>8} {'handoff mean':>12} {'max':>8}  (ms)")
    for mode, s in table.items():
        t, h = s["ttft_s"], s["handoff_latency_s"]
        print(f"{mode:>9} {s['completed']:>2}/{s['requests']:<2} {ms(t['p50'])} {ms(t['p90'])} "
              f"{ms(t['p99'])} {s['token_share']['relay']:9.1%} "
              f"{s['md_wan_bytes'] / 2**20:8.1f} {ms(h['mean']):>12} {ms(h['max'])}")
    for name, r in ratios.items():
        parts = ", ".join(f"{q} {v:.2f}x" for q, v in r.items() if v is not None)
        print(f"TTFT {name}: {parts}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, a handful of requests")
    p.add_argument("--model", default="small")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--requests", type=int, default=8, help="long-prompt requests per mode")
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(128, 512), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(24, 64), metavar=("MIN", "MAX"))
    p.add_argument("--conversations", type=int, default=2, help="agent conversations per mode")
    p.add_argument("--sla-ttft-ms", type=float, default=1000.0)
    p.add_argument("--sla-tpot-ms", type=float, default=50.0)
    p.add_argument("--wan", default="auto", choices=("auto", "kernel", "packet", "proxy"))
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--jitter-ms", type=float, default=2.0)
    p.add_argument("--bw-mbit", type=float, default=None,
                   help="WAN rate per direction, in the modelled world when devices are "
                        "emulated (default 100; --quick: 4)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="results", help="the demo writes into OUT/demo/<timestamp>/")
    device_flags.add_arguments(p)


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.requests, args.rate, args.conversations = "tiny", 4, 4.0, 1
        args.prompt_len, args.max_tokens = (64, 256), (8, 16)
    if args.bw_mbit is None:    # an explicit --bw-mbit wins over --quick's 4 Mbit/s
        args.bw_mbit = 4.0 if args.quick else 100.0
