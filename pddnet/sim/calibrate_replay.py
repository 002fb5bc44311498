"""The calibration's replay: the testbed's whole stream through the simulator with the fitted
profiles, P scheduling as the engine does and the fitted contention. See pddnet.sim.calibrate.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pddnet.sim.calibrate_fit import load_excess

PROXY_CHUNK_BYTES = 32 * 1024  # emulation.proxy.WanProxy.chunk_bytes (default)
PROXY_QUEUE_BYTES = 1 << 20  # emulation.effects: queue_bytes default
DECODE_SEGMENT_STEPS = 4  # the simulator costs this many decode steps at once


def engine_like(
    system: Any,
    p_max_seqs: int,
    host_weights: dict[str, float] | None,
    load: Any = None,
    export_wait: float = 0.0,
) -> None:
    """Make a fresh SimulatedSystem schedule and share cores as the testbed does (hooks the
    simulator's config has no key for, so the calibration sets them on its own instances):
    - P batches waiting prompts into a step up to the token budget, at most `p_max_seqs` of
      them, admitting only between steps (pddnet/engine/scheduler.py; PrefillInstance);
    - a finished prompt's KV leaves P only after the next step when that one starts at once,
      with probability `export_wait` (PrefillInstance's; fitted by `fit_export_wait`);
    - with `host_weights`, P, RLD and MD share one host (pddnet.device.cost.SharedHost): P's
      forwards are slower by weight "p_per_decoder" for each decode instance stepping, each
      decode step by "<role>_while_p" while P prefills, and with `load` (run time -> the
      recorded load average above its floor) every forward by "p_per_load" /
      "<role>_per_load" per unit of it (fitted by `fit_all`)."""
    from dataclasses import replace

    from pddnet.device.cost import SharedHost
    from pddnet.sim.prefill import PrefillInstance

    e = system.cfg.engine
    system.prefill = [
        PrefillInstance(
            system.loop,
            p.cost,
            p.name,
            p.q,
            p.block_units,
            e.chunk_tokens,
            p.cache is not None,
            max_seqs=p_max_seqs,
            export_wait=export_wait,
            host_step_s=p.host_step_s,
        )
        for p in system.prefill
    ]
    if not host_weights:
        return
    decoders = [("relay", d) for d in system.relay] + [
        ("main_decode", d.inst) for d in system.decode
    ]
    weights: dict[tuple[str, str], float] = {}
    for p in system.prefill:
        for role, d in decoders:
            weights[(p.name, d.name)] = host_weights["p_per_decoder"]
            weights[(d.name, p.name)] = host_weights[f"{role}_while_p"]
    if load is not None:
        for p in system.prefill:
            weights[(p.name, "outside")] = host_weights["p_per_load"]
        for role, d in decoders:
            weights[(d.name, "outside")] = host_weights[f"{role}_per_load"]
    host = SharedHost(weights)
    if load is not None:
        host.join("outside", lambda: load(system.loop.now))
    for inst in [*system.prefill, *(d for _, d in decoders)]:
        host.join(inst.name, lambda inst=inst: inst.busy)
    for inst in [*system.prefill, *(d for _, d in decoders)]:
        inst.cost = replace(inst.cost, host=host, host_member=inst.name)


def tagged_system_class(
    tags: list[str],
    p_max_seqs: int = 1,
    host_weights: dict[str, float] | None = None,
    load: Any = None,
    export_wait: float = 0.0,
) -> tuple[type, dict[str, Any]]:
    """A SimulatedSystem that also files every request's TTFT and ITL gaps under its tag (trace
    rid = line = position in the interleaved stream), so the comparison covers compare-tagged
    requests only. It taps the per-member accounting of pddnet/sim/decode.py (each member of a
    segment of k steps makes k gaps, the step time or across a jittery line each step's own:
    `member_gaps`; a final extend emits one gap) and checks it against the run's own ITL
    histogram at the end."""
    from pddnet.sim.decode import DecodeInstance
    from pddnet.sim.metrics import Histogram
    from pddnet.sim.system import SimulatedSystem

    hists = {tag: {"ttft": Histogram(), "itl": Histogram()} for tag in set(tags)}
    got = {"ttft": 0}

    def tag_of(m: Any) -> str:
        return tags[m.state.req.rid]

    class TaggedDecode(DecodeInstance):
        def _account(self, k: int, tau: float, now: float) -> None:
            gaps = self.segment_gaps(k, tau)
            for fs, _, m in self._heap:
                if not (m.alive and fs == m.finish_step and m.join_step >= 0):
                    continue
                h = hists[tag_of(m)]["itl"]
                for gap in self.member_gaps(m, k, gaps):
                    h.add(gap)
            super()._account(k, tau, now)

        def _end_segment(self, token: int) -> None:
            ending = [
                (m, m.prev_user)
                for m, c in self._step_extend
                if token == self._token and m.alive and m.extend_final and m.extend_left - c <= 0
            ]
            super()._end_segment(token)
            for m, before in ending:  # the final extend step's token
                if m.prev_user != before:
                    hists[tag_of(m)]["itl"].add(m.prev_user - before)

    class TaggedSystem(SimulatedSystem):
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            for inst in [*self.relay, *(d.inst for d in self.decode)]:
                inst.__class__ = TaggedDecode
            engine_like(self, p_max_seqs, host_weights, load, export_wait)

        def _first_token(self, st: Any, user: float) -> None:
            super()._first_token(st, user)
            hists[tags[st.req.rid]]["ttft"].add(max(0.0, user - st.req.arrival_s))
            got["ttft"] += 1

    return TaggedSystem, hists


def simulate_same(
    workload: list[tuple[str, Any]],
    chips: dict[str, Path],
    fit: dict[str, Any],
    args: argparse.Namespace,
    tmp: Path,
    load_samples: list[tuple[float, float]] | None = None,
    export_wait: float = 0.0,
) -> tuple[Any, Any, dict[str, Any]]:
    """The whole interleaved stream (both tags: both loaded P, RLD and MD) in the simulator
    with the testbed's settings; returns the report, the SimulatedSystem and the per-tag
    TTFT / ITL histograms."""
    from tqdm import tqdm

    import pddnet.sim.runner as runner
    from pddnet.config import load_config as load_cluster
    from pddnet.sim.config import parse_config

    trace = tmp / "calib.jsonl"
    with trace.open("w") as f:
        for _, r in workload:
            f.write(
                json.dumps(
                    {
                        "arrival_s": r.arrival_s,
                        "prompt_tokens": len(r.prompt_token_ids),
                        "output_tokens": r.max_tokens,
                        "prefix_ids": list(r.prompt_token_ids),
                    }
                )
                + "\n"
            )
    cl = load_cluster(None, {"model.name": args.model})
    pol, d = cl.policy, cl.prefill
    # The fixed latencies: before P (router, KV_ALLOC) is the simulator's host latency (the
    # request reaches P that much later); RLD's first token to the client, which the
    # simulator has no place for, rides on the intra-DC latency with the copy's own: it adds
    # to TTFT and occupies no one.
    lat = fit["relay_path"]["latency_s"] + fit["relay_path"]["to_client_s"]
    cfg = parse_config(
        {
            "seed": args.seed,
            "model": args.model,
            "tokens_per_unit": 1,
            "systems": ["pdd"],
            "pdd": {
                role_key: {"chip": str(chips[role]), "instances": 1, "gpus": 1}
                for role_key, role in (
                    ("prefill", "prefill"),
                    ("relay", "relay"),
                    ("main_decode", "main_decode"),
                )
            },
            "baseline": {
                "prefill": {"chip": str(chips["prefill"])},
                "decode": {"chip": str(chips["main_decode"])},
            },
            "line": {
                "bw_gbit": args.bw_mbit / 1e3,
                "rtt_ms": args.rtt_ms,
                "jitter_ms": args.jitter_ms,
                "queue_mb": PROXY_QUEUE_BYTES / (1 << 20),
                "piece_mb": PROXY_CHUNK_BYTES / (1 << 20),
                "piece_ms": 0.0,
            },
            "engine": {
                "block_tokens": d.block_size,
                "chunk_tokens": d.max_num_batched_tokens,
                "max_seqs": d.max_num_seqs,
                "memory_utilisation": 1.0,
                # short decode segments: a segment's step time is read once (contention)
                "segment_steps": DECODE_SEGMENT_STEPS,
                "rdma_latency_us": lat * 1e6,
                "host_latency_us": fit["prefill"]["to_engine_s"] * 1e6,
            },
            "policy": {
                "handoff": pol.handoff,
                "handoff_threshold": pol.handoff_threshold_tokens,
                "handoff_chunk": pol.handoff_chunk,
                "rld_load_limit": pol.rld_load_limit,
                "rld_max_requests": pol.rld_max_requests,
                "direct_budget_s": pol.direct_budget_s,
                "singular_filter": pol.singular_filter,
                "singular_margin": pol.singular_margin,
            },
            "workload": {
                "kind": "trace",
                "path": str(trace),
                "requests": len(workload),
                "arrivals": "open",
            },
        }
    )
    captured: dict[str, Any] = {}
    original, original_system = runner.report, runner.SimulatedSystem
    load = load_excess(load_samples)[1] if fit.get("load_floor") is not None else None
    system_cls, hists = tagged_system_class(
        [tag for tag, _ in workload], d.max_num_seqs, fit.get("host_weights"), load, export_wait
    )

    def capture(sim: Any) -> dict[str, Any]:  # the report drops the ITL histogram's CDF
        captured["sim"] = sim
        return original(sim)

    bar = tqdm(total=len(workload), desc="simulator", unit="req")
    runner.report, runner.SimulatedSystem = capture, system_cls
    try:
        rep = runner.simulate(cfg, "pdd", progress=bar.update)
    finally:
        runner.report, runner.SimulatedSystem = original, original_system
        bar.close()
    sim = captured["sim"]
    n_itl = sum(h["itl"].n for h in hists.values())
    n_ttft = sum(h["ttft"].n for h in hists.values())
    if abs(n_itl - sim.itl.n) > 1e-6 or n_ttft != sim.ttft.n:
        raise RuntimeError(
            f"per-tag tap lost samples: ITL {n_itl} of {sim.itl.n}, TTFT "
            f"{n_ttft} of {sim.ttft.n} (pddnet/sim/decode.py changed?)"
        )
    return rep, sim, hists
