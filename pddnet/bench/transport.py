"""Transport benchmark: what pddnet's own plumbing costs, each part against its ideal, in one run.

1. shm: P's one-sided write of a request's KV into RLD's shared-memory pool
   (`RemoteKVRegion.write`: bounds checks + scatter into blocks) vs a plain memcpy of the same
   bytes (into private memory, and into the shared mapping). Checked: the region reads back
   exactly what was written.
2. WAN: bulk TCP goodput through the proxy-shell emulator vs the link's configured rate.
3. decode: end-to-end output_throughput (output tokens / s, vLLM's name) of a same-dc pddnet
   cluster (router + P + one decode daemon, separate processes) vs the reference Engine in one
   process, same requests (greedy), with the cluster's requests' ttft, tpot, itl and e2el
   (pddnet.bench.metrics). Checked: both produce the same tokens.

Emulated devices (--target-model, --device ROLE=CHIP[:GPUS], --dilation K|auto) apply to part 3
only, the one part that runs a cluster: parts 1 and 2 measure this box's own plumbing (a memcpy,
a proxy's goodput against its own configured rate) and have no device to pace. Paced, the
cluster's output_throughput is modelled (duration / k) and its ideal is no longer the CPU
reference (which still runs, for the token check) but the modelled devices:
`daemon_over_device_busy` is the devices' summed modelled compute time over the cluster's
modelled duration (1 = nothing but device time; it can exceed 1 where P's and the decode
instance's work overlapped).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from pddnet.bench.devices import (
    UNPACED,
    DeviceSetup,
    daemon_stats,
    device_report,
    setup_devices,
)
from pddnet.bench.drive import warm_up
from pddnet.bench.metrics import DEFAULT_PERCENTILES, serving_metrics
from pddnet.bench.metrics import add_arguments as add_metric_arguments
from pddnet.bench.options import add_run_arguments, add_wan_arguments
from pddnet.bench.plots import grouped_bars
from pddnet.bench.progress import progress
from pddnet.bench.results import closing, run_config, write_result
from pddnet.device import flags as device_flags
from pddnet.model.cli import add_model_argument

# -- 1. shared memory -----------------------------------------------------------------------


def bench_shm(model: str, tokens: int, repeats: int) -> dict[str, Any]:
    import torch

    from pddnet.kv.pool import KVPool, KVSpec
    from pddnet.kv.shm import unique_segment_name
    from pddnet.kv.transfer import export_kv
    from pddnet.model.config import ModelConfig
    from pddnet.transport.backends.shm import RemoteKVRegion

    spec = KVSpec.from_model_config(ModelConfig.preset(model), block_size=16)
    n_blocks = spec.num_blocks_for(tokens)
    table = list(range(n_blocks))
    src = KVPool(spec, n_blocks)
    gen = torch.Generator().manual_seed(0)
    src.data.copy_(torch.randn(src.data.shape, generator=gen, dtype=torch.float32))
    exported = export_kv(src, table, 0, tokens)
    payload = exported.kv.contiguous().view(-1).view(torch.uint8)
    nbytes = payload.numel()
    owner = KVPool(spec, n_blocks, shm_name=unique_segment_name("bench"))
    try:
        region = RemoteKVRegion.attach(owner.shm_name or "")
        try:
            private = torch.empty_like(payload)
            shared = owner.raw_bytes()[:nbytes]

            def timed(fn: Any) -> float:
                fn()  # first touch (page faults) is not what we measure
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                return statistics.median(times)

            t_write = timed(lambda: region.write(table, table, exported, 0))
            exact = bool(torch.equal(owner.read_tokens(table, 0, tokens), exported.kv))
            t_private = timed(lambda: private.copy_(payload))
            t_shared = timed(lambda: shared.copy_(payload))
        finally:
            region.close()
    finally:
        owner.close()
        src.close()
    gbps = lambda t: nbytes / t / 1e9  # noqa: E731
    return {
        "model": model,
        "tokens": tokens,
        "bytes": nbytes,
        "repeats": repeats,
        "region_write_s": t_write,
        "memcpy_private_s": t_private,
        "memcpy_shared_s": t_shared,
        "region_write_gb_s": gbps(t_write),
        "memcpy_private_gb_s": gbps(t_private),
        "memcpy_shared_gb_s": gbps(t_shared),
        "write_over_memcpy": t_private / t_write,
        "read_back_exact": exact,
    }


# -- 2. the WAN -----------------------------------------------------------------------------


def bench_wan_rate(rate_mbit: float, rtt_ms: float, seconds: float) -> dict[str, Any]:
    """Bulk TCP through a proxy-shell emulator (its own process) at `rate_mbit`."""
    import socket

    from emulation.probes import TcpSink, tcp_send_for
    from emulation.proxy import proxy_process

    ls = socket.socket()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind(("127.0.0.1", 0))
    ls.listen(8)
    sink = TcpSink(ls)
    effects = {"rate_mbit": rate_mbit, "delay_ms": rtt_ms / 2}
    try:
        with proxy_process(ls.getsockname()[1], **effects) as (port, _pid):
            start = time.monotonic()
            sent = tcp_send_for(socket.socket(), ("127.0.0.1", port), seconds)
            time.sleep(0.3 + rtt_ms / 1e3)
    finally:
        sink.stop()
        ls.close()
    warm = min(0.5, seconds / 3)  # skip slow start and the first burst of the bucket
    window = sink.bytes_between(start + warm, start + seconds)
    goodput = window * 8 / (seconds - warm) / 1e6
    return {
        "rate_mbit": rate_mbit,
        "rtt_ms": rtt_ms,
        "seconds": seconds,
        "bytes_sent": sent,
        "bytes_received": sink.total(),
        "goodput_mbit": goodput,
        "goodput_over_rate": goodput / rate_mbit,
    }


# -- 3. decode daemon vs the reference engine ---------------------------------------------------


def make_requests(n: int, prompt_len: int, max_tokens: int, seed: int) -> list[dict[str, Any]]:
    import random

    rng = random.Random(seed)
    return [
        {
            "prompt": [256] + [rng.randrange(256) for _ in range(prompt_len - 1)],
            "max_tokens": max_tokens,
        }
        for _ in range(n)
    ]


def reference_engine(model: str, requests: list[dict[str, Any]], threads: int) -> dict[str, Any]:
    """The colocated Engine, one process, all requests batched as they would be by a daemon."""
    import torch

    from pddnet.engine.engine import Engine
    from pddnet.engine.sampling import SamplingParams
    from pddnet.model.loader import load_model

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m, tok = load_model(model)
        with Engine(m, tok, num_blocks=2048, block_size=16) as engine:
            engine.generate([1, 2, 3], 2, SamplingParams(temperature=0.0))  # warm-up
            t0 = time.perf_counter()
            ids = [
                engine.add_request(
                    r["prompt"], r["max_tokens"], SamplingParams(temperature=0.0), ignore_eos=True
                )
                for r in requests
            ]
            out: dict[str, list[int]] = {rid: [] for rid in ids}
            while engine.has_work():
                for o in engine.step():
                    if o.request_id in out:
                        out[o.request_id].extend(o.new_token_ids)
            elapsed = time.perf_counter() - t0
    finally:
        torch.set_num_threads(old)
    tokens = [out[rid] for rid in ids]
    return {
        "duration": elapsed,
        "total_output_tokens": sum(map(len, tokens)),
        "output_throughput": sum(map(len, tokens)) / elapsed,
        "token_ids": tokens,
    }


def _busy_s(stats: dict[str, dict[str, Any]]) -> float:
    """The modelled devices' summed compute time so far (0 unpaced)."""
    return sum(float(s.get("device", {}).get("modelled_busy_s", 0.0)) for s in stats.values())


async def decode_daemon(
    model: str,
    requests: list[dict[str, Any]],
    threads: int,
    wan: str,
    devices: DeviceSetup = UNPACED,
    percentiles: Any = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """The same requests through a same-dc cluster (router, P, one decode daemon)."""
    import aiohttp

    from pddnet.bench.client import stream_completion
    from pddnet.cluster.local import LocalCluster

    k = devices.dilation
    async with LocalCluster(
        mode="same-dc",
        model=model,
        wan=wan,
        overrides={"model.threads": threads, **devices.overrides},
    ) as cluster:
        timeout = aiohttp.ClientTimeout(total=600 * k)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await warm_up(session, cluster.url, model, dilation=k)
            before = await daemon_stats(cluster) if devices.emulated else {}
            t0 = time.perf_counter()
            recs = await asyncio.gather(
                *(
                    stream_completion(
                        session,
                        cluster.url,
                        {
                            "model": model,
                            "prompt": r["prompt"],
                            "max_tokens": r["max_tokens"],
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                        dilation=k,
                    )
                    for r in requests
                )
            )
            elapsed = time.perf_counter() - t0
        stats = await daemon_stats(cluster)
    errors = [r.error for r in recs if r.error]
    if errors:
        raise RuntimeError(f"decode daemon requests failed: {errors[:3]}")
    tokens = [r.token_ids for r in recs]
    # vLLM's serving metrics of these requests (ttft, tpot, itl, e2el; output_throughput over
    # the duration), modelled on emulated devices
    out = {
        **serving_metrics(recs, elapsed / k, None, percentiles),
        "token_ids": tokens,
        "stats": stats,
    }
    if devices.emulated:
        out["elapsed_wall_s"] = elapsed
        out["device_busy_s"] = _busy_s(stats) - _busy_s(before)
    out.pop("goodput_slos_ms")
    out.pop("good_completed")
    return out


# -- the run ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args)
    check_args(args)
    devices = setup_devices(
        args,
        {
            "decode": {
                "mode": "same-dc",
                "model.name": args.model,
                "wan.shell": args.wan,
                "model.threads": args.threads,
            }
        },
    )
    steps = 1 + len(args.rates) + 3
    with progress(steps, "transport", "part", enabled=not args.no_progress) as bar:
        shm = await asyncio.to_thread(bench_shm, args.model, args.shm_tokens, args.repeats)
        bar.update(1)
        wan = []
        for rate in args.rates:
            wan.append(await asyncio.to_thread(bench_wan_rate, rate, args.rtt_ms, args.wan_seconds))
            bar.update(1)
        requests = make_requests(
            args.decode_requests, args.decode_prompt_len, args.decode_max_tokens, args.seed
        )
        # The reference runs before and after the daemons, so a change in the machine's load
        # during the run shows up as a spread instead of skewing the ratio unseen.
        ref = await asyncio.to_thread(reference_engine, args.model, requests, args.threads)
        bar.update(1)
        daemon = await decode_daemon(
            args.model, requests, args.threads, args.wan, devices, args.metric_percentiles
        )
        bar.update(1)
        ref2 = await asyncio.to_thread(reference_engine, args.model, requests, args.threads)
        bar.update(1)
    ref_tps = (ref["output_throughput"] + ref2["output_throughput"]) / 2
    stats = daemon.pop("stats")
    report = device_report(stats)
    decode = {
        "requests": len(requests),
        "prompt_len": args.decode_prompt_len,
        "max_tokens": args.decode_max_tokens,
        "reference": {
            **{k: v for k, v in ref.items() if k != "token_ids"},
            "output_throughput": ref_tps,
            "output_throughput_before_after": [ref["output_throughput"], ref2["output_throughput"]],
        },
        "daemon": {k: v for k, v in daemon.items() if k != "token_ids"},
        # paced, the reference (this CPU, unpaced) is no ideal for modelled devices
        "daemon_over_reference": (
            None if devices.emulated else daemon["output_throughput"] / ref_tps
        ),
        "tokens_identical": daemon["token_ids"] == ref["token_ids"] == ref2["token_ids"],
    }
    if devices.emulated:
        decode["daemon_over_device_busy"] = daemon["device_busy_s"] / daemon["duration"]
    config = run_config(args)
    config["dilation_k"] = devices.dilation
    path = write_result(
        "transport",
        {
            "config": config,
            "threads_per_daemon": args.threads,
            "shm": shm,
            "wan": wan,
            "decode": decode,
            "emulation": {**devices.to_dict(), "applies_to": "decode"},
            "devices": report,
            "daemon_stats": stats,
        },
        args.out,
    )
    decode_bar = (
        {
            "decode\n(x device busy time)": {
                "pddnet": decode["daemon_over_device_busy"],
                "ideal": 1.0,
            }
        }
        if devices.emulated
        else {
            "decode\n(x reference\noutput_throughput)": {
                "pddnet": decode["daemon_over_reference"],
                "ideal": 1.0,
            }
        }
    )
    png = grouped_bars(
        {
            "shm write\nvs memcpy (GB/s)": {
                "pddnet": shm["region_write_gb_s"],
                "ideal": shm["memcpy_private_gb_s"],
            },
            **{
                f"WAN {w['rate_mbit']:g} Mbit/s\n(x rate)": {
                    "pddnet": w["goodput_over_rate"],
                    "ideal": 1.0,
                }
                for w in wan
            },
            **decode_bar,
        },
        path.with_suffix(".png"),
        "measured (pddnet) vs ideal",
        f"Transport costs, model {args.model}, one run",
    )
    print_table(args, shm, wan, decode, devices)
    return {
        **closing(path, png, {"decode": report}, "transport"),
        "shm": shm,
        "wan": wan,
        "decode": decode,
        "devices": report,
    }


def print_table(
    args: argparse.Namespace,
    shm: dict[str, Any],
    wan: list[dict[str, Any]],
    decode: dict[str, Any],
    devices: DeviceSetup = UNPACED,
) -> None:
    print(f"\ntransport benchmark: model {args.model}, {args.threads} torch thread(s)")
    print(
        devices.line()
        + (" -- the decode part only; shm and WAN are this box's" if devices.emulated else "")
    )
    print(
        f"shm   {shm['bytes'] / 2**20:.1f} MiB of KV ({shm['tokens']} tokens): region write "
        f"{shm['region_write_gb_s']:.2f} GB/s, memcpy {shm['memcpy_private_gb_s']:.2f} GB/s "
        f"(into shm {shm['memcpy_shared_gb_s']:.2f} GB/s): write / memcpy "
        f"{shm['write_over_memcpy']:.2f}x, read back exact: {shm['read_back_exact']}"
    )
    for w in wan:
        print(
            f"WAN   configured {w['rate_mbit']:g} Mbit/s, rtt {w['rtt_ms']:g} ms: goodput "
            f"{w['goodput_mbit']:.1f} Mbit/s = {w['goodput_over_rate']:.1%} of the rate"
        )
    r, d = decode["reference"], decode["daemon"]
    before, after = r["output_throughput_before_after"]
    serving = (
        f"       the cluster's requests: median_ttft {d['median_ttft_ms']:.1f} ms, "
        f"median_tpot {d['median_tpot_ms']:.2f} ms, median_itl {d['median_itl_ms']:.2f} "
        f"ms, median_e2el {d['median_e2el_ms']:.0f} ms (vLLM's definitions)"
    )
    if decode["daemon_over_reference"] is None:  # paced: the ideal is the devices' busy time
        print(
            f"decode {decode['requests']} x {decode['max_tokens']} tokens: pddnet same-dc "
            f"cluster output_throughput {d['output_throughput']:.0f} tok/s modelled, its "
            f"devices busy {d['device_busy_s'] * 1e3:.1f} ms of its "
            f"{d['duration'] * 1e3:.1f} ms = {decode['daemon_over_device_busy']:.2f}x "
            f"(reference Engine on this CPU {r['output_throughput']:.0f} tok/s, not "
            f"comparable); identical tokens: {decode['tokens_identical']}"
        )
        print(serving)
        return
    print(
        f"decode {decode['requests']} x {decode['max_tokens']} tokens: output_throughput of "
        f"the reference Engine {r['output_throughput']:.0f} tok/s (before {before:.0f}, after "
        f"{after:.0f}), of the pddnet same-dc cluster {d['output_throughput']:.0f} tok/s = "
        f"{decode['daemon_over_reference']:.2f}x; identical tokens: "
        f"{decode['tokens_identical']}"
    )
    print(serving)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="tiny model, short runs (smoke test)")
    add_model_argument(p, default="small")
    p.add_argument("--shm-tokens", type=int, default=2048, help="KV tokens per shm write")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument(
        "--rates",
        type=float,
        nargs="+",
        default=[50.0, 200.0, 1000.0],
        help="configured WAN rates (Mbit/s)",
    )
    p.add_argument("--wan-seconds", type=float, default=3.0)
    p.add_argument("--decode-requests", type=int, default=4)
    p.add_argument("--decode-prompt-len", type=int, default=64)
    p.add_argument("--decode-max-tokens", type=int, default=128)
    add_wan_arguments(p, wan="proxy", shaped=False)
    add_run_arguments(p, threads="torch threads per daemon")
    add_metric_arguments(p, goodput=False)
    device_flags.add_arguments(p)


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.shm_tokens, args.repeats = "tiny", 256, 3
        args.rates, args.wan_seconds = [20.0], 1.0
        args.decode_requests, args.decode_prompt_len, args.decode_max_tokens = 2, 16, 24


def check_args(args: argparse.Namespace) -> None:
    if args.shm_tokens < 1 or args.repeats < 1 or args.decode_requests < 1:
        raise ValueError("--shm-tokens, --repeats and --decode-requests must be >= 1")
    if not args.rates or min(args.rates) <= 0:
        raise ValueError("--rates must be > 0 Mbit/s")
    if not 0.5 <= args.wan_seconds <= 30:
        raise ValueError(f"--wan-seconds must be in [0.5, 30], got {args.wan_seconds}")
    if args.decode_prompt_len < 2 or args.decode_max_tokens < 1:
        raise ValueError("--decode-prompt-len must be >= 2 and --decode-max-tokens >= 1")
