"""Calibrate the simulator against the real testbed: same workload, TTFT and ITL side by side.

1. Fit run (its own seed, wider prompt range): the workload on a real PDD cluster (LocalCluster,
   mode pdd, proxy WAN, 1 torch thread per daemon), first a few requests one at a time (the
   probe), then Poisson arrivals. The chip profiles are fitted to what the daemons did there,
   contention included (P, RLD and MD share this machine's cores with the router, the WAN
   proxy, the client and whatever else runs), from every request's timeline (`pdd.timeline`,
   the daemons' own milestones) and the client's token arrival times:
   - P: isolated prefills (no other prefill overlapping), t = overhead + FLOPs / rate;
   - the P -> RLD path: t = latency + KV bytes / bandwidth, plus the fixed daemon latencies
     before P (router, KV_ALLOC) and after RLD's copy lands (first token to the client);
   - RLD and MD, each its own profile: every inter-token gap a role produced, against the
     batch it ran in (requests whose decode span on that role covers the gap) and their
     context, t = a + b x batch + c x context tokens (least squares, the slowest 1% of gaps
     left out as stalls), mapped onto the roofline plus the per-sequence and per-context
     terms of pddnet/sim/cost.py.
2. The rate: with ``--rate auto`` the probe's prefill times set it to ``--target-util`` of P
   (default 0.5). Calibrate at moderate load: near P's saturation the queueing tail magnifies
   any service-time error (at rho 0.9 a 5% slower P doubles the mean wait), so agreement there
   says little about the model; at 40-60% queueing is present but not explosive.
3. Compare run (``--seed``, another workload): the same cluster setup, measured by a
   streaming client; the same requests (their real token ids as units, tokens_per_unit = 1)
   in the simulator with the fitted profiles, the testbed's pool sizes, policy settings and
   WAN (the proxy's link model: rate, delay, jitter, 1 MiB queue, 32 KiB pieces).
4. Print TTFT and ITL P50/P90/P99 side by side with the errors (goal: medians within 15%, P90
   within 25%); write results/sim/calibration.json, calibration.png (CDFs, decode fit) and
   calibration_runs.json (the raw testbed records; ``--reuse`` re-fits and re-simulates them).

Heavy: ~2 x (requests / rate) seconds of both cores. Run it wrapped in `timeout -s INT`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ROLES = ("prefill", "relay", "main_decode")
PROBE_REQUESTS = 10
STALL_QUANTILE = 0.99          # decode gaps above this quantile are stalls, not steps
PROXY_CHUNK_BYTES = 32 * 1024  # emulation.proxy.WanProxy.chunk_bytes (default)
PROXY_QUEUE_BYTES = 1 << 20    # emulation.effects: queue_bytes default


# -- the testbed --------------------------------------------------------------------------------


def record_of(req: Any, rec: Any, t0: float) -> dict[str, Any]:
    """A request's measurements relative to the run's start: client times and milestones."""
    events: dict[str, float] = {}
    for e in rec.pdd.get("timeline", []):
        events.setdefault(e["event"], e["time"] - t0)
    return {"arrival_s": req.arrival_s, "prompt": len(req.prompt_token_ids),
            "max_tokens": req.max_tokens, "sent": rec.sent_at - t0,
            "tokens": [t - t0 for t in rec.token_times], "error": rec.error,
            "pipeline": rec.pdd.get("pipeline"), "relay_tokens": rec.pdd.get("relay_tokens"),
            "main_tokens": rec.pdd.get("main_tokens"),
            "handoff_mode": rec.pdd.get("handoff_mode"), "events": events}


async def run_testbed(workload: list[Any], args: argparse.Namespace, desc: str,
                      probe: list[Any] | None = None) -> dict[str, Any]:
    """The workload on a fresh PDD cluster; with `probe`, those requests first, one at a time."""
    import aiohttp
    from tqdm import tqdm

    from pddnet.bench.client import stream_completion
    from pddnet.cluster.local import LocalCluster

    def body(req: Any) -> dict[str, Any]:
        return {"model": args.model, "prompt": list(req.prompt_token_ids),
                "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True}

    out: dict[str, Any] = {"load_before": os.getloadavg()}
    async with LocalCluster(mode="pdd", model=args.model, wan="proxy", rtt_ms=args.rtt_ms,
                            jitter_ms=args.jitter_ms, bw_mbit=args.bw_mbit,
                            overrides={"model.threads": 1}) as cluster:
        timeout = aiohttp.ClientTimeout(total=600.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for _ in range(3):   # warm-up: first forwards allocate, the WAN estimators settle
                warm = await stream_completion(session, cluster.url, {
                    "model": args.model, "prompt": [1, 2, 3] * 50, "max_tokens": 4})
                if warm.error:
                    raise RuntimeError(f"testbed warm-up failed: {warm.error}")
            if probe:
                t0 = time.time()
                recs = []
                for req in tqdm(probe, desc=f"{desc} probe", unit="req", leave=False):
                    recs.append(record_of(req, await stream_completion(
                        session, cluster.url, body(req)), t0))
                out["probe"] = recs
            bar = tqdm(total=len(workload), desc=desc, unit="req")
            t0, m0 = time.time(), time.monotonic()

            async def one(req: Any) -> dict[str, Any]:
                await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - m0)))
                rec = await stream_completion(session, cluster.url, body(req))
                bar.update(1)
                return record_of(req, rec, t0)

            try:
                out["records"] = list(await asyncio.gather(*(one(r) for r in workload)))
            finally:
                bar.close()
    out["load_after"] = os.getloadavg()
    return out


def probe_requests(prompt_len: tuple[int, int], max_tokens: int, seed: int) -> list[Any]:
    """PROBE_REQUESTS prompts of lengths spread evenly over the range (random tokens)."""
    from pddnet.bench.workload import BenchRequest

    rng = random.Random(seed)
    lo, hi = prompt_len
    lengths = [lo + (hi - lo) * i // (PROBE_REQUESTS - 1) for i in range(PROBE_REQUESTS)]
    return [BenchRequest(0.0, tuple(rng.randrange(256) for _ in range(n)), max_tokens)
            for n in lengths]


def ok_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["error"] is None and r["tokens"]]


# -- fitting -------------------------------------------------------------------------------------


def lstsq(cols: list[list[float]], ys: list[float]) -> list[float]:
    import numpy as np

    coef, *_ = np.linalg.lstsq(np.array(cols, dtype=float).T, np.array(ys, dtype=float),
                               rcond=None)
    return [float(c) for c in coef]


def prefill_flops(prof: Any, n: int) -> float:
    """FLOPs of a prefill of n uncached tokens, as pddnet/sim/cost.py counts them."""
    attn = 4.0 * prof.num_layers * prof.num_heads * prof.head_dim
    return 2.0 * prof.active_params * n + attn * n * (n + 1) / 2


def isolated_prefills(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests whose prefill [start, end] overlapped no other prefill: their duration is
    P's service time alone (the engine batches waiting prompts into one step otherwise)."""
    iv = sorted((r["events"]["prefill_start"], r["events"]["prefill_end"], i)
                for i, r in enumerate(records)
                if "prefill_start" in r["events"] and "prefill_end" in r["events"])
    out = []
    for k, (s, e, i) in enumerate(iv):
        before = max((x[1] for x in iv[:k]), default=-math.inf)
        after = iv[k + 1][0] if k + 1 < len(iv) else math.inf
        if before < s and after > e:
            out.append(records[i])
    return out


def busy_fraction(records: list[dict[str, Any]]) -> float:
    """Share of the run P spent prefilling (union of prefill intervals / span)."""
    iv = sorted((r["events"]["prefill_start"], r["events"]["prefill_end"]) for r in records
                if "prefill_start" in r["events"] and "prefill_end" in r["events"])
    if not iv:
        return 0.0
    busy, cur_s, cur_e = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(r["tokens"][-1] for r in records if r["tokens"]) - min(r["sent"] for r in records)
    return busy / span if span > 0 else 0.0


def fit_prefill(records: list[dict[str, Any]], prof: Any) -> dict[str, Any]:
    iso = isolated_prefills(records)
    if len(iso) < 4:
        raise RuntimeError(f"only {len(iso)} isolated prefills in the fit run: P was saturated; "
                           f"lower --rate or --target-util")
    xs = [prefill_flops(prof, r["prompt"]) for r in iso]
    ys = [r["events"]["prefill_end"] - r["events"]["prefill_start"] for r in iso]
    a, slope = lstsq([[1.0] * len(xs), xs], ys)
    if slope <= 0:
        raise RuntimeError("prefill time does not grow with the prompt in the fit run")
    if a < 0:                                 # no negative overhead: refit through the origin
        a, slope = 0.0, lstsq([xs], ys)[0]
    into_p = [r["events"]["prefill_start"] - r["sent"] for r in iso]
    return {"flops_per_s": 1.0 / slope, "overhead_s": a, "isolated": len(iso),
            "to_engine_s": statistics.median(into_p),
            "points": sorted(zip([r["prompt"] for r in iso], ys, strict=True))}


def fit_relay_path(records: list[dict[str, Any]], kvpt: int) -> dict[str, Any]:
    """P -> RLD: KV copy time against its bytes, and RLD's copy -> the client's first token,
    over requests whose prefill ran alone (a full RLD would add its admission wait)."""
    rows = [r for r in isolated_prefills(records) if "rld_kv_complete" in r["events"] and "prefill_end" in r["events"]
            and r["events"]["rld_kv_complete"] >= r["events"]["prefill_end"]]
    if len(rows) < 4:
        raise RuntimeError("too few requests went through RLD in the fit run to fit P -> RLD")
    xs = [r["prompt"] * kvpt for r in rows]
    ys = [r["events"]["rld_kv_complete"] - r["events"]["prefill_end"] for r in rows]
    # median per half of the byte range: robust to the seconds-long waits of a full RLD
    order = sorted(range(len(xs)), key=xs.__getitem__)
    lo, hi = order[:len(order) // 2], order[len(order) // 2:]
    x1, y1 = statistics.median(xs[i] for i in lo), statistics.median(ys[i] for i in lo)
    x2, y2 = statistics.median(xs[i] for i in hi), statistics.median(ys[i] for i in hi)
    per_byte = max((y2 - y1) / (x2 - x1), 1e-12) if x2 > x1 else 1e-12
    lat = max(0.0, y1 - per_byte * x1)
    emit = [r["tokens"][0] - r["events"]["rld_kv_complete"] for r in rows
            if r["tokens"][0] >= r["events"]["rld_kv_complete"]]
    return {"bytes_per_s": 1.0 / per_byte, "latency_s": lat,
            "to_client_s": statistics.median(emit) if emit else 0.0, "samples": len(rows)}


def decode_gaps(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, int, float]]]:
    """(batch, context tokens, gap) for every inter-token gap RLD or MD produced. A request
    is in a role's batch from its first to its last token from that role (client times); the
    handoff gap (RLD's last token -> MD's first) is an extend plus the line, not a step."""
    spans: dict[str, list[tuple[float, float, dict[str, Any]]]] = {"relay": [], "main_decode": []}
    split = {}
    for k, r in enumerate(records):
        t = r["tokens"]
        n_rld = min(r["relay_tokens"] or 0, len(t))
        split[k] = n_rld
        if n_rld:
            spans["relay"].append((t[0], t[n_rld - 1], r))
        if n_rld < len(t):
            spans["main_decode"].append((t[n_rld], t[-1], r))
    out: dict[str, list[tuple[int, int, float]]] = {"relay": [], "main_decode": []}
    for k, r in enumerate(records):
        t, n_rld = r["tokens"], split[k]
        for i in range(1, len(t)):
            if i == n_rld:
                continue
            role = "relay" if i < n_rld else "main_decode"
            mid = (t[i - 1] + t[i]) / 2
            batch, ctx = 0, 0
            for s, e, o in spans[role]:
                if s <= mid <= e:
                    batch += 1
                    ctx += o["prompt"] + sum(1 for x in o["tokens"] if x <= mid)
            out[role].append((max(batch, 1), ctx, t[i] - t[i - 1]))
    return out


def fit_decode(rows: list[tuple[int, int, float]]) -> dict[str, Any]:
    """Mean step time t = a + b x batch + c x context (least squares, stalls left out)."""
    if len(rows) < 30:
        raise RuntimeError(f"only {len(rows)} decode gaps for a role in the fit run")
    cut = sorted(g for *_, g in rows)[int(STALL_QUANTILE * (len(rows) - 1))]
    kept = [x for x in rows if x[2] <= cut]
    ones = [1.0] * len(kept)
    b_col = [float(x[0]) for x in kept]
    c_col = [float(x[1]) for x in kept]
    ys = [x[2] for x in kept]
    a, b, c = lstsq([ones, b_col, c_col], ys)
    if c < 0:                 # context does not show: per-sequence only
        c = 0.0
        a, b = lstsq([ones, b_col], ys)
    if b < 0:
        b = 0.0
        a, c = lstsq([ones, c_col], ys)
        c = max(c, 0.0)
    by_batch: dict[int, list[float]] = {}
    for bb, _, g in rows:
        by_batch.setdefault(bb, []).append(g)
    return {"a_s": a, "b_s_per_seq": b, "c_s_per_ctx": c, "gaps": len(rows),
            "stall_cut_s": cut,
            "by_batch": {str(k): {"n": len(v), "median_s": statistics.median(v),
                                  "mean_s": statistics.fmean(v)}
                         for k, v in sorted(by_batch.items())}}


def decode_chip_terms(fit: dict[str, Any], weight_bytes: float, kvpt: int) -> dict[str, float]:
    """Map t = a + b n + c C onto overhead + bytes / bw + per_seq n + per_ctx (C + n), bytes =
    weights + (C + n) x kvpt: the bandwidth is the largest that keeps overhead and per-context
    term >= 0, so the roofline carries as much of the line as it can."""
    a, b, c = max(fit["a_s"], 1e-4), fit["b_s_per_seq"], fit["c_s_per_ctx"]
    bw = max(weight_bytes / a, kvpt / c if c > 0 else 0.0)
    overhead = a - weight_bytes / bw
    per_ctx = max(0.0, c - kvpt / bw)
    per_seq = max(0.0, b - kvpt / bw - per_ctx)
    return {"memory_bw_gbs": bw / 1e9, "step_overhead_ms": overhead * 1e3,
            "step_per_seq_us": per_seq * 1e6, "step_per_ctx_token_ns": per_ctx * 1e9}


def fit_all(records: list[dict[str, Any]], model: str) -> dict[str, Any]:
    from pddnet.sim.profiles import load_model

    prof = load_model(model)
    recs = ok_records(records)
    pre = fit_prefill(recs, prof)
    path = fit_relay_path(recs, prof.kv_bytes_per_token)
    gaps = decode_gaps(recs)
    dec = {role: fit_decode(rows) for role, rows in gaps.items()}
    terms = {role: decode_chip_terms(f, prof.weight_bytes, prof.kv_bytes_per_token)
             for role, f in dec.items()}
    return {"prefill": pre, "relay_path": path, "decode": dec, "decode_terms": terms,
            "p_busy_fraction": busy_fraction(recs), "completed": len(recs),
            "requests": len(records)}


def chip_toml(name: str, fit: dict[str, Any], memory_gb: float, role: str) -> str:
    """One role's fitted profile: compute from P's prefills, the RDMA path from P -> RLD,
    decode terms from that role's own steps (P's memory bandwidth: MD's, it barely matters)."""
    tf = fit["prefill"]["flops_per_s"] / 1e12
    gbit = fit["relay_path"]["bytes_per_s"] * 8 / 1e9
    if role == "prefill":
        terms = dict(fit["decode_terms"]["main_decode"], step_per_seq_us=0.0,
                     step_per_ctx_token_ns=0.0,
                     step_overhead_ms=fit["prefill"]["overhead_s"] * 1e3)
    else:
        terms = fit["decode_terms"][role]
    return (f'# fitted by scripts/sim_calibrate.py to the testbed ({role}), contention included\n'
            f'name = "{name}"\nmemory_gb = {memory_gb:.6f}\n'
            f'memory_bw_gbs = {terms["memory_bw_gbs"]:.6f}\nscale_up_gbs = 10\n'
            f"scale_out_gbit = {gbit:.6f}\nprice_per_hour = 0.05\ncompute_efficiency = 1.0\n"
            f"bandwidth_efficiency = 1.0\nstep_overhead_ms = {terms['step_overhead_ms']:.6f}\n"
            f"step_per_seq_us = {terms['step_per_seq_us']:.3f}\n"
            f"step_per_ctx_token_ns = {terms['step_per_ctx_token_ns']:.3f}\n"
            f"[tflops]\nfp32 = {tf:.9f}\nbf16 = {tf:.9f}\nfp8 = {tf:.9f}\n")


# -- the simulator ---------------------------------------------------------------------------


def simulate_same(records: list[dict[str, Any]], workload: list[Any], chips: dict[str, Path],
                  fit: dict[str, Any], args: argparse.Namespace, tmp: Path) -> tuple[Any, Any]:
    """The compare workload in the simulator with the testbed's settings; returns the report
    and the SimulatedSystem (for its histograms' CDFs)."""
    from tqdm import tqdm

    import pddnet.sim.runner as runner
    from pddnet.config import load_config as load_cluster
    from pddnet.sim.config import parse_config

    trace = tmp / "calib.jsonl"
    with trace.open("w") as f:
        for r in workload:
            f.write(json.dumps({"arrival_s": r.arrival_s, "prompt_tokens": len(r.prompt_token_ids),
                                "output_tokens": r.max_tokens,
                                "prefix_ids": list(r.prompt_token_ids)}) + "\n")
    cl = load_cluster(None, {"model.name": args.model})
    pol, d = cl.policy, cl.prefill
    # Fixed latencies the simulator has no place for (router, KV_ALLOC before P; RLD's first
    # token to the client) ride on the intra-DC latency: they add to TTFT and occupy no one.
    lat = (fit["prefill"]["to_engine_s"] + fit["relay_path"]["latency_s"]
           + fit["relay_path"]["to_client_s"])
    cfg = parse_config({
        "seed": args.seed, "model": args.model, "tokens_per_unit": 1, "systems": ["pdd"],
        "pdd": {role_key: {"chip": str(chips[role]), "instances": 1, "gpus": 1}
                for role_key, role in (("prefill", "prefill"), ("relay", "relay"),
                                       ("main_decode", "main_decode"))},
        "baseline": {"prefill": {"chip": str(chips["prefill"])},
                     "decode": {"chip": str(chips["main_decode"])}},
        "line": {"bw_gbit": args.bw_mbit / 1e3, "rtt_ms": args.rtt_ms,
                 "jitter_ms": args.jitter_ms, "queue_mb": PROXY_QUEUE_BYTES / (1 << 20),
                 "piece_mb": PROXY_CHUNK_BYTES / (1 << 20), "piece_ms": 0.0},
        "engine": {"block_tokens": d.block_size, "chunk_tokens": d.max_num_batched_tokens,
                   "max_seqs": d.max_num_seqs, "memory_utilisation": 1.0,
                   "rdma_latency_us": lat * 1e6},
        "policy": {"handoff": pol.handoff, "handoff_threshold": pol.handoff_threshold_tokens,
                   "handoff_chunk": pol.handoff_chunk, "rld_load_limit": pol.rld_load_limit,
                   "rld_max_requests": pol.rld_max_requests,
                   "direct_budget_s": pol.direct_budget_s,
                   "singular_filter": pol.singular_filter,
                   "singular_margin": pol.singular_margin},
        "workload": {"kind": "trace", "path": str(trace), "requests": len(workload),
                     "arrivals": "open"}})
    captured: dict[str, Any] = {}
    original = runner.report

    def capture(sim: Any) -> dict[str, Any]:   # the report drops the ITL histogram's CDF
        captured["sim"] = sim
        return original(sim)

    bar = tqdm(total=len(workload), desc="simulator", unit="req")
    runner.report = capture
    try:
        rep = runner.simulate(cfg, "pdd", progress=bar.update)
    finally:
        runner.report = original
        bar.close()
    return rep, captured["sim"]


# -- output ------------------------------------------------------------------------------------


def quantiles(values: list[float]) -> dict[str, float | None]:
    from pddnet.bench.results import summary

    return summary(values)


def plot(path: Path, real_ttft: list[float], real_itl: list[float], sim: Any,
         fit: dict[str, Any], title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    for ax, name, real, hist, scale, unit in (
            (axes[0], "TTFT", real_ttft, sim.ttft, 1.0, "s"),
            (axes[1], "ITL", real_itl, sim.itl, 1e3, "ms")):
        xs = sorted(real)
        ax.plot([x * scale for x in xs], [(i + 1) / len(xs) for i in range(len(xs))],
                label="testbed", lw=2)
        pts = hist.cdf_points(400)
        ax.plot([v * scale for v, _ in pts], [f for _, f in pts], label="simulator", lw=2,
                ls="--")
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} ({unit})")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend()
        ax.set_title(f"{name}: testbed vs simulator")
    ax = axes[2]
    for role, mk in (("relay", "o"), ("main_decode", "s")):
        f = fit["decode"][role]
        bb = sorted(int(k) for k, v in f["by_batch"].items() if v["n"] >= 10)
        ax.plot(bb, [f["by_batch"][str(k)]["mean_s"] * 1e3 for k in bb], mk, label=f"{role} mean")
        ax.plot(bb, [f["by_batch"][str(k)]["median_s"] * 1e3 for k in bb], mk, mfc="none",
                label=f"{role} median")
        line = [(f["a_s"] + f["b_s_per_seq"] * k) * 1e3 for k in bb]
        ax.plot(bb, line, "-", alpha=0.6, label=f"{role} fit (at context 0)")
    ax.set_xlabel("decode batch (requests)")
    ax.set_ylabel("inter-token gap (ms)")
    ax.set_title("fit run: decode step vs batch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=200, help="compare run")
    ap.add_argument("--fit-requests", type=int, default=150)
    ap.add_argument("--rate", default="auto",
                    help="requests/s of both runs, or 'auto' (--target-util of P's probe time)")
    ap.add_argument("--target-util", type=float, default=0.5)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(256, 768))
    ap.add_argument("--fit-prompt-len", type=int, nargs=2, default=(128, 1024))
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 48))
    ap.add_argument("--rtt-ms", type=float, default=30.0)
    ap.add_argument("--jitter-ms", type=float, default=2.0)
    ap.add_argument("--bw-mbit", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0, help="compare run (fit run: seed + 1000)")
    ap.add_argument("--out", default="results/sim")
    ap.add_argument("--reuse", action="store_true",
                    help="re-fit and re-simulate OUT/calibration_runs.json (no testbed)")
    args = ap.parse_args()
    if not 0 < args.target_util < 1:
        ap.error("--target-util must be in (0, 1)")

    from pddnet.bench.workload import poisson_long_prompts
    from pddnet.config import load_config as load_cluster
    from pddnet.sim.profiles import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / "calibration_runs.json"
    prof = load_model(args.model)
    fit_seed = args.seed + 1000
    if args.reuse:
        runs = json.loads(runs_path.read_text())
        rate = runs["rate"]
    else:
        probe = probe_requests(tuple(args.fit_prompt_len), args.max_tokens[1], fit_seed + 1)
        runs = {"args": vars(args)}
        if args.rate == "auto":
            # a few prompts one at a time on a cluster of their own: P's time alone
            probe_run = asyncio.run(run_testbed([], args, "probe", probe))
            pts = [(r["prompt"], r["events"]["prefill_end"] - r["events"]["prefill_start"])
                   for r in ok_records(probe_run["probe"]) if "prefill_end" in r["events"]]
            a, slope = lstsq([[1.0] * len(pts), [prefill_flops(prof, n) for n, _ in pts]],
                             [t for _, t in pts])
            mean_s = statistics.fmean(a + slope * prefill_flops(prof, n)
                                      for n in range(args.prompt_len[0], args.prompt_len[1] + 1))
            rate = args.target_util / mean_s
            runs["probe"] = {"points": pts, "mean_prefill_s": mean_s,
                             "load": probe_run["load_after"]}
            print(f"probe: mean prefill {mean_s:.3f} s alone -> rate {rate:.3f}/s "
                  f"(P at {args.target_util:.0%}); load {os.getloadavg()[0]:.2f}")
        else:
            rate = float(args.rate)
        runs["rate"] = rate
        fit_wl = poisson_long_prompts(args.fit_requests, rate, tuple(args.fit_prompt_len),
                                      tuple(args.max_tokens), seed=fit_seed)
        runs["fit"] = asyncio.run(run_testbed(fit_wl, args, "testbed fit run"))
        cmp_wl = poisson_long_prompts(args.requests, rate, tuple(args.prompt_len),
                                      tuple(args.max_tokens), seed=args.seed)
        runs["compare"] = asyncio.run(run_testbed(cmp_wl, args, "testbed compare run"))
        runs_path.write_text(json.dumps(runs))
    cmp_wl = poisson_long_prompts(args.requests if not args.reuse else runs["args"]["requests"],
                                  rate, tuple(runs["args"]["prompt_len"]),
                                  tuple(runs["args"]["max_tokens"]), seed=runs["args"]["seed"])
    fit = fit_all(runs["fit"]["records"], args.model)
    pf, rp = fit["prefill"], fit["relay_path"]
    print(f"fit ({fit['completed']}/{fit['requests']} requests, P busy "
          f"{fit['p_busy_fraction']:.0%}): prefill {pf['flops_per_s'] / 1e9:.1f} GFLOP/s + "
          f"{pf['overhead_s'] * 1e3:.1f} ms ({pf['isolated']} isolated), P->RLD "
          f"{rp['bytes_per_s'] / 1e9:.2f} GB/s + {rp['latency_s'] * 1e3:.1f} ms, fixed "
          f"{(pf['to_engine_s'] + rp['to_client_s']) * 1e3:.1f} ms")
    for role in ("relay", "main_decode"):
        d = fit["decode"][role]
        print(f"  {role}: step = {d['a_s'] * 1e3:.1f} ms + {d['b_s_per_seq'] * 1e3:.2f} ms/seq "
              f"+ {d['c_s_per_ctx'] * 1e6:.2f} us/context token ({d['gaps']} gaps)")

    cl = load_cluster(None, {})
    chips_text: dict[str, str] = {}
    records = ok_records(runs["compare"]["records"])
    real_ttft = [r["tokens"][0] - r["sent"] for r in records]
    real_itl = [b - a for r in records for a, b in zip(r["tokens"], r["tokens"][1:],
                                                       strict=False)]
    with tempfile.TemporaryDirectory() as tmp:
        chips: dict[str, Path] = {}
        for role in ROLES:
            blocks = getattr(cl, role).num_blocks * getattr(cl, role).block_size
            mem = (prof.weight_bytes + blocks * prof.kv_bytes_per_token) / 1e9
            chips_text[role] = chip_toml(f"cpu-fitted-{role}", fit, mem, role)
            chips[role] = Path(tmp) / f"cpu-fitted-{role}.toml"
            chips[role].write_text(chips_text[role])
        rep, sim = simulate_same(records, cmp_wl, chips, fit, args, Path(tmp))

    rows = []
    real = {"TTFT": quantiles(real_ttft), "ITL": quantiles(real_itl)}
    print(f"\n{'metric':<10} {'testbed':>10} {'sim':>10} {'error':>8}   (seconds)")
    for name, simd in (("TTFT", rep["ttft_s"]), ("ITL", rep["itl_s"])):
        for q in ("p50", "p90", "p99"):
            a, b = real[name][q], simd[q]
            err = None if not a or b is None else (b - a) / a
            rows.append({"metric": name, "q": q, "testbed": a, "sim": b, "error": err})
            print(f"{name + ' ' + q:<10} {a or 0:10.4f} {b or 0:10.4f} "
                  f"{'-' if err is None else f'{err:+7.1%}'}")
    goal = {"medians within 15%": all(r["error"] is not None and abs(r["error"]) <= 0.15
                                      for r in rows if r["q"] == "p50"),
            "P90 within 25%": all(r["error"] is not None and abs(r["error"]) <= 0.25
                                  for r in rows if r["q"] == "p90")}
    print("goal:", ", ".join(f"{k}: {'reached' if v else 'missed'}" for k, v in goal.items()))
    pipes: dict[str, int] = {}
    modes: dict[str, int] = {}
    for r in records:
        pipes[str(r["pipeline"])] = pipes.get(str(r["pipeline"]), 0) + 1
        modes[str(r["handoff_mode"])] = modes.get(str(r["handoff_mode"]), 0) + 1
    rld_tok = sum(r["relay_tokens"] or 0 for r in records)
    all_tok = sum(len(r["tokens"]) for r in records)
    cmp_busy = busy_fraction(records)
    print(f"testbed: P busy {cmp_busy:.0%}, pipelines {pipes}, handoffs {modes}, RLD token share "
          f"{rld_tok / max(all_tok, 1):.1%}")
    print(f"sim:     P busy {rep['busy']['prefill']:.0%}, pipelines {rep['pipelines']}, "
          f"handoffs {rep['handoffs']}, RLD token share {rep['token_share']['rld']:.1%}")
    loads = {k: {"before": runs[k].get("load_before"), "after": runs[k].get("load_after")}
             for k in ("fit", "compare")}
    print(f"load average (1/5/15 min) fit run: {loads['fit']}, compare run: {loads['compare']}")
    result = {
        "rate_per_s": rate, "target_util": args.target_util, "probe": runs.get("probe"),
        "fit": fit, "chip_profiles": chips_text, "rows": rows, "goal": goal,
        "testbed": {"completed": len(records), "requests": len(runs["compare"]["records"]),
                    "ttft_s": real["TTFT"], "itl_s": real["ITL"], "p_busy_fraction": cmp_busy,
                    "pipelines": pipes, "handoffs": modes,
                    "rld_token_share": rld_tok / max(all_tok, 1)},
        "sim": {k: rep[k] for k in ("ttft_s", "itl_s", "pipelines", "handoffs", "token_share",
                                    "busy", "rld", "wan", "handoff_gap_s", "unfinished")},
        "load_average": loads, "args": runs["args"], "reused": args.reuse}
    path = out / "calibration.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    title = (f"{len(records)} requests at {rate:.2f}/s, {args.model}, {args.bw_mbit:g} Mbit/s "
             f"{args.rtt_ms:g} ms RTT; load avg {loads['compare']['after'][0]:.1f}; "
             f"goal {'met' if all(goal.values()) else 'missed'}")
    plot(out / "calibration.png", real_ttft, real_itl, sim, fit, title)
    print(f"wrote {path}, {out / 'calibration.png'}, {runs_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
