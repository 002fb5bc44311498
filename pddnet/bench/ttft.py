"""TTFT benchmark: same-dc, cross-dc and pdd on the same workloads and link, in one run.

Each system is brought up in turn as a real LocalCluster (separate daemon processes, the
emulated WAN between the datacenters) and fed the same two seeded workloads: Poisson arrivals
of long prompts, then multi-turn agent conversations (pddnet.workload.agent; each turn's
prompt is built from what the previous turn really returned). Everything is measured from the
client's side, under vLLM's names and definitions (pddnet.bench.metrics, docs/benchmarks.md
"Metrics": ttft, tpot, itl, e2el stats, request_goodput under --goodput's SLOs,
output_throughput), and beside them pddnet's own: the share of output tokens each daemon
produced, WAN KV bytes, the pipeline split and the handoffs. Ratios are against same-dc (the
ideal), from this one run. Plots: TTFT CDFs of the three systems per workload.

With emulated devices (--target-model, --device ROLE=CHIP[:GPUS], --dilation K|auto) every
cluster runs paced at the same k: the workload's arrivals and think times are stretched by k,
every reported time is divided by k, and the JSON's `devices` says per mode how well the box
kept up (a run that overran more than 1% of its forwards is flagged NOT VALID).
"""

from __future__ import annotations

import argparse
import re
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pddnet.bench import metrics
from pddnet.bench.client import StreamRecord
from pddnet.bench.devices import (
    UNPACED,
    DeviceSetup,
    device_reports,
    print_validity,
    setup_devices,
)
from pddnet.bench.drive import drive, warm_up
from pddnet.bench.options import add_long_prompt_arguments, add_run_arguments, add_wan_arguments
from pddnet.bench.plots import cdf_plot
from pddnet.bench.progress import progress
from pddnet.bench.results import run_config, write_result
from pddnet.device import flags as device_flags
from pddnet.model.cli import add_model_argument
from pddnet.workload.agent import AgentWorkloadParams, generate_agent_workload
from pddnet.workload.poisson import poisson_long_prompts

MODES = ("same-dc", "cross-dc", "pdd")
WORKLOADS = ("long", "agent")


# -- per request ------------------------------------------------------------------------------


def request_row(rec: StreamRecord, workload: str) -> dict[str, Any]:
    """What the result JSON keeps of one request (enough for `pdd trace` and re-analysis):
    ttft_ms, tpot_ms and e2el_ms in modelled time (vLLM's definitions, pddnet.bench.metrics;
    itl is token_times' gaps / dilation), input_len and output_len (vLLM's per-request names),
    sent_at and token_times raw (wall clock, the clock of the `pdd` timeline's `time`), and
    the dilation k that divides the one into the other."""

    def ms(v: float | None) -> float | None:
        return None if v is None else v * 1e3

    return {
        "workload": workload,
        "ok": rec.error is None,
        "error": rec.error,
        "ttft_ms": ms(rec.ttft_s),
        "tpot_ms": ms(metrics.tpot_s(rec)),
        "e2el_ms": ms(metrics.e2el_s(rec)),
        "input_len": rec.prompt_len,
        "output_len": len(rec.token_ids),
        "sent_at": rec.sent_at,
        "token_times": rec.token_times,
        "dilation": rec.dilation,
        "pdd": rec.pdd,
    }


# -- per mode ---------------------------------------------------------------------------------


def mode_summary(
    records: Sequence[StreamRecord],
    slos: dict[str, float] | None,
    duration_s: float | None = None,
    percentiles: Sequence[float] = metrics.DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """vLLM's serving metrics over `duration_s` (the run's modelled makespan) under the SLOs
    `slos` (ms by metric), then pddnet's own figures beside them (pddnet.bench.metrics)."""
    return {
        **metrics.serving_metrics(records, duration_s, slos, percentiles),
        **metrics.pdd_extras(records, percentiles),
    }


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ttft_keys(summary: dict[str, Any]) -> list[str]:
    """The TTFT stat keys a summary has, in order: median_ttft_ms, then pNN_ttft_ms."""
    found = (m for k in summary if (m := re.fullmatch(r"p([0-9.]+)_ttft_ms", k)))
    return ["median_ttft_ms"] + [m.group(0) for m in sorted(found, key=lambda m: float(m[1]))]


def ttft_ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """pdd / same-dc, cross-dc / same-dc and pdd / cross-dc of every TTFT stat (median and
    the selected percentiles), keyed by the stat's name."""
    pairs = [(m, "same-dc") for m in ("pdd", "cross-dc")] + [("pdd", "cross-dc")]
    return {
        f"{a}/{b}": {k: ratio(summaries[a][k], summaries[b][k]) for k in ttft_keys(summaries[a])}
        for a, b in pairs
        if a in summaries and b in summaries
    }


def md_wan_bytes_in(stats: dict[str, Any] | None) -> int:
    """Bytes MD received on all its (WAN) lanes, from its stats()."""
    if not stats:
        return 0
    return sum(int(d.get("bytes_in", 0)) for d in stats.get("lanes", {}).values())


def md_lane_bytes(
    before: dict[str, Any] | None, after: dict[str, Any] | None
) -> dict[str, dict[str, int]]:
    """Per lane of MD (bulk: P's KV chunks; control: P's and RLD's control messages, RLD's
    token-id HANDOFFs; events: the router), the bytes in and out between two stats()."""

    def lanes(stats: dict[str, Any] | None) -> dict[str, dict[str, int]]:
        return (stats or {}).get("lanes", {})

    b, a = lanes(before), lanes(after)
    return {
        lane: {
            d: int(a[lane].get(d, 0)) - int(b.get(lane, {}).get(d, 0))
            for d in ("bytes_in", "bytes_out")
        }
        for lane in a
    }


# -- the run ----------------------------------------------------------------------------------


# The agent conversations of a run, field by field: (--quick's, a full run's); lengths in tokens.
# A full run's count and rate are --conversations and --conversation-rate.
AGENT_SHAPES: dict[str, tuple[Any, Any]] = {
    "think_time_s": (0.2, 1.0),
    "num_system_prompts": (1, 2),
    "system_prompt_len": ((96, 160), (300, 800)),
    "task_len": ((16, 48), (50, 200)),
    "max_turns": ((2, 3), (2, 4)),
    "small_tool_len": ((4, 16), (4, 48)),
    "large_tool_len": ((64, 128), (200, 600)),
    "output_len": ((4, 8), (8, 32)),
    "max_context": (4096, 3000),
}


def agent_params(args: argparse.Namespace) -> AgentWorkloadParams:
    if args.quick:  # a smoke test: two conversations, whatever the options say
        count, rate, column = 2, 4.0, 0
    else:
        count, rate, column = args.conversations, args.conversation_rate, 1
    shape = {field: values[column] for field, values in AGENT_SHAPES.items()}
    return AgentWorkloadParams(num_conversations=count, conversation_rate_per_s=rate, **shape)


def make_workloads(args: argparse.Namespace) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    if "long" in args.workloads:
        out["long"] = poisson_long_prompts(
            args.requests, args.rate, tuple(args.prompt_len), tuple(args.max_tokens), seed=args.seed
        )
    if "agent" in args.workloads:
        out["agent"] = generate_agent_workload(agent_params(args), seed=args.seed)
    return out


def cluster_overrides(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a cluster of `mode` is configured with (beside the emulated devices): for checking
    the device flags against every mode before any cluster starts."""
    out = {
        "mode": mode,
        "model.name": args.model,
        "wan.shell": args.wan,
        "wan.rtt_ms": args.rtt_ms,
        "wan.jitter_ms": args.jitter_ms,
        "model.threads": args.threads,
        "policy.handoff": args.handoff,
    }
    if args.bw_mbit is not None:
        out["wan.bw_mbit"] = args.bw_mbit
    return out


async def run_mode(
    mode: str,
    workloads: dict[str, list[Any]],
    args: argparse.Namespace,
    show_progress: bool = True,
    devices: DeviceSetup | None = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One cluster in `mode`; every workload in turn; records, makespans and daemon stats (at
    the end, and as each workload began).
    `devices`: the run's emulated devices (`drive.setup_devices`); None: from `args`' flags.
    `overrides`: more config settings for this cluster (e.g. pool sizes)."""
    import aiohttp

    from pddnet.cluster.local import LocalCluster

    if devices is None:
        devices = setup_devices(args, {mode: cluster_overrides(mode, args)})
    k = devices.dilation
    overrides = {
        "model.threads": args.threads,
        "policy.handoff": args.handoff,
        **(overrides or {}),
        **devices.overrides,
    }
    out: dict[str, Any] = {
        "records": {},
        "makespan_s": {},
        "makespan_wall_s": {},
        "md_wan_bytes": {},
        "md_lane_bytes": {},
        "stats": {},
        "stats_before": {},
    }
    async with LocalCluster(
        mode=mode,
        model=args.model,
        wan=args.wan,
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        bw_mbit=args.bw_mbit,
        overrides=overrides,
    ) as cluster:
        out["wan_shell"] = cluster.wan.get("shell")
        out["wan_line"] = await line_effects(cluster.wan)
        has_md = "main_decode" in cluster.daemons
        timeout = aiohttp.ClientTimeout(total=args.request_timeout * k)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await warm_up(session, cluster.url, args.model, dilation=k)
            for name, workload in workloads.items():
                # every daemon's counters as the phase begins: a phase's own share of a
                # cumulative one (busy time, forwards) is the run's end's less these
                out["stats_before"][name] = {r: await cluster.stats(r) for r in cluster.daemons}
                before = out["stats_before"][name].get("main_decode")
                t0 = time.monotonic()
                with progress(len(workload), f"{mode:>8} {name:<5}", enabled=show_progress) as bar:
                    recs = await drive(session, cluster.url, workload, args.model, bar, dilation=k)
                wall = time.monotonic() - t0
                out["makespan_wall_s"][name] = wall
                out["makespan_s"][name] = wall / k
                out["records"][name] = recs
                after = await cluster.stats("main_decode") if has_md else None
                out["md_wan_bytes"][name] = md_wan_bytes_in(after) - md_wan_bytes_in(before)
                out["md_lane_bytes"][name] = md_lane_bytes(before, after)
        for role in cluster.daemons:
            out["stats"][role] = await cluster.stats(role)
    out["devices"] = device_reports({mode: out["stats"]})[mode]
    return out


async def line_effects(wan: dict[str, Any]) -> dict[str, Any] | None:
    """Each direction's effects as the cluster's emulator has them (rate and buffer in real
    bytes, times in wall ms: the line a dilated cluster really runs on), from its control API;
    None where the cluster has no emulator (same-DC) or its shell has no control API."""
    from emulation.control import ControlClient

    url = wan.get("control_url")
    if not url:
        return None
    snap = await ControlClient(url).show()
    return {d: v["effects"] for d, v in snap.items() if isinstance(v, dict) and "effects" in v}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, few requests (smoke test)")
    add_model_argument(p, default="small")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    add_long_prompt_arguments(p, requests=24, rate=0.5, prompt_len=(256, 768), max_tokens=(32, 96))
    p.add_argument("--conversations", type=int, default=6, help="agent conversations")
    p.add_argument(
        "--conversation-rate", type=float, default=0.4, help="new agent conversations per second"
    )
    metrics.add_arguments(p)
    add_wan_arguments(p, wan="proxy")
    p.add_argument("--handoff", default="dynamic", choices=("one-shot", "streaming", "dynamic"))
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--trace",
        action="store_true",
        help="also write a Chrome/Perfetto trace per mode and workload",
    )
    add_run_arguments(p, threads="torch threads per daemon")
    device_flags.add_arguments(p)


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.requests, args.rate = "tiny", 6, 4.0
        args.prompt_len, args.max_tokens = (64, 256), (8, 16)
    if args.bw_mbit is None:  # an explicit --bw-mbit wins over --quick's 4 Mbit/s
        args.bw_mbit = 4.0 if args.quick else 100.0


def check_args(args: argparse.Namespace) -> None:
    if args.requests < 1 or args.rate <= 0 or args.conversations < 1:
        raise ValueError("--requests and --conversations must be >= 1 and --rate > 0")
    for name in ("prompt_len", "max_tokens"):
        lo, hi = getattr(args, name)
        if not 0 < lo <= hi:
            raise ValueError(f"--{name.replace('_', '-')} must be 0 < MIN <= MAX, got {lo} {hi}")
    if "same-dc" not in args.modes:
        raise ValueError("--modes must include same-dc: every ratio is against it")


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args)
    check_args(args)
    slos = metrics.goodput_config(args)
    devices = setup_devices(args, {m: cluster_overrides(m, args) for m in args.modes})
    workloads = make_workloads(args)
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        per_mode[mode] = await run_mode(mode, workloads, args, not args.no_progress, devices)
    summaries = {
        w: {
            m: {
                **mode_summary(
                    per_mode[m]["records"][w],
                    slos,
                    per_mode[m]["makespan_s"][w],
                    args.metric_percentiles,
                ),
                "md_wan_bytes_received": per_mode[m]["md_wan_bytes"][w],
                "md_lane_bytes": per_mode[m]["md_lane_bytes"][w],
            }
            for m in args.modes
        }
        for w in workloads
    }
    ratios = {w: ttft_ratios(summaries[w]) for w in workloads}
    config = run_config(args)
    config["wan_shell"] = {m: per_mode[m].get("wan_shell") for m in args.modes}
    config["dilation_k"] = devices.dilation
    config["goodput_slos_ms"] = slos
    requests = {
        m: [request_row(r, w) for w in workloads for r in per_mode[m]["records"][w]]
        for m in args.modes
    }
    reports = {m: per_mode[m]["devices"] for m in args.modes}
    path = write_result(
        "ttft",
        {
            "config": config,
            "threads_per_daemon": args.threads,
            "workloads": summaries,
            "ratios": ratios,
            "modes": summaries.get("long") or summaries.get("agent"),
            "emulation": devices.to_dict(),
            "devices": reports,
            "makespan_wall_s": {m: per_mode[m]["makespan_wall_s"] for m in args.modes},
            "daemon_stats": {m: per_mode[m]["stats"] for m in args.modes},
            "requests": requests,
        },
        args.out,
    )
    plots = []
    for w in workloads:
        png = cdf_plot(
            {
                m: [r.ttft_s for r in per_mode[m]["records"][w] if r.ttft_s is not None]
                for m in args.modes
            },
            path.with_name(f"{path.stem}-{w}-ttft-cdf.png"),
            "TTFT (ms), measured by the client"
            + (f" (modelled: wall / k = {devices.dilation:g})" if devices.emulated else ""),
            f"TTFT CDF, {w} workload: {' vs '.join(args.modes)} (one run)",
        )
        if png:
            plots.append(str(png))
    traces = []
    if args.trace:
        from pddnet.obs.trace import write_trace

        for m in args.modes:
            for w in workloads:
                recs = [r for r in per_mode[m]["records"][w] if r.pdd.get("timeline")]
                if recs:
                    traces.append(
                        str(
                            write_trace(
                                path.with_name(f"{path.stem}-{m}-{w}.trace.json"),
                                [r.pdd for r in recs],
                                {r.pdd["request_id"]: r.token_times for r in recs},
                            )
                        )
                    )
    print_table(summaries, ratios, args, path, plots + traces, devices, slos)
    warnings = print_validity(reports, "ttft")
    return {
        "path": str(path),
        "workloads": summaries,
        "ratios": ratios,
        "plots": plots,
        "traces": traces,
        "devices": reports,
        "warnings": warnings,
    }


def print_table(
    summaries: dict[str, Any],
    ratios: dict[str, Any],
    args: argparse.Namespace,
    path: Path,
    files: list[str],
    devices: DeviceSetup | None = None,
    slos: dict[str, float] | None = None,
) -> None:
    pct = list(args.metric_percentiles)
    print(
        f"\nTTFT benchmark: model {args.model}, WAN {args.wan} shell rtt {args.rtt_ms} ms "
        f"jitter {args.jitter_ms} ms bw {args.bw_mbit} Mbit/s, {args.threads} torch "
        f"thread(s) per daemon; goodput SLOs (ms) {metrics.goodput_label(slos or {})}"
    )
    print((devices or UNPACED).line())
    print(
        "vLLM's metric names (docs/benchmarks.md, Metrics): durations in ms, request_goodput "
        "in req/s, output_throughput in tok/s"
    )
    for w, per_mode in summaries.items():
        print(f"\n[{w}]")
        metrics.print_columns(list(per_mode.items()), metrics.serving_columns(pct), indent="  ")
        print(
            "  pddnet's own: requests per pipeline, handoffs RLD -> MD (ms), share of output "
            "tokens, MiB over the WAN"
        )
        metrics.print_columns(
            list(per_mode.items()), metrics.pdd_columns(per_mode.values()), indent="  "
        )
        for name, r in ratios[w].items():
            parts = ", ".join(
                f"{k[: -len('_ttft_ms')]} {v:.2f}x" for k, v in r.items() if v is not None
            )
            print(f"  TTFT {name}: {parts}")
    print(f"\nwrote {path}")
    for f in files:
        print(f"wrote {f}")
