"""Handoff-mode benchmark: one-shot vs streaming vs dynamic over RLD backlogs of 8..512 tokens.

The backlog is how many tokens RLD has made when MD's KV copy is complete (TAKEOVER). It is
set here the way it arises in production: by how long MD's copy takes to cross the WAN. One
PDD cluster runs throughout; before each backlog size the WAN's rate is changed through the
emulator's control API so that a prompt's KV crosses in about `backlog x decode step` (the
step measured by a calibration request), and every mode is then run on that link, one request
at a time (per-request `handoff_mode`), each with a fresh prompt. Measured per request:

- stall: the largest gap between consecutive tokens the client received from the TAKEOVER
  (token index = backlog) to a few tokens after MD took over -- the step MD spends digesting
  what it was handed (one-shot: everything at once; streaming: at most `chunk` per step);
- RLD occupancy: token-seconds of KV RLD held, from its copy landing to its last token
  (prompt + tokens made so far, integrated over the client's token arrival times);
- handoff duration: handoff_start (RLD) -> first_md_token (MD);
- the backlog actually reached (handoff_start's detail) -- plotted on the x axis;
- vLLM's per-request metrics beside them (ttft_ms, tpot_ms, e2el_ms, median_itl_ms; per mode
  their stats under vLLM's names in `serving`, pddnet.bench.metrics).

With emulated devices (--target-model, --device ROLE=CHIP[:GPUS], --dilation K|auto) the
cluster runs paced at k: every time above is modelled (/ k), the calibrated decode step too;
the WAN rates set through the control API are computed on this box's clock and real bytes
(the step in wall seconds, the small model's KV) and reported as the modelled line's rate
(x k / the wire scale) beside the rate the emulator really ran (`wall_rate_mbit`);
--max-rate-mbit caps the modelled rate.
"""

from __future__ import annotations

import argparse
import random
import statistics
from typing import Any

from pddnet.bench import metrics
from pddnet.bench.client import StreamRecord, stream_completion
from pddnet.bench.devices import (
    UNPACED,
    DeviceSetup,
    daemon_stats,
    device_report,
    setup_devices,
)
from pddnet.bench.drive import warm_up
from pddnet.bench.options import add_run_arguments, add_wan_arguments
from pddnet.bench.plots import panels_plot
from pddnet.bench.progress import progress
from pddnet.bench.results import closing, run_config, write_result
from pddnet.device import flags as device_flags
from pddnet.model.cli import add_model_argument

MODES = ("one-shot", "streaming", "dynamic")
STALL_TAIL_TOKENS = 8  # tokens after the cut that still count as "around the handoff"


# -- per request (pure) -----------------------------------------------------------------------


def _events(pdd: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for e in pdd.get("timeline", []):
        out.setdefault(e["event"], e)
    return out


def _value(detail: Any) -> int | None:
    if isinstance(detail, dict):
        return detail.get("value")
    return detail if isinstance(detail, int) else None


def handoff_metrics(rec: StreamRecord, prompt_len: int) -> dict[str, Any]:
    """The handoff figures of one completed PDD request (see the module docstring); times
    in the modelled world (the record's raw times / its dilation)."""
    pdd, times = rec.pdd, rec.token_times
    ev = _events(pdd)
    relay = int(pdd.get("relay_tokens", 0))
    start = ev.get("handoff_start")
    backlog = _value(start["detail"]) if start else None
    out: dict[str, Any] = {
        "ok": rec.error is None,
        "error": rec.error,
        "num_tokens": len(rec.token_ids),
        "relay_tokens": relay,
        "main_tokens": int(pdd.get("main_tokens", 0)),
        "mode_used": pdd.get("handoff_mode"),
        "backlog": backlog,
        "handed_off": int(pdd.get("main_tokens", 0)) > 0 and backlog is not None,
        "handoff_bytes": pdd.get("handoff_bytes"),
        "stall_s": None,
        "rld_occupancy_token_s": None,
        "handoff_s": None,
        # vLLM's per-request metrics (pddnet.bench.metrics), ms
        "ttft_ms": None if rec.ttft_s is None else rec.ttft_s * 1e3,
        "tpot_ms": None if (tpot := metrics.tpot_s(rec)) is None else tpot * 1e3,
        "e2el_ms": None if (e2el := metrics.e2el_s(rec)) is None else e2el * 1e3,
        "median_itl_ms": None,
    }
    gaps = rec.inter_token_s()
    if gaps:
        out["median_itl_ms"] = statistics.median(gaps) * 1e3
    if backlog is not None and times:
        lo = max(1, min(backlog, relay))  # gap i is token i-1 -> token i
        hi = min(len(times) - 1, relay + STALL_TAIL_TOKENS)
        window = [rec.span_s(times[i - 1], times[i]) for i in range(lo, hi + 1)]
        out["stall_s"] = max(window) if window else None
    landed = ev.get("rld_kv_complete")
    if landed is not None and 0 < relay <= len(times):
        held, t_prev = float(prompt_len), float(landed["time"])
        occupancy = 0.0
        for i in range(relay):  # RLD holds prompt + i tokens until token i is out
            t = times[i]
            occupancy += held * max(0.0, t - t_prev)
            held, t_prev = prompt_len + i + 1.0, t
        out["rld_occupancy_token_s"] = occupancy / rec.dilation
    if start is not None and "first_md_token" in ev:
        out["handoff_s"] = rec.span_s(start["time"], ev["first_md_token"]["time"])
    return out


def rate_for_backlog(
    target: int, baseline: int, step_s: float, kv_bytes: int, max_rate_mbit: float
) -> float | None:
    """WAN rate (Mbit/s) at which `kv_bytes` cross in the time RLD needs for the backlog
    tokens beyond `baseline` (what it makes anyway on an unlimited link); None = unlimited."""
    extra_s = (target - baseline) * step_s
    if extra_s <= 0:
        return None
    return min(max_rate_mbit, kv_bytes * 8 / extra_s / 1e6)


def fresh_prompt(rng: random.Random, length: int) -> list[int]:
    return [256] + [rng.randrange(256) for _ in range(length - 1)]


# -- the run ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args)
    check_args(args)
    import aiohttp

    from emulation.control import ControlClient
    from pddnet.cluster.local import LocalCluster
    from pddnet.model.config import PRESETS

    kv_per_token = PRESETS[args.model].kv_bytes_per_token if args.model in PRESETS else None
    overrides = {
        "model.threads": args.threads,
        "policy.handoff_chunk": args.chunk,
        "policy.handoff_threshold_tokens": args.threshold,
        "policy.handoff": "dynamic",
        # every request must go through RLD: the pipeline policy would send a small
        # KV straight to MD, and there would be no handoff to measure
        "policy.pipeline": "p_rld_md",
    }
    devices = setup_devices(
        args,
        {
            "handoff-mode": {
                "mode": "pdd",
                "model.name": args.model,
                "wan.shell": args.wan,
                "wan.rtt_ms": args.rtt_ms,
                **overrides,
            }
        },
    )
    k = devices.dilation
    rng = random.Random(args.seed)
    rows: list[dict[str, Any]] = []
    records: dict[str, list[StreamRecord]] = {m: [] for m in args.modes}
    calibration: dict[str, Any] = {}
    async with LocalCluster(
        mode="pdd",
        model=args.model,
        wan=args.wan,
        rtt_ms=args.rtt_ms,
        bw_mbit=None,
        overrides={**overrides, **devices.overrides},
    ) as cluster:
        control = ControlClient(cluster.wan["control_url"])
        timeout = aiohttp.ClientTimeout(total=args.request_timeout * k)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await warm_up(session, cluster.url, args.model, dilation=k)

            async def one(mode: str, max_tokens: int) -> StreamRecord:
                body = {
                    "model": args.model,
                    "prompt": fresh_prompt(rng, args.prompt_len),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "handoff_mode": mode,
                }
                return await stream_completion(session, cluster.url, body, dilation=k)

            # Calibration on the unlimited link: the decode step, and the backlog RLD reaches
            # anyway (prefill-to-copy overlap plus the round trip). The rates below are set on
            # the emulator, so they are computed on its terms: wall seconds and real KV bytes.
            cal = await one("one-shot", 64)
            if cal.error is not None:
                raise RuntimeError(f"calibration request failed: {cal.error}")
            m = handoff_metrics(cal, args.prompt_len)
            times = cal.token_times
            step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.01 * k
            baseline = m["backlog"] or 0
            kv_bytes = int(cal.pdd.get("wan_kv_bytes") or (kv_per_token or 1024) * args.prompt_len)
            max_rate = devices.wall_rate_mbit(args.max_rate_mbit)
            calibration = {
                "step_s": step / k,
                "step_wall_s": step,
                "baseline_backlog": baseline,
                "kv_bytes": kv_bytes,
                "wire_scale": devices.wire_scale,
            }
            total = len(args.backlogs) * len(args.modes) * args.repeats
            with progress(total, "handoff-mode", enabled=not args.no_progress) as bar:
                for target in args.backlogs:
                    wall_rate = rate_for_backlog(target, baseline, step, kv_bytes, max_rate)
                    rate = None if wall_rate is None else devices.modelled_rate_mbit(wall_rate)
                    await control.set("both", rate_mbit=wall_rate)
                    # room for the backlog overshooting its target and for streaming's
                    # catch-up, so that MD always takes over before the request ends
                    max_tokens = 2 * target + 64
                    for rep in range(args.repeats):
                        for mode in args.modes:
                            rec = await one(mode, max_tokens)
                            records[mode].append(rec)
                            row = {
                                "target_backlog": target,
                                "rate_mbit": rate,
                                "wall_rate_mbit": wall_rate,
                                "mode": mode,
                                "repeat": rep,
                                "max_tokens": max_tokens,
                                **handoff_metrics(rec, args.prompt_len),
                                "pdd": rec.pdd,
                                "token_times": rec.token_times,
                                "dilation": rec.dilation,
                            }
                            rows.append(row)
                            bar.update(1)
                            if row["stall_s"] is not None:
                                bar.set_postfix(
                                    backlog=row["backlog"],
                                    mode=mode,
                                    stall=f"{row['stall_s'] * 1e3:.0f}ms",
                                )
            await control.clear("both")
        stats = await daemon_stats(cluster)
    return finish(
        args, rows, calibration, stats["main_decode"], stats["relay"], stats, devices, records
    )


def aggregate(rows: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, Any]]:
    """Per mode, per target backlog: means over repeats of the measured figures."""
    out: dict[str, dict[str, Any]] = {}
    keys = (
        "backlog",
        "stall_s",
        "rld_occupancy_token_s",
        "handoff_s",
        "median_itl_ms",
        "ttft_ms",
        "tpot_ms",
        "relay_tokens",
        "handoff_bytes",
    )
    for mode in modes:
        per: dict[str, Any] = {}
        for target in sorted({r["target_backlog"] for r in rows}):
            sel = [
                r
                for r in rows
                if r["mode"] == mode
                and r["target_backlog"] == target
                and r["ok"]
                and r["handed_off"]
            ]
            entry: dict[str, Any] = {
                "n": len(sel),
                "modes_used": sorted({str(r["mode_used"]) for r in sel}),
            }
            for k in keys:
                vals = [r[k] for r in sel if r[k] is not None]
                entry[k] = sum(vals) / len(vals) if vals else None
            per[str(target)] = entry
        out[mode] = per
    return out


def threshold_finding(agg: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Where streaming starts to pay: the smallest backlog at which one-shot's stall exceeds
    streaming's, and what streaming costs there in RLD occupancy."""
    one, stream = agg.get("one-shot"), agg.get("streaming")
    if not one or not stream:
        return {}
    rows = []
    for target in one:
        a, b = one[target], stream.get(target, {})
        if a.get("stall_s") and b.get("stall_s"):
            rows.append(
                {
                    "target_backlog": int(target),
                    "backlog": a["backlog"],
                    "stall_ratio_oneshot_over_streaming": a["stall_s"] / b["stall_s"],
                    "occupancy_ratio_streaming_over_oneshot": (
                        b["rld_occupancy_token_s"] / a["rld_occupancy_token_s"]
                    )
                    if a.get("rld_occupancy_token_s") and b.get("rld_occupancy_token_s")
                    else None,
                }
            )
    crossing = next((r for r in rows if r["stall_ratio_oneshot_over_streaming"] > 1.0), None)
    return {
        "by_backlog": rows,
        "streaming_pays_from_backlog": crossing["backlog"] if crossing else None,
    }


def finish(
    args: argparse.Namespace,
    rows: list[dict[str, Any]],
    calibration: dict[str, Any],
    md_stats: dict[str, Any],
    relay_stats: dict[str, Any],
    stats: dict[str, dict[str, Any]] | None = None,
    devices: DeviceSetup | None = None,
    records: dict[str, list[StreamRecord]] | None = None,
) -> dict[str, Any]:
    devices = devices or UNPACED
    stats = stats or {"main_decode": md_stats, "relay": relay_stats}
    report = device_report(stats)
    agg = aggregate(rows, list(args.modes))
    finding = threshold_finding(agg)
    config = run_config(args)
    consistency = {
        "tokens_complete": all(
            r["relay_tokens"] + r["main_tokens"] == r["max_tokens"] for r in rows if r["ok"]
        ),
        "md_max_extend_tokens": md_stats.get("max_extend_tokens", {}),
        "streaming_extend_within_chunk": md_stats.get("max_extend_tokens", {}).get("streaming", 0)
        <= args.chunk,
        "not_handed_off": sum(1 for r in rows if r["ok"] and not r["handed_off"]),
        "errors": [r["error"] for r in rows if not r["ok"]][:5],
    }
    config["dilation_k"] = devices.dilation
    # vLLM's per-request latency stats per handoff mode, over every backlog (requests run one
    # at a time here, so no throughput: duration None)
    serving = {
        mode: {
            k: v
            for k, v in metrics.serving_metrics(
                recs, None, None, getattr(args, "metric_percentiles", metrics.DEFAULT_PERCENTILES)
            ).items()
            if k.endswith("_ms") or k in ("completed", "failed", "total_output_tokens")
        }
        for mode, recs in (records or {}).items()
    }
    path = write_result(
        "handoff-mode",
        {
            "config": config,
            "threads_per_daemon": args.threads,
            "calibration": calibration,
            "by_mode": agg,
            "serving": serving,
            "threshold": finding,
            "consistency": consistency,
            "emulation": devices.to_dict(),
            "devices": report,
            "requests": rows,
            "daemon_stats": stats,
        },
        args.out,
    )
    series: dict[str, dict[str, tuple[list[float], list[float]]]] = {}
    for key in ("stall_s", "rld_occupancy_token_s", "handoff_s"):
        series[key] = {}
        for mode, per in agg.items():
            pts = sorted(
                (e["backlog"], e[key])
                for e in per.values()
                if e["backlog"] is not None and e[key] is not None
            )
            scale = 1.0 if key == "rld_occupancy_token_s" else 1e3
            series[key][mode] = ([p[0] for p in pts], [p[1] * scale for p in pts])
    png = panels_plot(
        [
            ("largest inter-token stall (ms)", series["stall_s"]),
            ("RLD occupancy (token-seconds)", series["rld_occupancy_token_s"]),
            ("handoff duration (ms)", series["handoff_s"]),
        ],
        path.with_suffix(".png"),
        "RLD backlog at TAKEOVER (tokens)",
        f"Handoff modes, model {args.model}, chunk {args.chunk} "
        f"(dynamic threshold {args.threshold})",
        logx=True,
    )
    print_table(args, agg, finding, consistency, calibration, devices.line(), serving)
    return {
        **closing(path, png, {"": report}, "handoff-mode"),
        "by_mode": agg,
        "serving": serving,
        "threshold": finding,
        "consistency": consistency,
        "devices": report,
    }


def print_table(
    args: argparse.Namespace,
    agg: dict[str, Any],
    finding: dict[str, Any],
    consistency: dict[str, Any],
    calibration: dict[str, Any],
    devices_line: str | None = None,
    serving: dict[str, dict[str, Any]] | None = None,
) -> None:
    def f(v: float | None, scale: float = 1e3, fmt: str = "7.1f") -> str:
        return f"{'-':>7}" if v is None else format(v * scale, fmt)

    print(
        f"\nhandoff-mode benchmark: model {args.model}, prompt {args.prompt_len} tokens, "
        f"chunk {args.chunk}, dynamic threshold {args.threshold}; decode step "
        f"{calibration['step_s'] * 1e3:.1f} ms, baseline backlog "
        f"{calibration['baseline_backlog']} tokens"
    )
    if devices_line:
        print(devices_line)
    print(
        f"{'target':>6} {'mode':>9} {'backlog':>7} {'stall':>7} {'handoff':>7} "
        f"{'RLD tok-s':>9} {'used':>10} {'median_itl':>10}   (ms)"
    )
    for target in (str(b) for b in args.backlogs):
        for mode in args.modes:
            e = agg[mode][target]
            print(
                f"{target:>6} {mode:>9} {f(e['backlog'], 1, '7.0f')} {f(e['stall_s'])} "
                f"{f(e['handoff_s'])} {f(e['rld_occupancy_token_s'], 1, '9.1f')} "
                f"{','.join(e['modes_used']):>10} {f(e['median_itl_ms'], 1, '10.1f')}"
            )
    for r in finding.get("by_backlog", []):
        occ = r["occupancy_ratio_streaming_over_oneshot"]
        print(
            f"  backlog {r['backlog']:.0f}: one-shot stall / streaming stall "
            f"{r['stall_ratio_oneshot_over_streaming']:.2f}x"
            + (f", streaming RLD occupancy / one-shot {occ:.2f}x" if occ else "")
        )
    if finding:
        print(
            f"  streaming's stall is below one-shot's from backlog "
            f"{finding['streaming_pays_from_backlog']} on (dynamic's threshold: "
            f"{args.threshold})"
        )
    print(f"  MD's largest extend per mode: {consistency['md_max_extend_tokens']}")
    if serving:
        print("  vLLM's per-request metrics per handoff mode, over every backlog (ms):")
        pct = [
            float(k[1 : -len("_itl_ms")])
            for k in next(iter(serving.values()))
            if k.startswith("p") and k.endswith("_itl_ms")
        ]
        cols = [
            c for c in metrics.serving_columns(pct, goodput=False) if c[0] != "output_throughput"
        ]
        metrics.print_columns(list(serving.items()), cols, indent="  ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, two backlogs (smoke test)")
    add_model_argument(p, default="small")
    p.add_argument("--backlogs", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--chunk", type=int, default=16, help="policy.handoff_chunk")
    p.add_argument("--threshold", type=int, default=64, help="policy.handoff_threshold_tokens")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--max-rate-mbit",
        type=float,
        default=10000.0,
        help="cap on the WAN rate set per backlog (modelled when devices are emulated)",
    )
    add_wan_arguments(p, wan="proxy", rtt_ms=10.0, shaped=False)
    p.add_argument("--request-timeout", type=float, default=300.0)
    add_run_arguments(p, threads="torch threads per daemon")
    metrics.add_arguments(p, goodput=False)
    device_flags.add_arguments(p)


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.backlogs, args.prompt_len, args.repeats = "tiny", [8, 96], 128, 1


def check_args(args: argparse.Namespace) -> None:
    if not args.backlogs or min(args.backlogs) < 1 or args.repeats < 1 or args.chunk < 1:
        raise ValueError("--backlogs must be >= 1 and --repeats, --chunk >= 1")
    if args.prompt_len < 2:
        raise ValueError(f"--prompt-len must be >= 2, got {args.prompt_len}")
