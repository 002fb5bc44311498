"""TTFT benchmark: same-dc, cross-dc and pdd on the same workloads and link, in one run.

Each system is brought up in turn as a real LocalCluster (separate daemon processes, the
emulated WAN between the datacenters) and fed the same two seeded workloads: Poisson arrivals
of long prompts, then multi-turn agent conversations (pddnet.bench.agent_workload; each turn's
prompt is built from what the previous turn really returned). Everything is measured from the
client's side: TTFT P50/P90/P99, inter-token latency P50/P99, goodput under a TTFT + TPOT SLA,
and the share of output tokens each daemon produced. Ratios are against same-dc (the ideal),
from this one run. Plots: TTFT CDFs of the three systems per workload.

With emulated devices (--target-model, --device ROLE=CHIP[:GPUS], --dilation K|auto) every
cluster runs paced at the same k: the workload's arrivals and think times are stretched by k,
every reported time is divided by k, and the JSON's `devices` says per mode how well the box
kept up (a run that overran more than 1% of its forwards is flagged NOT VALID).
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pddnet.bench.agent_workload import AgentWorkloadParams, generate_agent_workload
from pddnet.bench.client import StreamRecord
from pddnet.bench.devices import (
    UNPACED,
    DeviceSetup,
    device_reports,
    print_validity,
    setup_devices,
)
from pddnet.bench.drive import drive_agent, drive_poisson, warm_up
from pddnet.bench.plots import cdf_plot
from pddnet.bench.progress import progress
from pddnet.bench.results import summary, write_result
from pddnet.bench.workload import poisson_long_prompts
from pddnet.device import flags as device_flags

MODES = ("same-dc", "cross-dc", "pdd")
WORKLOADS = ("long", "agent")
PRODUCERS = (("prefill", "prefill_tokens"), ("relay", "relay_tokens"),
             ("main_decode", "main_tokens"))


# -- per request ------------------------------------------------------------------------------


def tpot_s(rec: StreamRecord) -> float | None:
    """Mean time per output token after the first (None for fewer than two tokens)."""
    t = rec.token_times
    return rec.span_s(t[0], t[-1]) / (len(t) - 1) if len(t) > 1 else None


def request_row(rec: StreamRecord, workload: str) -> dict[str, Any]:
    """What the result JSON keeps of one request (enough for `pdd trace` and re-analysis):
    ttft_s and tpot_s in modelled time, sent_at and token_times raw (wall clock, the clock of
    the `pdd` timeline's `time`), and the dilation k that divides the one into the other."""
    return {"workload": workload, "ok": rec.error is None, "error": rec.error,
            "ttft_s": rec.ttft_s, "tpot_s": tpot_s(rec), "num_tokens": len(rec.token_ids),
            "sent_at": rec.sent_at, "token_times": rec.token_times, "dilation": rec.dilation,
            "pdd": rec.pdd}


def handoff_latency_s(pdd: dict[str, Any]) -> float | None:
    """From RLD starting the handoff (TAKEOVER seen) to MD's first token after the cut, in
    modelled time (the timeline's `time` is wall clock: / the router's dilation)."""
    ev = {e["event"]: e["time"] for e in pdd.get("timeline", [])}
    if "handoff_start" in ev and "first_md_token" in ev:
        k = float((pdd.get("emulation") or {}).get("dilation", 1.0))
        return (ev["first_md_token"] - ev["handoff_start"]) / k
    return None


# -- per mode ---------------------------------------------------------------------------------


def mode_summary(records: Sequence[StreamRecord], sla_ttft_s: float, sla_tpot_s: float,
                 makespan_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    itl = [g for r in ok for g in r.inter_token_s()]
    tokens = {name: sum(int(r.pdd.get(key, 0) or 0) for r in ok) for name, key in PRODUCERS}
    total = sum(tokens.values())
    client_tokens = sum(len(r.token_ids) for r in ok)
    meets = [r for r in ok if r.ttft_s <= sla_ttft_s
             and (tpot_s(r) is None or tpot_s(r) <= sla_tpot_s)]
    handoffs = [h for r in ok if (h := handoff_latency_s(r.pdd)) is not None]
    return {
        "requests": len(records), "completed": len(ok),
        "errors": [r.error for r in records if r.error is not None][:5],
        "ttft_s": summary([r.ttft_s for r in ok]),
        "router_ttft_s": summary([r.pdd["ttft_s"] for r in ok if r.pdd.get("ttft_s") is not None]),
        "itl_s": summary(itl),
        "tpot_s": summary([t for r in ok if (t := tpot_s(r)) is not None]),
        "output_tokens": total, "client_tokens": client_tokens,
        "tokens_by_producer": tokens,
        "token_share": {name: (n / total if total else 0.0) for name, n in tokens.items()},
        # kept under the old names too (docs/benchmarks.md quotes them)
        "relay_token_share": tokens["relay"] / total if total else 0.0,
        "main_token_share": tokens["main_decode"] / total if total else 0.0,
        "sla": {"ttft_s": sla_ttft_s, "tpot_s": sla_tpot_s, "met": len(meets),
                "fraction": len(meets) / len(records) if records else 0.0,
                "goodput_req_s": (len(meets) / makespan_s) if makespan_s else None},
        "wan_kv_bytes": sum(int(r.pdd.get("wan_kv_bytes", 0) or 0) for r in ok),
        "handoff_bytes": sum(int(r.pdd.get("handoff_bytes", 0) or 0) for r in ok),
        "prefix_hit_tokens": sum(int(r.pdd.get("prefix_hit_tokens", 0) or 0) for r in ok),
        "handoff_latency_s": summary(handoffs),
        "handoff_modes": _count(r.pdd.get("handoff_mode") for r in ok),
        "pipelines": _count(r.pdd.get("pipeline") for r in ok),
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def ttft_ratios(summaries: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    base = summaries["same-dc"]["ttft_s"]
    out = {f"{m}/same-dc": {q: ratio(summaries[m]["ttft_s"][q], base[q])
                            for q in ("p50", "p90", "p99")}
           for m in ("pdd", "cross-dc") if m in summaries}
    if "pdd" in summaries and "cross-dc" in summaries:
        out["pdd/cross-dc"] = {q: ratio(summaries["pdd"]["ttft_s"][q],
                                        summaries["cross-dc"]["ttft_s"][q])
                               for q in ("p50", "p90", "p99")}
    return out


def md_wan_bytes_in(stats: dict[str, Any] | None) -> int:
    """Bytes MD received on all its (WAN) lanes, from its stats()."""
    if not stats:
        return 0
    return sum(int(d.get("bytes_in", 0)) for d in stats.get("lanes", {}).values())


# -- the run ----------------------------------------------------------------------------------


def agent_params(args: argparse.Namespace) -> AgentWorkloadParams:
    if args.quick:
        return AgentWorkloadParams(num_conversations=2, conversation_rate_per_s=4.0,
                                   think_time_s=0.2, num_system_prompts=1,
                                   system_prompt_len=(96, 160), task_len=(16, 48),
                                   max_turns=(2, 3), small_tool_len=(4, 16),
                                   large_tool_len=(64, 128), output_len=(4, 8))
    return AgentWorkloadParams(num_conversations=args.conversations,
                               conversation_rate_per_s=args.conversation_rate,
                               think_time_s=1.0, num_system_prompts=2,
                               system_prompt_len=(300, 800), task_len=(50, 200),
                               max_turns=(2, 4), small_tool_len=(4, 48),
                               large_tool_len=(200, 600), output_len=(8, 32),
                               max_context=3000)


def make_workloads(args: argparse.Namespace) -> dict[str, list[Any]]:
    out: dict[str, list[Any]] = {}
    if "long" in args.workloads:
        out["long"] = poisson_long_prompts(args.requests, args.rate, tuple(args.prompt_len),
                                           tuple(args.max_tokens), seed=args.seed)
    if "agent" in args.workloads:
        out["agent"] = generate_agent_workload(agent_params(args), seed=args.seed)
    return out


def cluster_overrides(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    """What a cluster of `mode` is configured with (beside the emulated devices): for checking
    the device flags against every mode before any cluster starts."""
    out = {"mode": mode, "model.name": args.model, "wan.shell": args.wan,
           "wan.rtt_ms": args.rtt_ms, "wan.jitter_ms": args.jitter_ms,
           "model.threads": args.threads, "policy.handoff": args.handoff}
    if args.bw_mbit is not None:
        out["wan.bw_mbit"] = args.bw_mbit
    return out


async def run_mode(mode: str, workloads: dict[str, list[Any]], args: argparse.Namespace,
                   show_progress: bool = True,
                   devices: DeviceSetup | None = None) -> dict[str, Any]:
    """One cluster in `mode`; every workload in turn; records, makespans and daemon stats.
    `devices`: the run's emulated devices (`drive.setup_devices`); None: from `args`' flags."""
    import aiohttp

    from pddnet.cluster.local import LocalCluster

    if devices is None:
        devices = setup_devices(args, {mode: cluster_overrides(mode, args)})
    k = devices.dilation
    overrides = {"model.threads": args.threads, "policy.handoff": args.handoff,
                 **devices.overrides}
    out: dict[str, Any] = {"records": {}, "makespan_s": {}, "makespan_wall_s": {},
                           "md_wan_bytes": {}, "stats": {}}
    async with LocalCluster(mode=mode, model=args.model, wan=args.wan, rtt_ms=args.rtt_ms,
                            jitter_ms=args.jitter_ms, bw_mbit=args.bw_mbit,
                            overrides=overrides) as cluster:
        out["wan_shell"] = cluster.wan.get("shell")
        has_md = "main_decode" in cluster.daemons
        timeout = aiohttp.ClientTimeout(total=args.request_timeout * k)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await warm_up(session, cluster.url, args.model, dilation=k)
            for name, workload in workloads.items():
                before = await cluster.stats("main_decode") if has_md else None
                t0 = time.monotonic()
                with progress(len(workload), f"{mode:>8} {name:<5}",
                              enabled=show_progress) as bar:
                    if name == "agent":
                        recs = await drive_agent(session, cluster.url, workload, args.model, bar,
                                                 dilation=k)
                    else:
                        recs = await drive_poisson(session, cluster.url, workload, args.model,
                                                   bar, dilation=k)
                wall = time.monotonic() - t0
                out["makespan_wall_s"][name] = wall
                out["makespan_s"][name] = wall / k
                out["records"][name] = recs
                after = await cluster.stats("main_decode") if has_md else None
                out["md_wan_bytes"][name] = md_wan_bytes_in(after) - md_wan_bytes_in(before)
        for role in cluster.daemons:
            out["stats"][role] = await cluster.stats(role)
    out["devices"] = device_reports({mode: out["stats"]})[mode]
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, few requests (smoke test)")
    p.add_argument("--model", default="small")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    p.add_argument("--requests", type=int, default=24, help="long-prompt requests")
    p.add_argument("--rate", type=float, default=0.5, help="Poisson arrivals per second")
    p.add_argument("--prompt-len", type=int, nargs=2, default=(256, 768), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(32, 96), metavar=("MIN", "MAX"))
    p.add_argument("--conversations", type=int, default=6, help="agent conversations")
    p.add_argument("--conversation-rate", type=float, default=0.4,
                   help="new agent conversations per second")
    p.add_argument("--sla-ttft-ms", type=float, default=1000.0)
    p.add_argument("--sla-tpot-ms", type=float, default=50.0)
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--jitter-ms", type=float, default=2.0)
    p.add_argument("--bw-mbit", type=float, default=None,
                   help="WAN rate per direction, in the modelled world when devices are "
                        "emulated (default 100; --quick: 4)")
    p.add_argument("--wan", default="proxy", choices=("auto", "kernel", "packet", "proxy"))
    p.add_argument("--handoff", default="dynamic", choices=("one-shot", "streaming", "dynamic"))
    p.add_argument("--threads", type=int, default=1, help="torch threads per daemon")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--trace", action="store_true",
                   help="also write a Chrome/Perfetto trace per mode and workload")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="results")
    device_flags.add_arguments(p)


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.requests, args.rate = "tiny", 6, 4.0
        args.prompt_len, args.max_tokens = (64, 256), (8, 16)
    if args.bw_mbit is None:    # an explicit --bw-mbit wins over --quick's 4 Mbit/s
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
    devices = setup_devices(args, {m: cluster_overrides(m, args) for m in args.modes})
    workloads = make_workloads(args)
    per_mode: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        per_mode[mode] = await run_mode(mode, workloads, args, not args.no_progress, devices)
    sla = (args.sla_ttft_ms / 1e3, args.sla_tpot_ms / 1e3)
    summaries = {w: {m: {**mode_summary(per_mode[m]["records"][w], *sla,
                                        per_mode[m]["makespan_s"][w]),
                         "md_wan_bytes": per_mode[m]["md_wan_bytes"][w]}
                     for m in args.modes} for w in workloads}
    ratios = {w: ttft_ratios(summaries[w]) for w in workloads}
    config = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()
              if k not in ("handler", "bench_spec")}
    config["wan_shell"] = {m: per_mode[m].get("wan_shell") for m in args.modes}
    config["dilation_k"] = devices.dilation
    requests = {m: [request_row(r, w) for w in workloads for r in per_mode[m]["records"][w]]
                for m in args.modes}
    reports = {m: per_mode[m]["devices"] for m in args.modes}
    path = write_result("ttft", {"config": config, "threads_per_daemon": args.threads,
                                 "workloads": summaries, "ratios": ratios,
                                 "modes": summaries.get("long") or summaries.get("agent"),
                                 "emulation": devices.to_dict(), "devices": reports,
                                 "makespan_wall_s": {m: per_mode[m]["makespan_wall_s"]
                                                     for m in args.modes},
                                 "daemon_stats": {m: per_mode[m]["stats"] for m in args.modes},
                                 "requests": requests}, args.out)
    plots = []
    for w in workloads:
        png = cdf_plot({m: [r.ttft_s for r in per_mode[m]["records"][w] if r.ttft_s is not None]
                        for m in args.modes},
                       path.with_name(f"{path.stem}-{w}-ttft-cdf.png"),
                       "TTFT (ms), measured by the client"
                       + (f" (modelled: wall / k = {devices.dilation:g})"
                          if devices.emulated else ""),
                       f"TTFT CDF, {w} workload: {' vs '.join(args.modes)} (one run)")
        if png:
            plots.append(str(png))
    traces = []
    if args.trace:
        from pddnet.obs.trace import write_trace

        for m in args.modes:
            for w in workloads:
                recs = [r for r in per_mode[m]["records"][w] if r.pdd.get("timeline")]
                if recs:
                    traces.append(str(write_trace(
                        path.with_name(f"{path.stem}-{m}-{w}.trace.json"),
                        [r.pdd for r in recs], {r.pdd["request_id"]: r.token_times
                                                for r in recs})))
    print_table(summaries, ratios, args, path, plots + traces, devices)
    warnings = print_validity(reports, "ttft")
    return {"path": str(path), "workloads": summaries, "ratios": ratios, "plots": plots,
            "traces": traces, "devices": reports, "warnings": warnings}


def print_table(summaries: dict[str, Any], ratios: dict[str, Any], args: argparse.Namespace,
                path: Path, files: list[str], devices: DeviceSetup | None = None) -> None:
    def ms(v: float | None) -> str:
        return f"{'-':>8}" if v is None else f"{v * 1e3:8.1f}"

    print(f"\nTTFT benchmark: model {args.model}, WAN {args.wan} shell rtt {args.rtt_ms} ms "
          f"jitter {args.jitter_ms} ms bw {args.bw_mbit} Mbit/s, {args.threads} torch "
          f"thread(s) per daemon; SLA TTFT <= {args.sla_ttft_ms:g} ms, TPOT <= "
          f"{args.sla_tpot_ms:g} ms")
    print((devices or UNPACED).line())
    for w, per_mode in summaries.items():
        print(f"\n[{w}] {'mode':>8} {'ok':>5} {'TTFT p50':>8} {'p90':>8} {'p99':>8} "
              f"{'ITL p50':>8} {'ITL p99':>8} {'SLA met':>7} {'RLD':>6} {'MD':>6}  (ms)")
        for mode, s in per_mode.items():
            t, i = s["ttft_s"], s["itl_s"]
            share = s["token_share"]
            print(f"{'':>{len(w) + 2}} {mode:>8} {s['completed']:>2}/{s['requests']:<2} "
                  f"{ms(t['p50'])} {ms(t['p90'])} {ms(t['p99'])} {ms(i['p50'])} {ms(i['p99'])} "
                  f"{s['sla']['fraction']:7.0%} {share['relay']:6.1%} {share['main_decode']:6.1%}")
        for name, r in ratios[w].items():
            parts = ", ".join(f"{q} {v:.2f}x" for q, v in r.items() if v is not None)
            print(f"  TTFT {name}: {parts}")
    print(f"\nwrote {path}")
    for f in files:
        print(f"wrote {f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        asyncio.run(run(args))
    except ValueError as exc:
        p.error(str(exc))
    return 0

