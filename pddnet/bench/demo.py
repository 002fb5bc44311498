"""`pdd demo`: the main job in one command.

Brings up a whole cluster in each mode -- pdd, then the cross-dc and same-dc baselines -- on
the testbed (LocalCluster's wan="auto": the packet shell when root and /dev/net/tun are there,
the proxy shell otherwise; it says which), sends each the same short mixed workload (Poisson
long prompts whose outputs outlast their KV's crossing, so that pdd sends them P->RLD->MD and
hands them off, plus a multi-turn agent conversation), shows live progress, prints two side by
side tables -- vLLM's serving metrics (ttft, tpot, itl, e2el, request_goodput,
output_throughput; docs/benchmarks.md, "Metrics") and pddnet's own (requests per pipeline,
handoffs and their latency, RLD's and MD's share of the output tokens, MiB over the WAN) -- and
writes its plots (TTFT CDFs, who produced the tokens, the pipeline split, the WAN bytes by
kind), the result JSON and a Perfetto trace of one PDD request into a folder it names. About
1.5 minutes on 2 cores with the small model (88 s measured alone).

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

from pddnet.bench import metrics
from pddnet.bench.options import add_long_prompt_arguments, add_run_arguments, add_wan_arguments
from pddnet.bench.plots import cdf_plot, stacked_bars
from pddnet.bench.results import run_config, write_result
from pddnet.device import flags as device_flags
from pddnet.model.cli import add_model_argument
from pddnet.workload.agent import AgentWorkloadParams, generate_agent_workload
from pddnet.workload.poisson import poisson_long_prompts

MODES = ("pdd", "cross-dc", "same-dc")


def demo_workloads(args: argparse.Namespace) -> dict[str, list[Any]]:
    long = poisson_long_prompts(
        args.requests, args.rate, tuple(args.prompt_len), tuple(args.max_tokens), seed=args.seed
    )
    small = args.quick
    agent = generate_agent_workload(
        AgentWorkloadParams(
            num_conversations=args.conversations,
            conversation_rate_per_s=1.0,
            think_time_s=0.5,
            num_system_prompts=1,
            system_prompt_len=(96, 160) if small else (300, 600),
            task_len=(16, 48) if small else (50, 150),
            max_turns=(2, 3),
            small_tool_len=(4, 24),
            large_tool_len=(64, 128) if small else (200, 400),
            output_len=(4, 8) if small else (16, 32),
            max_context=2000,
        ),
        seed=args.seed,
    )
    return {"long": long, "agent": agent}


def ttft_namespace(args: argparse.Namespace) -> argparse.Namespace:
    """The TTFT benchmark's options, for its cluster driver (pddnet.bench.ttft.run_mode)."""
    from pddnet.bench import ttft

    p = argparse.ArgumentParser()
    ttft.add_arguments(p)
    ns = p.parse_args([])
    for key in (
        "model",
        "wan",
        "rtt_ms",
        "jitter_ms",
        "bw_mbit",
        "threads",
        "seed",
        "quick",
        "target_model",
        "device",
        "dilation",
    ):
        setattr(ns, key, getattr(args, key))
    return ns


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from pddnet.bench import ttft
    from pddnet.bench.devices import print_validity, setup_devices
    from pddnet.obs.trace import write_trace

    apply_quick(args)
    targs = ttft_namespace(args)
    try:  # the SLOs and device flags, checked (auto probed) before any cluster starts
        slos = metrics.goodput_config(args)
        devices = setup_devices(targs, {m: ttft.cluster_overrides(m, targs) for m in args.modes})
    except ValueError as exc:
        print(f"pdd demo: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    t0 = time.monotonic()
    folder = Path(args.out) / "demo" / time.strftime("%Y%m%d-%H%M%S")
    folder.mkdir(parents=True, exist_ok=True)
    workloads = demo_workloads(args)
    n = sum(map(len, workloads.values()))
    print(
        f"pdd demo: model {args.model}, {n} requests per mode ({len(workloads['long'])} long "
        f"prompts, {len(workloads['agent'])} agent turns), WAN rtt {args.rtt_ms:g} ms, jitter "
        f"{args.jitter_ms:g} ms, {args.bw_mbit:g} Mbit/s; writing to {folder}/",
        flush=True,
    )
    print(devices.line(), flush=True)
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        t_mode = time.monotonic()
        per_mode[mode] = await ttft.run_mode(mode, workloads, targs, not args.no_progress, devices)
        shell = per_mode[mode].get("wan_shell") or "none"
        print(
            f"  {mode}: done in {time.monotonic() - t_mode:.0f} s (WAN shell: {shell})", flush=True
        )
    table: dict[str, dict[str, Any]] = {}
    for mode, res in per_mode.items():
        records = [r for w in workloads for r in res["records"][w]]
        s = ttft.mode_summary(
            records, slos, sum(res["makespan_s"].values()), args.metric_percentiles
        )
        s["md_wan_bytes_received"] = sum(res["md_wan_bytes"].values())
        lanes: dict[str, dict[str, int]] = {}
        for per_lane in res["md_lane_bytes"].values():
            for lane, d in per_lane.items():
                acc = lanes.setdefault(lane, {"bytes_in": 0, "bytes_out": 0})
                for key, v in d.items():
                    acc[key] += v
        s["md_lane_bytes"] = lanes
        s["md_wan_bytes_sent"] = sum(d["bytes_out"] for d in lanes.values())
        table[mode] = s
    ratios = ttft.ttft_ratios(table) if "same-dc" in table else {}
    files = write_plots(folder, per_mode, table, workloads)
    pdd_recs = [
        r
        for w in workloads
        for r in per_mode.get("pdd", {}).get("records", {}).get(w, [])
        if r.pdd.get("handoff_mode")
    ]
    if pdd_recs:
        rec = max(pdd_recs, key=lambda r: len(r.token_ids))
        files.append(
            write_trace(
                folder / f"trace-{rec.pdd['request_id']}.json",
                rec.pdd,
                {rec.pdd["request_id"]: rec.token_times},
            )
        )
    config = run_config(args)
    config["wan_shell"] = {m: r.get("wan_shell") for m, r in per_mode.items()}
    config["dilation_k"] = devices.dilation
    config["goodput_slos_ms"] = slos
    requests = {
        m: [ttft.request_row(r, w) for w in workloads for r in res["records"][w]]
        for m, res in per_mode.items()
    }
    reports = {m: res["devices"] for m, res in per_mode.items()}
    path = write_result(
        "demo",
        {
            "config": config,
            "threads_per_daemon": args.threads,
            "modes": table,
            "ratios": ratios,
            "folder": str(folder),
            "emulation": devices.to_dict(),
            "devices": reports,
            "requests": requests,
            "elapsed_s": time.monotonic() - t0,
        },
        args.out,
    )
    final = folder / "result.json"
    path.replace(final)
    print_table(table, ratios, devices.line(), slos, args.metric_percentiles)
    print(f"\nresults and plots in {folder}/ ({time.monotonic() - t0:.0f} s):")
    for f in [final, *files]:
        print(f"  {f}")
    warnings = print_validity(reports, "demo")
    return {
        "folder": str(folder),
        "path": str(final),
        "modes": table,
        "ratios": ratios,
        "files": [str(f) for f in files],
        "devices": reports,
        "warnings": warnings,
    }


# what each daemon is called in each mode: same-dc's one decode instance (the relay role's
# daemon) is "D", pdd's are RLD and MD, cross-dc's MD; P makes no output token in any mode
PRODUCER_LABELS = {
    "same-dc": {"relay": "D (same-dc's decode)"},
    "cross-dc": {"main_decode": "MD"},
    "pdd": {"relay": "RLD", "main_decode": "MD"},
}
PIPELINE_LABELS = {
    "p_md": "P->MD",
    "p_rld_md": "P->RLD->MD",
    "p_rld": "P->RLD",
    "same_dc": "P->D (same-dc)",
}
COLORS = {
    "D (same-dc's decode)": "tab:gray",
    "RLD": "tab:orange",
    "MD": "tab:blue",
    "P->MD": "tab:blue",
    "P->RLD->MD, handed off": "tab:green",
    "P->RLD->MD, finished on RLD": "tab:olive",
    "P->RLD": "tab:orange",
    "P->D (same-dc)": "tab:gray",
    "KV payload (P -> MD)": "tab:blue",
    "token-id handoffs (RLD -> MD)": "tab:green",
    "other bytes into MD": "tab:purple",
    "bytes out of MD": "tab:pink",
}


def token_share_groups(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for mode, s in table.items():
        names = PRODUCER_LABELS.get(mode, {"relay": "RLD", "main_decode": "MD"})
        out[mode] = {names[p]: s["token_share"][p] for p in ("relay", "main_decode") if p in names}
    return out


def pipeline_groups(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Requests per pipeline, P->RLD->MD split into handed off and finished on RLD."""
    out: dict[str, dict[str, float]] = {}
    for mode, s in table.items():
        g: dict[str, float] = {}
        if s.get("cluster_mode") == "same-dc":  # P and its one decode instance, D
            out[mode] = {PIPELINE_LABELS["same_dc"]: s["completed"]}
            continue
        split = s["pipeline_split"]
        order = [w for w in PIPELINE_LABELS if w in split] + [
            w for w in split if w not in PIPELINE_LABELS
        ]
        for wire, n in ((w, split[w]) for w in order):
            if wire == "p_rld_md":
                on_rld = s["p_rld_md_finished_on_rld"]
                g["P->RLD->MD, handed off"] = n - on_rld
                g["P->RLD->MD, finished on RLD"] = on_rld
            else:
                g[PIPELINE_LABELS.get(wire, wire)] = n
        out[mode] = g
    return out


def wan_groups(table: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    """MiB over the WAN, by what they were: MD's received bytes split into P's KV payload,
    RLD's token-id handoffs and the rest, and what MD sent."""
    out: dict[str, dict[str, float]] = {}
    for mode, s in table.items():
        kv, handoff = s["wan_kv_bytes"], s["handoff_bytes"]
        other = max(0, s["md_wan_bytes_received"] - kv - handoff)
        out[mode] = {
            "KV payload (P -> MD)": kv / 2**20,
            "token-id handoffs (RLD -> MD)": handoff / 2**20,
            "other bytes into MD": other / 2**20,
            "bytes out of MD": s.get("md_wan_bytes_sent", 0) / 2**20,
        }
    return out


def wan_notes(table: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Under each mode's bar, the bytes too small to see in it, in KiB."""
    out: dict[str, str] = {}
    for mode, s in table.items():
        if not s.get("md_lane_bytes"):
            out[mode] = "(no WAN)"
            continue
        kv, handoff = s["wan_kv_bytes"], s["handoff_bytes"]
        other = max(0, s["md_wan_bytes_received"] - kv - handoff)
        out[mode] = (
            f"into MD besides KV:\n{handoff / 1024:.1f} KiB handoffs\n"
            f"{other / 1024:.0f} KiB other\nout of MD: "
            f"{s.get('md_wan_bytes_sent', 0) / 1024:.0f} KiB"
        )
    return out


def write_plots(
    folder: Path,
    per_mode: dict[str, dict[str, Any]],
    table: dict[str, dict[str, Any]],
    workloads: dict[str, Any],
) -> list[Path]:
    out: list[Path | None] = []
    ttfts = {
        m: [r.ttft_s for w in workloads for r in res["records"][w] if r.ttft_s is not None]
        for m, res in per_mode.items()
    }
    out.append(
        cdf_plot(
            ttfts,
            folder / "ttft-cdf.png",
            "ttft (ms), measured by the client",
            "TTFT CDF: pdd vs cross-dc vs same-dc (same workload and WAN)",
        )
    )
    handoffs = {
        m: f"{s['handoff_count']} handoffs"
        for m, s in table.items()
        if "main_decode" in PRODUCER_LABELS.get(m, {}) and "relay" in PRODUCER_LABELS.get(m, {})
    }
    out.append(
        stacked_bars(
            token_share_groups(table),
            folder / "token-share.png",
            "share of output tokens",
            "Who produced the output tokens",
            COLORS,
            value_fmt="{:.0%}",
            notes=handoffs,
            caption="D: same-dc's one decode instance (in datacenter A, beside "
            "P). RLD: pdd's relay decode in A; MD: the main decode in "
            "B, behind the WAN. P produces no output token in any "
            "mode.",
        )
    )
    counts = pipeline_groups(table)
    out.append(
        stacked_bars(
            counts,
            folder / "pipelines.png",
            "requests",
            "Pipeline split per mode",
            COLORS,
            value_fmt="{:.0f}",
            total_fmt="{:.0f} requests",
            notes=handoffs,
            caption="The pipeline P chose per request (the pdd object's "
            "`pipeline`). P->RLD->MD requests either hand off to MD "
            "(by token ids, once MD's copy of the KV is complete) or "
            "finish on RLD before that; P->RLD: RLD alone (its output "
            "ends before the KV could cross); P->MD: the KV crosses "
            "first, MD decodes everything.",
        )
    )
    out.append(
        stacked_bars(
            wan_groups(table),
            folder / "wan-bytes.png",
            "MiB",
            "Bytes over the WAN (all of MD's lanes)",
            COLORS,
            value_fmt="{:.1f}",
            total_fmt="{:.1f} MiB",
            notes=wan_notes(table),
            caption="KV payload: the prompts' KV P sent MD (the pdd object's "
            "wan_kv_bytes). Token-id handoffs: RLD's HANDOFF messages "
            "(handoff_bytes). Other bytes into MD: KV chunk framing, "
            "control messages (P's allocation requests and KV_DONE, "
            "RLD's TAKEOVER replies, cancels) and the router's "
            "pings. Out of MD: its token events to the router and its "
            "replies to P and RLD. same-dc has no WAN.",
        )
    )
    return [p for p in out if p is not None]


def print_table(
    table: dict[str, dict[str, Any]],
    ratios: dict[str, Any],
    devices_line: str | None = None,
    slos: dict[str, float] | None = None,
    percentiles: Any = metrics.DEFAULT_PERCENTILES,
) -> None:
    if devices_line:
        print(f"\n{devices_line}", end="")
    rows = list(table.items())
    print(
        f'\nvLLM\'s serving metrics (names and definitions: docs/benchmarks.md, "Metrics"); '
        f"ms, request_goodput req/s under {metrics.goodput_label(slos or {})}, "
        f"output_throughput tok/s:"
    )
    metrics.print_columns(rows, metrics.serving_columns(list(percentiles)))

    print(
        "\npddnet's own (requests per pipeline, handoffs RLD -> MD and their latency in ms, "
        "share of output tokens, MiB over the WAN):"
    )
    metrics.print_columns(rows, metrics.pdd_columns(table.values()))
    for name, r in ratios.items():
        parts = ", ".join(
            f"{k[: -len('_ttft_ms')]} {v:.2f}x" for k, v in r.items() if v is not None
        )
        print(f"ttft {name}: {parts}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, a handful of requests")
    add_model_argument(p, default="small")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    # outputs long next to their KV's crossing time, so that pdd's pipeline policy sends the
    # long prompts P->RLD->MD and RLD is still decoding when MD's copy lands: they hand off
    add_long_prompt_arguments(p, requests=8, rate=0.8, prompt_len=(192, 448), max_tokens=(64, 128))
    p.add_argument("--conversations", type=int, default=1, help="agent conversations per mode")
    metrics.add_arguments(p)
    add_wan_arguments(p, wan="auto")
    add_run_arguments(
        p, threads="torch threads per daemon", out_help="the demo writes into OUT/demo/<timestamp>/"
    )
    device_flags.add_arguments(p)


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.requests, args.rate, args.conversations = "tiny", 4, 4.0, 1
        args.prompt_len, args.max_tokens = (64, 256), (8, 16)
    if args.bw_mbit is None:  # an explicit --bw-mbit wins over --quick's 4 Mbit/s
        args.bw_mbit = 4.0 if args.quick else 100.0
