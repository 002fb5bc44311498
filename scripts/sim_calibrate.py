"""Calibrate the simulator against the real testbed: same workload, TTFT and ITL side by side.

1. Fit a chip profile to this machine: time the `small` model's prefill chunks and decode steps
   in pddnet's own engine (1 torch thread, like each daemon), then least-squares
   t = overhead + FLOPs / rate (prefill) and t = overhead + bytes / bandwidth (decode).
2. Run the seeded workload (pddnet.bench.workload.poisson_long_prompts, a few hundred requests)
   on the real cluster (LocalCluster, mode pdd, emulated WAN), measured by a streaming client.
3. Replay the same requests (their real token ids as units, tokens_per_unit = 1) in the
   simulator with the fitted profile for P, RLD and MD, the testbed's link and pool sizes.
4. Print both TTFT and ITL distributions and the relative errors (goal: medians within 15%,
   P90 within 25%).

Heavy: several minutes of both cores. Run it wrapped in `timeout`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

FIT_PREFILL = (128, 512, 1024, 2048)
FIT_BATCH = (1, 4, 16)


def fit_profile(model_name: str, threads: int) -> dict[str, Any]:
    import torch

    from pddnet.engine.engine import Engine
    from pddnet.model.config import ModelConfig
    from pddnet.model.weights import init_random
    from pddnet.sim.profiles import load_model

    torch.set_num_threads(threads)
    cfg = ModelConfig.preset(model_name)
    prof = load_model(model_name)
    model = init_random(cfg, seed=0)
    kvpt = cfg.kv_bytes_per_token
    attn = 4.0 * prof.num_layers * prof.num_heads * prof.head_dim
    pre_x, pre_t, dec_x, dec_t = [], [], [], []
    with Engine(model, num_blocks=2048, max_num_batched_tokens=4096) as eng:
        eng.generate([1, 2, 3], max_tokens=2)                       # warm-up
        for n in FIT_PREFILL:
            rid = eng.add_request([(i * 7) % 250 for i in range(n)], max_tokens=1)
            t0 = time.perf_counter()
            while eng.has_request(rid) and not eng.get_sequence(rid).is_finished:
                eng.step()
            pre_t.append(time.perf_counter() - t0)
            pre_x.append(2.0 * prof.active_params * n + attn * n * (n + 1) / 2)
            eng.abort(rid)                 # no-op once the finished request is gone
        for b in FIT_BATCH:
            ctx = 512
            ids = [eng.add_request([(i * 13 + j) % 250 for i in range(ctx)], max_tokens=40)
                   for j in range(b)]
            for _ in range(4):                                        # prefill them, a few steps
                eng.step()
            times = []
            for _ in range(20):
                t0 = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - t0)
            times.sort()
            dec_t.append(times[len(times) // 2])
            dec_x.append(prof.weight_bytes + (b * ctx + b) * kvpt)
            for rid in ids:
                eng.abort(rid)

    def line(xs: list[float], ys: list[float]) -> tuple[float, float]:
        n = len(xs)
        mx, my = sum(xs) / n, sum(ys) / n
        sxx = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
        return max(my - slope * mx, 0.0), max(slope, 1e-30)

    pre_a, pre_s = line(pre_x, pre_t)
    dec_a, dec_s = line(dec_x, dec_t)
    return {"flops_per_s": 1.0 / pre_s, "bytes_per_s": 1.0 / dec_s, "overhead_s": dec_a,
            "prefill_overhead_s": pre_a, "prefill": list(zip(FIT_PREFILL, pre_t, strict=True)),
            "decode": list(zip(FIT_BATCH, dec_t, strict=True))}


def chip_toml(fit: dict[str, Any], memory_gb: float) -> str:
    tf = fit["flops_per_s"] / 1e12
    return (f'name = "cpu-fitted"\nmemory_gb = {memory_gb:.6f}\n'
            f'memory_bw_gbs = {fit["bytes_per_s"] / 1e9:.6f}\nscale_up_gbs = 10\n'
            f"scale_out_gbit = 20\nprice_per_hour = 0.05\ncompute_efficiency = 1.0\n"
            f"bandwidth_efficiency = 1.0\nstep_overhead_ms = {fit['overhead_s'] * 1e3:.4f}\n"
            f"[tflops]\nfp32 = {tf:.6f}\nbf16 = {tf:.6f}\nfp8 = {tf:.6f}\n")


async def run_testbed(workload: list[Any], args: argparse.Namespace) -> list[Any]:
    """The workload on a real PDD cluster, each request streamed and timed by the client."""
    import aiohttp

    from pddnet.bench.client import stream_completion
    from pddnet.cluster.local import LocalCluster

    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(total=len(workload), desc="testbed", unit="req") if tqdm else None
    async with LocalCluster(mode="pdd", model=args.model, wan="proxy", rtt_ms=args.rtt_ms,
                            jitter_ms=args.jitter_ms, bw_mbit=args.bw_mbit,
                            overrides={"model.threads": 1}) as cluster:
        timeout = aiohttp.ClientTimeout(total=300.0)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await stream_completion(session, cluster.url, {"prompt": [1, 2, 3], "max_tokens": 2})
            start = time.monotonic()

            async def one(req: Any) -> Any:
                await asyncio.sleep(max(0.0, req.arrival_s - (time.monotonic() - start)))
                rec = await stream_completion(session, cluster.url, {
                    "model": args.model, "prompt": list(req.prompt_token_ids),
                    "max_tokens": req.max_tokens, "temperature": 0, "ignore_eos": True})
                if bar is not None:
                    bar.update(1)
                return rec

            try:
                return await asyncio.gather(*(one(r) for r in workload))
            finally:
                if bar is not None:
                    bar.close()


def simulate_same(workload: list[Any], chip_path: Path, args: argparse.Namespace,
                  tmp: Path) -> dict[str, Any]:
    from pddnet.config import load_config as load_cluster
    from pddnet.sim.config import parse_config
    from pddnet.sim.runner import simulate

    trace = tmp / "calib.jsonl"
    with trace.open("w") as f:
        for r in workload:
            f.write(json.dumps({"arrival_s": r.arrival_s, "prompt_tokens": len(r.prompt_token_ids),
                                "output_tokens": r.max_tokens,
                                "prefix_ids": list(r.prompt_token_ids)}) + "\n")
    cluster = load_cluster(None, {"model.name": args.model})
    d = cluster.prefill
    pool = {"chip": str(chip_path), "instances": 1, "gpus": 1}
    cfg = parse_config({
        "seed": args.seed, "model": args.model, "tokens_per_unit": 1, "systems": ["pdd"],
        "pdd": {"prefill": pool, "relay": pool, "main_decode": pool},
        "baseline": {"prefill": pool, "decode": pool},
        "line": {"bw_gbit": args.bw_mbit / 1e3, "rtt_ms": args.rtt_ms,
                 "jitter_ms": args.jitter_ms, "queue_mb": 1, "piece_mb": 0.25},
        "engine": {"block_tokens": d.block_size, "chunk_tokens": d.max_num_batched_tokens,
                   "max_seqs": d.max_num_seqs, "memory_utilisation": 1.0},
        "policy": {"handoff": "dynamic"},
        "workload": {"kind": "trace", "path": str(trace), "requests": len(workload)}})
    return simulate(cfg, "pdd")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=(256, 768))
    ap.add_argument("--max-tokens", type=int, nargs=2, default=(16, 48))
    ap.add_argument("--rtt-ms", type=float, default=30.0)
    ap.add_argument("--jitter-ms", type=float, default=2.0)
    ap.add_argument("--bw-mbit", type=float, default=100.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/sim")
    args = ap.parse_args()

    from pddnet.bench.results import summary
    from pddnet.bench.workload import poisson_long_prompts
    from pddnet.config import load_config as load_cluster
    from pddnet.sim.profiles import load_model

    print("fitting a chip profile to this machine ...")
    fit = fit_profile(args.model, threads=1)
    prof = load_model(args.model)
    blocks = load_cluster(None, {}).prefill.num_blocks
    block = load_cluster(None, {}).prefill.block_size
    memory_gb = (prof.weight_bytes + blocks * block * prof.kv_bytes_per_token) / 1e9
    print(f"  prefill {fit['flops_per_s'] / 1e9:.1f} GFLOP/s, decode "
          f"{fit['bytes_per_s'] / 1e9:.2f} GB/s, step overhead {fit['overhead_s'] * 1e3:.2f} ms")
    workload = poisson_long_prompts(args.requests, args.rate, tuple(args.prompt_len),
                                    tuple(args.max_tokens), seed=args.seed)
    print(f"testbed: {len(workload)} requests at {args.rate}/s on the real cluster ...")
    records = asyncio.run(run_testbed(workload, args))
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    real_ttft = summary([r.ttft_s for r in ok])
    real_itl = summary([g for r in ok for g in r.inter_token_s()])
    with tempfile.TemporaryDirectory() as tmp:
        chip = Path(tmp) / "cpu-fitted.toml"
        chip.write_text(chip_toml(fit, memory_gb))
        sim = simulate_same(workload, chip, args, Path(tmp))
        chip_text = chip.read_text()
    rows = []
    print(f"\n{'metric':<10} {'testbed':>10} {'sim':>10} {'error':>8}   (seconds)")
    for name, real, simd in (("TTFT", real_ttft, sim["ttft_s"]), ("ITL", real_itl, sim["itl_s"])):
        for q in ("p50", "p90", "p99"):
            a, b = real[q], simd[q]
            err = None if not a or b is None else (b - a) / a
            rows.append({"metric": name, "q": q, "testbed": a, "sim": b, "error": err})
            print(f"{name + ' ' + q:<10} {a or 0:10.4f} {b or 0:10.4f} "
                  f"{'-' if err is None else f'{err:+7.1%}'}")
    goal = {"medians within 15%": all(abs(r["error"] or 9) <= 0.15 for r in rows
                                     if r["q"] == "p50"),
            "P90 within 25%": all(abs(r["error"] or 9) <= 0.25 for r in rows if r["q"] == "p90")}
    print("goal:", ", ".join(f"{k}: {'reached' if v else 'missed'}" for k, v in goal.items()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "calibration.json"
    path.write_text(json.dumps({"fit": fit, "chip_profile": chip_text, "rows": rows,
                                "goal": goal, "testbed_completed": len(ok),
                                "requests": len(records), "args": vars(args),
                                "sim": {k: sim[k] for k in ("ttft_s", "itl_s", "pipelines",
                                                            "handoffs", "token_share")}},
                               indent=1, default=str))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
