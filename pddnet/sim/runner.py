"""Run systems on a workload and report: latency distributions, SLA goodput, token shares, WAN
bytes, handoffs, RLD queue depth, hardware cost and the benefit-cost ratio against the baseline.

Results are plain dicts with rounded floats and no wall-clock figures, so the same config and
seed give byte-identical JSON (``json.dumps(result, sort_keys=True)``).
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
from array import array
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from pddnet.sim.config import SimConfig
from pddnet.sim.system import SimulatedSystem
from pddnet.workload.agent_stream import agent_params_in_units, agent_stream
from pddnet.workload.trace import trace_stream
from pddnet.workload.units import SimRequest

BASELINE = "same-dc"

# The event loop allocates millions of short-lived tuples; with CPython's default threshold
# (700) the young generation is collected every few events, and each collection of an older
# generation walks the whole (growing) simulated state: ~20% of a large run, growing with it.
# Collecting every 500K (net) allocations keeps the few cycles left bounded at a fraction of
# the cost (session 8, 100K requests: 9 young collections, 0.38 s, against 13 and 0.63 s every
# 100K). Speed only: nothing in a run depends on when garbage is collected.
GC_THRESHOLDS = (500_000, 50, 100)


@contextmanager
def _sparse_gc() -> Iterator[None]:
    old = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*old)


def requests_for(cfg: SimConfig) -> Iterator[SimRequest]:
    """The config's workload as a stream (rate_scale applied)."""
    w = cfg.workload
    if w.kind == "trace":
        assert w.path is not None, "a trace workload names its file (config checks it)"
        for r in trace_stream(w.path, cfg.tokens_per_unit, w.requests):
            yield r.sent_at(round(r.arrival_s / w.rate_scale, 6))
        return
    params = agent_params_in_units(w.agent, cfg.tokens_per_unit)
    params = dataclasses.replace(
        params,
        num_conversations=max(params.num_conversations, 1),
        conversation_rate_per_s=params.conversation_rate_per_s * w.rate_scale,
    )
    yield from agent_stream(params, cfg.seed, cfg.tokens_per_unit, w.requests)


class Schedule:
    """Send times by request id, recorded from one run (the baseline's) and replayed in others,
    so every system is offered the very same requests at the very same times."""

    def __init__(self) -> None:
        self.times = array("d")

    def record(self, rid: int, t: float) -> None:
        if rid >= len(self.times):
            self.times.extend([-1.0] * (rid + 1 - len(self.times)))
        self.times[rid] = t

    def replay(self, source: Iterator[SimRequest]) -> Iterator[SimRequest]:
        """``source`` (in generated order) re-timed to the recorded send times, in that order.
        A recorded time is never before the generated arrival, so a request may leave the
        buffer once the generator has reached its time: the buffer holds only the requests the
        recorded run had deferred, never the whole workload."""
        heap: list[tuple[float, int, SimRequest]] = []
        for r in source:
            if r.rid >= len(self.times) or self.times[r.rid] < 0:
                raise ValueError(f"request {r.rid} was never sent in the recorded run")
            heapq.heappush(heap, (self.times[r.rid], r.rid, r))
            while heap and heap[0][0] <= r.arrival_s:
                t, _, x = heapq.heappop(heap)
                yield x.sent_at(t)
        while heap:
            t, _, x = heapq.heappop(heap)
            yield x.sent_at(t)


def simulate(
    cfg: SimConfig,
    system: str,
    progress: Callable[[int], None] | None = None,
    replay: Schedule | None = None,
    record: Schedule | None = None,
    requests: Sequence[SimRequest] | None = None,
    plan_records: list[dict[str, Any]] | None = None,
    request_records: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One system on the config's workload (or on ``requests``, in arrival order: a live
    benchmark's own requests, see pddnet.bench.reproduce_sim); returns its report.

    Arrivals (``workload.arrivals``): "closed" and "baseline" keep agents causal -- a
    conversation's next turn is sent only once its previous turn finished, at max(its time,
    previous turn done); "open" sends every request at its own time regardless. With
    ``record`` the send times are stored; with ``replay`` the requests are offered at a
    recorded run's send times (then only a turn whose predecessor is slower here than there
    waits, and is counted in ``deferred_turns``). With ``plan_records`` (a list) every
    pipeline plan is appended to it (SimulatedSystem.plan_records), with ``request_records``
    every finished request's figures (SimulatedSystem.request_records)."""
    sim = SimulatedSystem(cfg, system)
    sim.plan_records = plan_records
    sim.request_records = request_records
    loop = sim.loop
    source = iter(requests) if requests is not None else requests_for(cfg)
    stream = source if replay is None else replay.replay(source)
    causal = cfg.workload.arrivals != "open"
    live: dict[int, int] = {}  # conversation -> its turns being served
    parked: dict[int, list[SimRequest]] = {}

    def send(req: SimRequest) -> None:
        conv = req.conversation
        if conv >= 0:
            n = live.get(conv, 0)
            if n:
                sim.counts["overlapping_turns"] += 1
            live[conv] = n + 1
        if record is not None:
            record.record(req.rid, loop.now)
        sim.arrive(req)
        if progress is not None:
            progress(1)

    def feed(req: SimRequest) -> None:
        if causal and req.conversation >= 0 and req.conversation in live:
            sim.counts["deferred_turns"] += 1
            parked.setdefault(req.conversation, []).append(req)
        else:
            send(req)
        nxt = next(stream, None)
        if nxt is not None:
            loop.at(nxt.arrival_s, feed, nxt)

    def turn_done(req: SimRequest, at: float) -> None:
        loop.at(max(at, loop.now), next_turn, req)

    def next_turn(req: SimRequest) -> None:
        conv = req.conversation
        if conv < 0:
            return
        n = live[conv] - 1
        if n:
            live[conv] = n
        else:
            del live[conv]
        waiting = parked.get(conv)
        if not waiting:
            return
        nxt = waiting.pop(0)
        if not waiting:
            del parked[conv]
        sim.deferral.add(loop.now - nxt.arrival_s)
        send(nxt.sent_at(loop.now))

    sim.on_request_done = turn_done

    first = next(stream, None)
    if first is None:
        raise ValueError("the workload is empty")
    loop.at(first.arrival_s, feed, first)
    with _sparse_gc():
        loop.run()
    return report(sim)


def _r(v: float | None, digits: int = 6) -> float | None:
    return None if v is None else round(v, digits)


def report(sim: SimulatedSystem) -> dict[str, Any]:
    c = sim.counts
    start = sim.first_arrival or 0.0
    span = max(sim.last_done, sim.last_arrival) - start
    arrival_span = sim.last_arrival - start
    tokens = c["rld_tokens"] + c["md_tokens"]
    finished = c["finished"]
    out: dict[str, Any] = {
        "system": sim.system,
        "deployment": sim.deployment.describe(),
        "gpus": sim.deployment.gpus_by_chip(),
        "cost_per_hour": _r(sim.hardware_cost_per_hour(), 4),
        "requests": c["requests"],
        "finished": finished,
        "unfinished": c["requests"] - finished,
        "ttft_s": sim.ttft.summary(),
        "tpot_s": sim.tpot.summary(),
        "itl_s": sim.itl.summary(),
        "e2e_s": sim.e2e.summary(),
        "ttft_by_pipeline_s": {p: h.summary() for p, h in sim.ttft_by_pipeline.items()},
        "sla": {
            "ttft_s": sim.cfg.sla.ttft_s,
            "tpot_s": sim.cfg.sla.tpot_s,
            "good": c["good"],
            "attainment": _r(c["good"] / finished if finished else 0.0),
        },
        "makespan_s": _r(span),
        "arrival_span_s": _r(arrival_span),
        "offered_rps": _r(c["requests"] / arrival_span if arrival_span > 0 else 0.0),
        # requests meeting both SLA bounds per second of the window in which they were offered
        "goodput_rps": _r(c["good"] / arrival_span if arrival_span > 0 else 0.0),
        "token_share": {
            "rld": _r(c["rld_tokens"] / tokens if tokens else 0.0),
            "md": _r(c["md_tokens"] / tokens if tokens else 0.0),
        },
        "pipelines": dict(sim.pipelines),
        "handoffs": dict(sim.handoffs),
        "handoff_gap_s": sim.handoff_gap.summary(),
        "prefix": {
            "prompt_tokens": c["prompt_tokens"],
            "decode_side_hit_tokens": c["md_hit_tokens"],
            "decode_side_hit_ratio": _r(
                c["md_hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0
            ),
            "p_hit_tokens": c["p_hit_tokens"],
            "hit_intervals": sim.hit_histogram(),
        },
        "rld": {"refused": c["rld_refused"], "queue_depth": sim.rld_depth.to_dict()},
        "md_alloc_waits": c["md_alloc_waits"],
        "arrivals": sim.cfg.workload.arrivals,
        "overlapping_turns": c["overlapping_turns"],
        "deferred_turns": c["deferred_turns"],
        "deferral_s": sim.deferral.summary(),
        "busy": {
            "prefill": _r(_busy(sim.prefill, span)),
            "decode": _r(_busy([d.inst for d in sim.decode], span)),
            "relay": _r(_busy(sim.relay, span)) if sim.relay else None,
        },
        "events": sim.loop.events_run,
        "sim_time_s": _r(sim.loop.now),
        "ttft_cdf": [[_r(v), _r(f)] for v, f in sim.ttft.cdf_points(200)],
    }
    if sim.cross:
        w = sim.wan.counters()
        cap = sim.wan.rate_bytes_per_s * span
        w["utilisation"] = _r(w["bytes_out_a_to_b"] / cap if cap > 0 else 0.0)
        w["cancelled_transfers"] = c["cancelled_transfers"]
        w["kv_bytes_per_request"] = _r(w["kv_bytes"] / max(c["requests"], 1), 1)
        w["view"] = _merge_views(sim)
        out["wan"] = w
    return out


def _busy(instances: list[Any], span: float) -> float:
    if not instances or span <= 0:
        return 0.0
    return sum(i.busy_s for i in instances) / (len(instances) * span)


def _merge_views(sim: SimulatedSystem) -> dict[str, Any]:
    keys = ("predictions", "wrong", "over_predicted", "under_predicted", "error_tokens", "gaps")
    out: dict[str, Any] = {k: sum(v.counters()[k] for v in sim.views) for k in keys}
    out["mispredict_rate"] = _r(out["wrong"] / out["predictions"] if out["predictions"] else 0.0)
    return out


def compare(results: dict[str, dict[str, Any]], baseline: str = BASELINE) -> dict[str, Any]:
    """Ratios of every system against the baseline: TTFT quantiles, goodput, cost, BCR."""
    if baseline not in results:
        return {}
    b = results[baseline]
    out: dict[str, Any] = {}
    for name, r in results.items():
        bcr = r["goodput_rps"] / r["cost_per_hour"] if r["cost_per_hour"] else 0.0
        bcr_b = b["goodput_rps"] / b["cost_per_hour"] if b["cost_per_hour"] else 0.0
        out[name] = {
            "ttft_p50_x": _ratio(r["ttft_s"]["p50"], b["ttft_s"]["p50"]),
            "ttft_p90_x": _ratio(r["ttft_s"]["p90"], b["ttft_s"]["p90"]),
            "ttft_p99_x": _ratio(r["ttft_s"]["p99"], b["ttft_s"]["p99"]),
            "goodput_x": _ratio(r["goodput_rps"], b["goodput_rps"]),
            "cost_x": _ratio(r["cost_per_hour"], b["cost_per_hour"]),
            "bcr_x": _ratio(bcr, bcr_b),
        }
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 4)


def simulate_all(
    cfg: SimConfig, progress: Callable[[str, int], None] | None = None
) -> dict[str, Any]:
    results = run_systems(cfg, cfg.systems, progress)
    return {"config": describe_config(cfg), "systems": results, "vs_baseline": compare(results)}


def run_systems(
    cfg: SimConfig,
    systems: Sequence[str],
    progress: Callable[[str, int], None] | None = None,
    jobs: int = 1,
) -> dict[str, Any]:
    """Each system on the config's workload. With ``arrivals = "baseline"`` the baseline runs
    first (closed loop) and every other system is offered its send times: the same requests
    at the same times, so latency comparisons are at equal offered load. With ``jobs`` > 1
    the systems that do not wait for the baseline run in that many processes (same results)."""
    from pddnet.sim.parallel import Task, run_tasks

    paced = cfg.workload.arrivals == "baseline"
    if paced and BASELINE not in systems:
        raise ValueError(f'arrivals = "baseline" needs the baseline system {BASELINE!r} in systems')
    results: dict[str, Any] = {}
    schedule = Schedule() if paced else None
    if paced:
        cb = (lambda n: progress(BASELINE, n)) if progress else None
        results[BASELINE] = simulate(cfg, BASELINE, cb, record=schedule)
    rest = [s for s in systems if s not in results]
    tasks = [Task(simulate, (cfg, s), {"replay": schedule}, progress_kw="progress") for s in rest]
    on_progress = (lambda i, n: progress(rest[i], n)) if progress else None
    for s, r in zip(rest, run_tasks(tasks, jobs, on_progress), strict=True):
        results[s] = r
    return {s: results[s] for s in systems}


def describe_config(cfg: SimConfig) -> dict[str, Any]:
    return {
        "seed": cfg.seed,
        "model": cfg.model.name,
        "kv_bytes_per_token": cfg.model.kv_bytes_per_token,
        "tokens_per_unit": cfg.tokens_per_unit,
        "systems": list(cfg.systems),
        "pdd": cfg.pdd.describe(),
        "baseline": cfg.baseline.describe(),
        "line": dataclasses.asdict(cfg.line),
        "engine": dataclasses.asdict(cfg.engine),
        "policy": dataclasses.asdict(cfg.policy),
        "sla": dataclasses.asdict(cfg.sla),
        "workload": {
            **{k: v for k, v in dataclasses.asdict(cfg.workload).items() if k != "agent"},
            **cfg.workload.agent,
        },
    }
