"""drc: WAN KV bytes and TTFT with and without the decode-side RadixCache, on the multi-turn agent
workload, over the source's seven hit-rate intervals.

Two clusters, one after the other, on the same seeded workload, model and emulated WAN: MD with
its radix tree (`main_decode.prefix_cache = "radix"`) and without (`"off"`). Every request is
sent P->MD (`policy.pipeline = "p_md"`) so that both runs ship every request's KV to MD and the
byte counts compare DRC alone (with the pipeline policy free to choose, DRC's smaller transfers
would also change pipelines; that is the ttft benchmark's business). Greedy decoding with
ignore_eos makes the two runs' prompts identical, so requests pair up by index; each is binned
by the hit MD really had in the DRC run.

With emulated devices (--target-model, --device ROLE=CHIP[:GPUS], --dilation K|auto) both
clusters run paced at one k: conversation arrivals and think times are stretched by k, TTFTs are
modelled (/ k), and the JSON's `devices` says per variant how well the box kept up. Each run's
ttft, tpot, itl, e2el, request_goodput and output_throughput are reported under vLLM's names
(`serving`; pddnet.bench.metrics).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path
from typing import Any

from pddnet.bench import metrics
from pddnet.bench.options import add_run_arguments, add_wan_arguments
from pddnet.bench.results import percentile, write_result
from pddnet.device import flags as device_flags
from pddnet.kv.hit_histogram import HIT_INTERVAL_LABELS, hit_interval
from pddnet.workload.agent import AgentWorkloadParams, generate_agent_workload
from pddnet.workload.hits import hit_distribution, ideal_hit_ratios

QUICK = AgentWorkloadParams(
    num_conversations=4,
    conversation_rate_per_s=6.0,
    think_time_s=0.2,
    max_turns=(4, 6),
    large_tool_len=(200, 600),
)
FULL = AgentWorkloadParams(num_conversations=40, conversation_rate_per_s=2.0, think_time_s=1.0)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a few conversations (smoke test)")
    p.add_argument(
        "--conversations",
        type=int,
        default=None,
        help="agent conversations (default: 40, or 4 with --quick)",
    )
    p.add_argument("--model", default="tiny", help="model preset (tiny: 1 KiB KV per token)")
    add_wan_arguments(p, wan="auto", rtt_ms=30.0, shaped=False)
    p.add_argument("--bw-mbit", type=float, default=1000.0)
    p.add_argument(
        "--md-blocks",
        type=int,
        default=8192,
        help="MD's KV pool in blocks of 16 (room for the conversations' prefixes)",
    )
    add_run_arguments(p)
    metrics.add_arguments(p)
    device_flags.add_arguments(p)


def variant_overrides(args: argparse.Namespace, prefix_cache: str) -> dict[str, Any]:
    return {
        "policy.pipeline": "p_md",
        "main_decode.prefix_cache": prefix_cache,
        "main_decode.num_blocks": args.md_blocks,
        "prefill.num_blocks": 2048,
        "model.threads": 1,
    }


async def run_variant(
    args: argparse.Namespace,
    workload: list,
    prefix_cache: str,
    show_progress: bool,
    devices: Any = None,
    overrides: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One cluster, MD's cache `prefix_cache`, every request P->MD; `overrides`: more config
    settings (e.g. pool sizes) over the variant's."""
    import aiohttp

    from pddnet.bench.devices import UNPACED, daemon_stats
    from pddnet.bench.drive import drive, warm_up
    from pddnet.bench.progress import progress
    from pddnet.cluster.local import LocalCluster

    devices = devices or UNPACED
    k = devices.dilation
    overrides = {
        **variant_overrides(args, prefix_cache),
        **(overrides or {}),
        **devices.overrides,
    }
    async with LocalCluster(
        mode="pdd",
        model=args.model,
        wan=args.wan,
        rtt_ms=args.rtt_ms,
        jitter_ms=0.0,
        bw_mbit=args.bw_mbit,
        overrides=overrides,
    ) as cluster:
        timeout = aiohttp.ClientTimeout(total=600 * k)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await warm_up(session, cluster.url, args.model, dilation=k)
            t0 = time.monotonic()
            with progress(len(workload), f"drc {prefix_cache}", enabled=show_progress) as bar:
                records = await drive(session, cluster.url, workload, args.model, bar, dilation=k)
            duration = (time.monotonic() - t0) / k
        stats = await daemon_stats(cluster)
        shell = cluster.wan.get("shell")
    errors = [r.error for r in records if r.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(records)} requests failed, e.g. {errors[0]}")
    return {
        "records": records,
        "md": stats["main_decode"],
        "prefill": stats["prefill"],
        "stats": stats,
        "shell": shell,
        "duration": duration,
    }


def prompt_tokens(pdd: dict[str, Any]) -> int:
    """The prompt length the router recorded at the request's arrival."""
    for e in pdd.get("timeline", []):
        if e["event"] == "arrival" and isinstance(e["detail"], int):
            return e["detail"]
    raise RuntimeError(f"request {pdd.get('request_id')} has no arrival event in its timeline")


def compare(records_on: list[Any], records_off: list[Any]) -> dict[str, Any]:
    """The two runs' requests paired by index (the same prompts: greedy decoding with
    ignore_eos), each binned by the hit MD really had with its cache: WAN KV bytes with and
    without the cache, overall and per hit interval, and the hits measured."""
    rows = []
    for rec_on, rec_off in zip(records_on, records_off, strict=True):
        if rec_on.token_ids != rec_off.token_ids:
            raise RuntimeError("the two runs produced different tokens for the same request")
        hit = rec_on.pdd.get("prefix_hit_tokens", 0)
        prompt = prompt_tokens(rec_on.pdd)
        rows.append(
            {
                "prompt_tokens": prompt,
                "hit_tokens": hit,
                "interval": hit_interval(hit / prompt),
                "bytes_drc": rec_on.pdd.get("wan_kv_bytes", 0),
                "bytes_no_drc": rec_off.pdd.get("wan_kv_bytes", 0),
                "ttft_ms_drc": rec_on.ttft_s * 1e3,
                "ttft_ms_no_drc": rec_off.ttft_s * 1e3,
            }
        )
    total_on = sum(r["bytes_drc"] for r in rows)
    total_off = sum(r["bytes_no_drc"] for r in rows)
    counts = [sum(r["interval"] == i for r in rows) for i in range(len(HIT_INTERVAL_LABELS))]
    return {
        "requests": len(rows),
        "mean_hit": sum(r["hit_tokens"] / r["prompt_tokens"] for r in rows) / len(rows),
        "hit_distribution_measured": {
            label: c / len(rows) for label, c in zip(HIT_INTERVAL_LABELS, counts, strict=True)
        },
        "wan_kv_bytes_drc": total_on,
        "wan_kv_bytes_no_drc": total_off,
        "byte_reduction": (total_off / total_on) if total_on else None,
        "per_interval": _per_interval(rows),
        "rows": rows,
    }


def _per_interval(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for i, label in enumerate(HIT_INTERVAL_LABELS):
        sel = [r for r in rows if r["interval"] == i]
        on = sum(r["bytes_drc"] for r in sel)
        off = sum(r["bytes_no_drc"] for r in sel)
        out[label] = {
            "requests": len(sel),
            "bytes_drc": on,
            "bytes_no_drc": off,
            "reduction": (off / on) if on else None,
            "median_ttft_ms_drc": percentile([r["ttft_ms_drc"] for r in sel], 50),
            "median_ttft_ms_no_drc": percentile([r["ttft_ms_no_drc"] for r in sel], 50),
        }
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from pddnet.bench.devices import device_reports, print_validity, setup_devices

    slos = metrics.goodput_config(args)

    params = QUICK if args.quick else FULL
    if args.conversations:
        params = dataclasses.replace(params, num_conversations=args.conversations)
    base = {
        "mode": "pdd",
        "model.name": args.model,
        "wan.shell": args.wan,
        "wan.rtt_ms": args.rtt_ms,
        "wan.bw_mbit": args.bw_mbit,
    }
    devices = setup_devices(
        args, {v: {**base, **variant_overrides(args, v)} for v in ("radix", "off")}
    )
    workload = generate_agent_workload(params, seed=args.seed)
    ideal = hit_distribution(ideal_hit_ratios(workload))
    show = not args.no_progress
    on = await run_variant(args, workload, "radix", show, devices)
    off = await run_variant(args, workload, "off", show, devices)
    reports = device_reports({"radix": on["stats"], "off": off["stats"]})
    compared = compare(on["records"], off["records"])
    result = {
        "config": {
            "model": args.model,
            "wan_shell": on["shell"],
            "rtt_ms": args.rtt_ms,
            "bw_mbit": args.bw_mbit,
            "md_blocks": args.md_blocks,
            "seed": args.seed,
            "pipeline": "p_md",
            "torch_threads_per_daemon": 1,
            "workload": dataclasses.asdict(params),
            "target_model": getattr(args, "target_model", None),
            "device": getattr(args, "device", []),
            "dilation": getattr(args, "dilation", None),
            "dilation_k": devices.dilation,
            "goodput_slos_ms": slos,
            "metric_percentiles": args.metric_percentiles,
        },
        "emulation": devices.to_dict(),
        "devices": reports,
        "devices_line": devices.line(),
        **compared,
        "hit_distribution_ideal": ideal,
        # vLLM's serving metrics of each run (pddnet.bench.metrics)
        "serving": {
            "drc": metrics.serving_metrics(
                on["records"], on["duration"], slos, args.metric_percentiles
            ),
            "no_drc": metrics.serving_metrics(
                off["records"], off["duration"], slos, args.metric_percentiles
            ),
        },
        "md_drc_stats": on["md"].get("drc"),
        "p_view": on["prefill"].get("planner", {}).get("view"),
    }
    path = write_result("drc", result, args.out)
    result["path"] = str(path)
    result["plots"] = _plots(result, path)
    print_table(result)
    result["warnings"] = print_validity(reports, "drc")
    return result


def _plots(result: dict[str, Any], path: Path) -> list[str]:
    from pddnet.bench.plots import grouped_bars

    out = []
    per = result["per_interval"]
    mib = {
        label: {"with DRC": v["bytes_drc"] / 2**20, "without DRC": v["bytes_no_drc"] / 2**20}
        for label, v in per.items()
        if v["requests"]
    }
    p = grouped_bars(
        mib,
        path.with_name(path.stem + "-bytes.png"),
        "WAN KV MiB",
        f"WAN KV bytes by MD hit interval (reduction {result['byte_reduction'] or 0:.1f}x)",
    )
    if p is not None:
        out.append(str(p))
    share = {
        label: {
            "measured": result["hit_distribution_measured"][label] * 100,
            "ideal cache": result["hit_distribution_ideal"][label] * 100,
        }
        for label in HIT_INTERVAL_LABELS
    }
    p = grouped_bars(
        share,
        path.with_name(path.stem + "-hits.png"),
        "% of requests",
        "prefix hit distribution (source intervals)",
    )
    if p is not None:
        out.append(str(p))
    return out


def print_table(r: dict[str, Any]) -> None:
    print(
        f"\ndrc: {r['requests']} requests, mean MD hit {r['mean_hit']:.3f}, "
        f"WAN {r['config']['wan_shell']} {r['config']['rtt_ms']:g} ms "
        f"{r['config']['bw_mbit']:g} Mbit/s, model {r['config']['model']}, 1 torch thread/daemon"
    )
    if r.get("devices_line"):
        print(r["devices_line"])
    print(
        f"{'hit interval':<12} {'share':>7} {'ideal':>7} {'KV MiB DRC':>11} "
        f"{'no DRC':>9} {'ratio':>7} {'median_ttft DRC':>15} {'no DRC':>8}"
    )
    for label, v in r["per_interval"].items():
        ratio = f"{v['reduction']:.1f}x" if v["reduction"] else "-"
        t_on, t_off = v["median_ttft_ms_drc"], v["median_ttft_ms_no_drc"]
        print(
            f"{label:<12} {r['hit_distribution_measured'][label]:>7.1%} "
            f"{r['hit_distribution_ideal'][label]:>7.1%} {v['bytes_drc'] / 2**20:>11.2f} "
            f"{v['bytes_no_drc'] / 2**20:>9.2f} {ratio:>7} "
            f"{'-' if t_on is None else f'{t_on:.0f} ms':>15} "
            f"{'-' if t_off is None else f'{t_off:.0f} ms':>8}"
        )
    red = r["byte_reduction"]
    print(
        f"total WAN KV: {r['wan_kv_bytes_drc'] / 2**20:.1f} MiB with DRC vs "
        f"{r['wan_kv_bytes_no_drc'] / 2**20:.1f} MiB without: "
        f"{'-' if red is None else f'{red:.1f}x'} fewer bytes"
    )
    print(
        "vLLM's serving metrics of the two runs (ms; request_goodput req/s under "
        f"{metrics.goodput_label(r['config']['goodput_slos_ms'])}, output_throughput tok/s):"
    )
    metrics.print_columns(
        [("DRC", r["serving"]["drc"]), ("no DRC", r["serving"]["no_drc"])],
        metrics.serving_columns(r["config"]["metric_percentiles"]),
        label="run",
    )
    print(f"results: {r['path']}")
