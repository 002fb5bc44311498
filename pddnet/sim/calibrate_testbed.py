"""The calibration's testbed run: one LocalCluster serving a probe, then one Poisson stream
of fit- and compare-tagged requests, each request's client times and daemon milestones recorded
(the load average sampled beside). See pddnet.sim.calibrate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time
from typing import Any

from pddnet.device.cost import prefill_flops
from pddnet.sim.calibrate_fit import lstsq, ok_records

PROBE_REQUESTS = 10


def record_of(req: Any, rec: Any, t0: float) -> dict[str, Any]:
    """A request's measurements relative to the run's start: client times and milestones."""
    events: dict[str, float] = {}
    for e in rec.pdd.get("timeline", []):
        events.setdefault(e["event"], e["time"] - t0)
    return {
        "arrival_s": req.arrival_s,
        "prompt": len(req.prompt_token_ids),
        "max_tokens": req.max_tokens,
        "sent": rec.sent_at - t0,
        "tokens": [t - t0 for t in rec.token_times],
        "error": rec.error,
        "pipeline": rec.pdd.get("pipeline"),
        "relay_tokens": rec.pdd.get("relay_tokens"),
        "main_tokens": rec.pdd.get("main_tokens"),
        "handoff_mode": rec.pdd.get("handoff_mode"),
        "events": events,
    }


def load1() -> float:
    return os.getloadavg()[0]


def phase_load(phase: str, when: str) -> tuple[float, float, float]:
    """Print and return the load average: the box is shared, so every phase says what it saw."""
    la = os.getloadavg()
    print(f"[load] {phase} {when}: {la[0]:.2f} {la[1]:.2f} {la[2]:.2f} (1/5/15 min)", flush=True)
    return la


def probe_rate(
    points: list[tuple[int, float]],
    prof: Any,
    mix: list[tuple[tuple[int, int], int]],
    target_util: float,
) -> tuple[float, float]:
    """Rate putting P at `target_util`: prefill time fitted to the probe (alone, one at a
    time), averaged over the prompt lengths of the interleaved mix (range, request count)."""
    a, slope = lstsq(
        [[1.0] * len(points), [prefill_flops(prof, n) for n, _ in points]], [t for _, t in points]
    )
    total = sum(k for _, k in mix)
    mean_s = (
        sum(
            k * statistics.fmean(a + slope * prefill_flops(prof, n) for n in range(lo, hi + 1))
            for (lo, hi), k in mix
        )
        / total
    )
    if mean_s <= 0:
        raise RuntimeError(f"probe gave a non-positive mean prefill time {mean_s:.3f} s")
    return target_util / mean_s, mean_s


def interleaved_workload(
    args: argparse.Namespace, rate: float, n_fit: int, n_cmp: int, fit_seed: int
) -> list[tuple[str, Any]]:
    """Two seeded Poisson streams merged into one arrival stream, each request tagged: the
    fit stream (its own seed and wider prompt range) and the compare stream (--seed). Each
    gets its share of the total rate, so both span the same window and see the same outside
    load; a merge of Poisson streams is Poisson at the summed rate."""
    from pddnet.workload.poisson import poisson_long_prompts

    total = n_fit + n_cmp
    fit = poisson_long_prompts(
        n_fit,
        rate * n_fit / total,
        tuple(args.fit_prompt_len),
        tuple(args.max_tokens),
        seed=fit_seed,
    )
    cmp_ = poisson_long_prompts(
        n_cmp, rate * n_cmp / total, tuple(args.prompt_len), tuple(args.max_tokens), seed=args.seed
    )
    merged = [("fit", r) for r in fit] + [("compare", r) for r in cmp_]
    merged.sort(key=lambda x: (x[1].arrival_s, x[0]))
    return merged


def sized_counts(args: argparse.Namespace, rate: float) -> tuple[int, int]:
    """--fit-requests and --requests, scaled down together when their arrival window at `rate`
    would exceed --window-s (a loaded box gives a slow probe, a low rate, a long run)."""
    n_fit, n_cmp = args.fit_requests, args.requests
    window = (n_fit + n_cmp) / rate
    if window > args.window_s:
        k = args.window_s / window
        n_fit, n_cmp = max(20, int(n_fit * k)), max(40, int(n_cmp * k))
        print(
            f"window {window:.0f} s at {rate:.3f}/s exceeds --window-s {args.window_s:g}: "
            f"{n_fit} fit + {n_cmp} compare requests"
        )
    return n_fit, n_cmp


async def run_testbed(args: argparse.Namespace, prof: Any, fit_seed: int) -> dict[str, Any]:
    """One PDD cluster for everything: warm-up, the probe (PROBE_REQUESTS prompts one at a
    time; with --rate auto it sets the rate), then the fit and compare streams interleaved in
    one arrival stream, so both see the same outside load."""
    import aiohttp
    from tqdm import tqdm

    from pddnet.bench.client import stream_completion
    from pddnet.cluster.local import LocalCluster

    def body(req: Any) -> dict[str, Any]:
        return {
            "model": args.model,
            "prompt": list(req.prompt_token_ids),
            "max_tokens": req.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }

    out: dict[str, Any] = {"phases": {}}
    async with LocalCluster(
        mode="pdd",
        model=args.model,
        wan="proxy",
        rtt_ms=args.rtt_ms,
        jitter_ms=args.jitter_ms,
        bw_mbit=args.bw_mbit,
        overrides={"model.threads": 1},
    ) as cluster:
        timeout = aiohttp.ClientTimeout(total=600.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(3):  # warm-up: first forwards allocate, the WAN estimators settle
                warm = await stream_completion(
                    session,
                    cluster.url,
                    {"model": args.model, "prompt": [1, 2, 3] * 50, "max_tokens": 4},
                )
                if warm.error:
                    raise RuntimeError(f"testbed warm-up failed: {warm.error}")
            probe = probe_requests(tuple(args.fit_prompt_len), args.max_tokens[1], fit_seed + 1)
            la0 = phase_load("probe", "start")
            t0 = time.time()
            recs = []
            for req in tqdm(probe, desc="testbed probe", unit="req", leave=False):
                recs.append(
                    record_of(req, await stream_completion(session, cluster.url, body(req)), t0)
                )
            out["phases"]["probe"] = {"start": la0, "end": phase_load("probe", "end")}
            pts = [
                (r["prompt"], r["events"]["prefill_end"] - r["events"]["prefill_start"])
                for r in ok_records(recs)
                if "prefill_end" in r["events"]
            ]
            n_fit, n_cmp = args.fit_requests, args.requests
            mix = [(tuple(args.fit_prompt_len), n_fit), (tuple(args.prompt_len), n_cmp)]
            if len(pts) < 3:
                raise RuntimeError(f"only {len(pts)} probe requests completed")
            rate, mean_s = probe_rate(pts, prof, mix, args.target_util)
            if args.rate != "auto":
                rate = float(args.rate)
            n_fit, n_cmp = sized_counts(args, rate)
            out["probe"] = {"points": pts, "mean_prefill_s": mean_s, "rate": rate}
            print(
                f"probe: mean prefill {mean_s:.3f} s alone -> rate {rate:.3f}/s (P at "
                f"{mean_s * rate:.0%}); {n_fit} fit + {n_cmp} compare requests interleaved, "
                f"~{(n_fit + n_cmp) / rate:.0f} s",
                flush=True,
            )
            out["rate"] = rate
            workload = interleaved_workload(args, rate, n_fit, n_cmp, fit_seed)
            bar = tqdm(total=len(workload), desc="testbed fit+compare", unit="req")
            out["phases"]["run"] = {"start": phase_load("fit+compare run", "start")}
            samples: list[tuple[float, float]] = []
            t0, m0 = time.time(), time.monotonic()

            async def sample_load() -> None:
                while True:
                    samples.append((time.monotonic() - m0, load1()))
                    bar.set_postfix(load=f"{samples[-1][1]:.1f}")
                    await asyncio.sleep(10.0)

            async def one(i: int, tag: str, req: Any) -> dict[str, Any]:
                await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - m0)))
                rec = await stream_completion(session, cluster.url, body(req))
                bar.update(1)
                return {"i": i, "tag": tag, **record_of(req, rec, t0)}

            sampler = asyncio.create_task(sample_load())
            try:
                out["records"] = list(
                    await asyncio.gather(*(one(i, tag, r) for i, (tag, r) in enumerate(workload)))
                )
            finally:
                sampler.cancel()
                bar.close()
            out["phases"]["run"]["end"] = phase_load("fit+compare run", "end")
            out["load_samples"] = samples
    return out


def probe_requests(prompt_len: tuple[int, int], max_tokens: int, seed: int) -> list[Any]:
    """PROBE_REQUESTS prompts of lengths spread evenly over the range (random tokens)."""
    from pddnet.workload.poisson import BenchRequest

    rng = random.Random(seed)
    lo, hi = prompt_len
    lengths = [lo + (hi - lo) * i // (PROBE_REQUESTS - 1) for i in range(PROBE_REQUESTS)]
    return [
        BenchRequest(0.0, tuple(rng.randrange(256) for _ in range(n)), max_tokens) for n in lengths
    ]
