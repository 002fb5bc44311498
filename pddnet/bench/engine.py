"""Engine step time against context length: gather vs paged attention, beside the roofline.

The old gather path and paged attention side by side, and the roofline time of the same
forward on a modelled target (a big model on a real chip).

Each shape is one forward of the model runner -- what ``Engine.step`` runs, without the
scheduling and sampling around it (well under a millisecond):

- prefill: a chunk of C new tokens on top of a cached context of n tokens (positions n..n+C-1);
- decode: a batch of B sequences, each at context n, one new token each (position n).

Both paths run on the same pool and model in one process with one torch thread, interleaved
repeat by repeat (so a change in the machine's load hits both alike); the median of the repeats
is reported. "gather" is the previous attention (copy each sequence's whole KV out of the pool
per layer, then a full [t, n] score matrix); "paged" reads the pool in place, tile by tile
(pddnet/model/paged_attention.py). The cached context's KV is seeded random values: attention
costs the same whatever the keys hold, and filling 64K tokens by real prefills would take
minutes. A shape the old path cannot hold in memory is recorded as skipped, not run.

Beside each, the modelled time of the same forward shape on the target (``InstanceCost``'s
roofline, one chunk per sequence: [n, n+C) for a prefill, [n, n+1) per decoding sequence), and
real / modelled: the smallest time dilation k at which an engine paced to the target's clock
would not overrun that step.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from pddnet.bench.options import add_run_arguments
from pddnet.bench.plots import panels_plot
from pddnet.bench.progress import progress
from pddnet.bench.results import announce, run_config, write_result

PATHS = ("gather", "paged")
GIB = 2**30
# A shape whose warm-up took longer than this (the old path's 64K prefill: ~20 s) gets at most
# SLOW_REPEATS timed repeats, which keeps the default run within minutes.
SLOW_SHAPE_S = 5.0
SLOW_REPEATS = 3


# -- shapes and the old path's memory ---------------------------------------------------------


def shapes(
    contexts: list[int], chunks: list[int], batches: list[int], max_position: int
) -> list[dict[str, Any]]:
    """Every (kind, context, size) to measure, prefill chunks first; shapes past the model's
    last position are left out."""
    out: list[dict[str, Any]] = []
    for c in chunks:
        out += [
            {"kind": "prefill", "context": n, "chunk": c, "batch": 1}
            for n in contexts
            if n + c <= max_position
        ]
    for b in batches:
        out += [
            {"kind": "decode", "context": n, "chunk": 1, "batch": b}
            for n in contexts
            if n + 1 <= max_position
        ]
    return out


def gather_temp_bytes(
    shape: dict[str, Any], num_heads: int, num_kv_heads: int, head_dim: int, itemsize: int
) -> int:
    """Peak temporaries of the old path for one sequence's attention in one layer: its gathered
    K and V, the [Hq, t, n] scores and their softmax, and the causal mask."""
    t, n = shape["chunk"], shape["context"] + shape["chunk"]
    kv = 2 * n * num_kv_heads * head_dim * itemsize
    return kv + 2 * num_heads * t * n * itemsize + t * n


def modelled_step_s(cost: Any, shape: dict[str, Any]) -> float:
    n, c, b = shape["context"], shape["chunk"], shape["batch"]
    return float(cost.prefill_step_time([(n, n + c)] * b))


# -- measuring ------------------------------------------------------------------------------


class Setup:
    """A model and one pool holding `max_batch` sequences of up to `tokens` tokens each, on
    consecutive blocks (as a fresh engine's allocator hands them out), filled with seeded
    random KV; one runner per attention path on it."""

    def __init__(self, model: Any, tokens: int, max_batch: int, block_size: int, seed: int) -> None:
        import torch

        from pddnet.engine.runner import ModelRunner
        from pddnet.kv.pool import KVPool, KVSpec

        spec = KVSpec.from_model_config(model.config, block_size)
        self.per_seq = spec.num_blocks_for(tokens)
        self.pool = KVPool(spec, self.per_seq * max_batch)
        gen = torch.Generator().manual_seed(seed)
        for layer in range(spec.num_layers):  # layer by layer: no pool-sized float32 temporary
            self.pool.data[layer].copy_(torch.randn(self.pool.data[layer].shape, generator=gen))
        self.runners = {p: ModelRunner(model, self.pool, attention=p) for p in PATHS}
        self.gen = gen

    def table(self, seq: int) -> list[int]:
        return list(range(seq * self.per_seq, (seq + 1) * self.per_seq))

    def chunks(self, shape: dict[str, Any]) -> list[Any]:
        import torch

        from pddnet.engine.runner import Chunk

        n, c = shape["context"], shape["chunk"]
        ids = torch.randint(0, 256, (shape["batch"], c), generator=self.gen).tolist()
        return [Chunk(ids[s], n, self.table(s)) for s in range(shape["batch"])]

    def close(self) -> None:
        self.pool.close()


def measure(
    setup: Setup,
    shape: dict[str, Any],
    paths: list[str],
    repeats: int,
    old_cap_bytes: int,
    old_bytes: int,
) -> dict[str, Any]:
    """Median step time of each path on one shape (a warm-up run first, then the paths
    interleaved repeat by repeat; fewer repeats for a slow shape), and how far their logits
    differ."""
    chunks = setup.chunks(shape)
    runnable = [p for p in paths if p != "gather" or old_bytes <= old_cap_bytes]
    result: dict[str, Any] = {
        p: {
            "skipped": f"needs ~{old_bytes / GIB:.1f} GiB of temporaries "
            f"per layer (cap {old_cap_bytes / GIB:.1f} GiB)"
        }
        for p in paths
        if p not in runnable
    }
    times: dict[str, list[float]] = {p: [] for p in runnable}
    logits: dict[str, Any] = {}
    rep, slowest = 0, 0.0
    while rep <= (repeats if slowest <= SLOW_SHAPE_S else min(repeats, SLOW_REPEATS)):
        for p in list(runnable):  # repeat 0 is the warm-up (first touch)
            try:
                t0 = time.perf_counter()
                out = setup.runners[p].run(chunks)
                dt = time.perf_counter() - t0
            except (RuntimeError, MemoryError) as exc:  # torch reports a failed alloc so
                if p != "gather":  # the paged path's memory is bounded: a failure is a bug
                    raise
                result[p] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
                runnable.remove(p)
                continue
            if rep:
                times[p].append(dt)
            else:
                slowest = max(slowest, dt)
            logits[p] = out
        rep += 1
    for p in runnable:
        result[p] = {"median_s": statistics.median(times[p]), "times_s": times[p]}
    if len(logits) == 2 and all(p in runnable for p in logits):
        result["max_logit_diff"] = max(
            float((a - b).abs().max()) for a, b in zip(*logits.values(), strict=True)
        )
    return result


# -- the benchmark ----------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args)
    check_args(args)
    return await asyncio.to_thread(_run, args)


def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from pddnet.device.cost import InstanceCost
    from pddnet.device.profiles import load_chip, load_model
    from pddnet.model.loader import load_model as load_engine_model

    cost = InstanceCost(load_chip(args.chip), load_model(args.target_model), gpus=args.gpus)
    model, _ = load_engine_model(args.model, seed=args.seed)
    cfg = model.config
    todo = shapes(args.contexts, args.chunks, args.batches, cfg.max_position)
    if not todo:
        raise ValueError(f"no shape fits the model's {cfg.max_position} positions")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        with progress(len(todo), "engine", "shape", enabled=not args.no_progress) as bar:
            for n in sorted({s["context"] for s in todo}):
                here = [s for s in todo if s["context"] == n]
                tokens = n + max(s["chunk"] for s in here)
                batch = max(s["batch"] for s in here)
                setup = Setup(model, tokens, batch, args.block_size, args.seed)
                try:
                    for shape in here:
                        old = gather_temp_bytes(
                            shape, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.itemsize
                        )
                        m = measure(
                            setup, shape, args.paths, args.repeats, int(args.max_old_gib * GIB), old
                        )
                        rows.append(_row(shape, m, modelled_step_s(cost, shape)))
                        bar.update(1)
                finally:
                    setup.close()
    finally:
        torch.set_num_threads(threads)
    config = run_config(args)
    data = {
        "config": config,
        "torch_threads": 1,
        "model": _model_info(cfg),
        "target": {
            "chip": args.chip,
            "gpus": args.gpus,
            "model": args.target_model,
            "note": "modelled: roofline time of the same forward shape",
        },
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
        "elapsed_s": time.perf_counter() - started,
        "rows": rows,
    }
    path = write_result("engine", data, args.out)
    plots = _plots(rows, path, args)
    print_table(data, args)
    announce(path, plots)
    return {"path": str(path), "rows": rows, "plots": plots}


def _row(shape: dict[str, Any], m: dict[str, Any], modelled: float) -> dict[str, Any]:
    row: dict[str, Any] = {**shape, "modelled_s": modelled, "paths": {}, "k": {}}
    for p in PATHS:
        if p in m:
            row["paths"][p] = m[p]
            if "median_s" in m[p]:
                row["k"][p] = m[p]["median_s"] / modelled
    g, q = (row["paths"].get(p, {}).get("median_s") for p in PATHS)
    row["speedup"] = g / q if g and q else None
    row["max_logit_diff"] = m.get("max_logit_diff")
    return row


def _model_info(cfg: Any) -> dict[str, Any]:
    return {
        "name": cfg.name,
        "dtype": cfg.dtype,
        "layers": cfg.num_layers,
        "heads": cfg.num_heads,
        "kv_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position": cfg.max_position,
        "parameters": cfg.num_parameters,
    }


def _label(row: dict[str, Any]) -> str:
    return f"prefill C={row['chunk']}" if row["kind"] == "prefill" else f"decode B={row['batch']}"


def _plots(rows: list[dict[str, Any]], path: Any, args: argparse.Namespace) -> list[str]:
    panels = []
    for label in dict.fromkeys(_label(r) for r in rows):
        mine = [r for r in rows if _label(r) == label]
        series: dict[str, tuple[list[float], list[float]]] = {}
        for p in PATHS:
            pts = [
                (r["context"], r["paths"][p]["median_s"] * 1e3)
                for r in mine
                if "median_s" in r["paths"].get(p, {})
            ]
            if pts:
                series[f"{p} ({'new' if p == 'paged' else 'old'})"] = (
                    [x for x, _ in pts],
                    [y for _, y in pts],
                )
        series[f"modelled {args.target_model}"] = (
            [r["context"] for r in mine],
            [r["modelled_s"] * 1e3 for r in mine],
        )
        panels.append((f"{label}: step ms", series))
    png = panels_plot(
        panels,
        path.with_suffix(".png"),
        "context tokens",
        f"{args.model} step time vs context (1 torch thread) and "
        f"{args.target_model} on {args.gpus} x {args.chip} (roofline)",
        logx=True,
        logy=True,
        ncols=3,
    )
    return [str(png)] if png else []


def _ms(entry: dict[str, Any]) -> str:
    if "median_s" in entry:
        return f"{entry['median_s'] * 1e3:.1f}"
    return "skipped" if "skipped" in entry else ("error" if "error" in entry else "-")


def print_table(data: dict[str, Any], args: argparse.Namespace) -> None:
    m, load = data["model"], data["loadavg_before"]
    print(
        f"\nengine step time: model {m['name']} ({m['dtype']}, {m['layers']} layers, "
        f"{m['heads']}/{m['kv_heads']} heads x {m['head_dim']}), 1 torch thread, median of "
        f"{args.repeats}; load average {load[0]:.2f} before, {data['loadavg_after'][0]:.2f} "
        f"after"
    )
    print(
        f"modelled: {args.target_model} on {args.gpus} x {args.chip} (roofline); "
        f"k = real / modelled, the least time dilation without overrun"
    )
    print(
        f"{'shape':<16} {'context':>8} {'gather ms':>10} {'paged ms':>9} {'speedup':>8} "
        f"{'model ms':>9} {'k gather':>9} {'k paged':>8}"
    )
    for r in data["rows"]:
        k = {p: (f"{r['k'][p]:.1f}" if p in r["k"] else "-") for p in PATHS}
        sp = f"{r['speedup']:.2f}x" if r["speedup"] else "-"
        print(
            f"{_label(r):<16} {r['context']:>8} {_ms(r['paths'].get('gather', {})):>10} "
            f"{_ms(r['paths'].get('paged', {})):>9} {sp:>8} {r['modelled_s'] * 1e3:>9.2f} "
            f"{k['gather']:>9} {k['paged']:>8}"
        )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="short contexts, few repeats (smoke)")
    p.add_argument("--model", default="tiny-long", help="preset or HF folder to run for real")
    p.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[1024, 4096, 16384, 65536],
        help="cached context lengths n",
    )
    p.add_argument(
        "--chunks",
        type=int,
        nargs="+",
        default=[512, 2048],
        help="prefill chunk sizes C (new tokens on top of n)",
    )
    p.add_argument(
        "--batches", type=int, nargs="+", default=[1, 4, 16, 32], help="decode batch sizes B"
    )
    p.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--max-old-gib",
        type=float,
        default=6.0,
        help="skip a gather-path shape whose temporaries would exceed this",
    )
    p.add_argument("--chip", default="h100-sxm", help="modelled chip profile")
    p.add_argument("--gpus", type=int, default=8, help="modelled chips per instance")
    p.add_argument("--target-model", default="llama-3-70b", help="modelled model profile")
    add_run_arguments(p)


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.contexts, args.chunks, args.batches = [256, 1024], [128], [1, 4]
        args.repeats = 2


def check_args(args: argparse.Namespace) -> None:
    for name in ("contexts", "chunks", "batches"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            raise ValueError(f"--{name} must be >= 1")
    if args.repeats < 1 or args.block_size < 1 or args.gpus < 1:
        raise ValueError("--repeats, --block-size and --gpus must be >= 1")
    if args.max_old_gib <= 0:
        raise ValueError("--max-old-gib must be > 0")
