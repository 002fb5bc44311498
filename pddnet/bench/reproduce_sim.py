"""The simulator beside `pdd bench reproduce`: the live run's own requests, chips, line and
policy through `pddnet.sim`, so that each live figure has the simulator's answer next to it.

Compute is modelled the same way on both sides (the live daemons are paced by
`pddnet.device.cost`, which is the simulator's cost function), and the testbed's host time is
measured on the same-DC cluster and given to the simulator as its [engine] host latency: per
engine step (the engine loop between forwards, which the pacer does not cover:
`host_step_latency`, from the decode side's token gaps against its paced steps) and per request
(client, router, daemons' event loops, engine admission: `host_latency_probe`, idle requests
before the traffic), so what the two may still disagree on is the network, the queueing and the
protocol. The requests are the live workload's, one unit per token (units are the token ids, so
every prefix cache matches exactly what the daemons' caches match); the deployment is the live
cluster's (one instance per pool); the engine and policy settings are read from the live
cluster's config. The simulator's TTFT, TPOT and end-to-end statistics are taken over its
requests as the live ones are (`vllm_figures`: vLLM's linearly interpolated percentiles), not
read from its histograms, whose nearest-rank quantiles differ from those by a whole request on
a few dozen (a cross-DC median between a fast and a slow half moved 848 -> 377 ms that way).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pddnet.bench import metrics
from pddnet.bench.client import StreamRecord
from pddnet.config import ClusterConfig
from pddnet.sim.host_latency import HostLatency, fit_host_latency
from pddnet.workload.agent import AgentRequest
from pddnet.workload.units import SimRequest

# live mode -> the simulator's system of the same name
SYSTEMS = {"same-dc": "same-dc", "cross-dc": "cross-dc", "pdd": "pdd"}
# the decode-side cache's bytes: every request P->MD with MD's cache and without (the live
# runs are `pdd bench drc`'s, PDD forced to P->MD: naive cross-DC's pipeline)
NO_DRC = "cross-dc-no-drc"
DRC_SYSTEMS = {"drc": "cross-dc", "no-drc": NO_DRC}


def _arrival_order(r: AgentRequest) -> tuple[float, int, int]:
    return (r.arrival_s, r.conversation_id, r.turn)


def sim_requests(workload: Sequence[AgentRequest]) -> list[SimRequest]:
    """The live workload as the simulator's requests, in arrival order, one unit per token.
    A conversation's later prompts are its earlier prompt + output + appended tokens in both
    worlds (live: the model's real output; here: the history's), so hits are the same shape."""
    ordered = sorted(workload, key=_arrival_order)
    return [
        SimRequest(
            i,
            r.conversation_id,
            r.arrival_s,
            tuple(r.prompt_token_ids),
            len(r.prompt_token_ids),
            r.max_tokens,
            tuple(r.output_token_ids),
        )
        for i, r in enumerate(ordered)
    ]


def _pool(chip: str, gpus: int) -> dict[str, Any]:
    return {"chip": chip, "instances": 1, "gpus": gpus}


def line(live: ClusterConfig, gbit: float, rtt_ms: float, jitter_ms: float) -> dict[str, Any]:
    """The simulator's line as the live one: its queue (``wan.queue_ms`` of the rate) and, as
    the unit the line interleaves, one KV_CHUNK frame of the target model's KV."""
    from pddnet.device.profiles import load_model

    out: dict[str, Any] = {"bw_gbit": gbit, "rtt_ms": rtt_ms, "jitter_ms": jitter_ms}
    chunk = live.wan.chunk_tokens * load_model(live.target_model).kv_bytes_per_token
    out["piece_mb"] = chunk / 2**20
    out["piece_ms"] = 0.0
    if live.wan.queue_ms is not None:
        out["queue_mb"] = gbit * 1e9 / 8 * live.wan.queue_ms / 1e3 / 2**20
    return out


def sim_config_dict(
    live: ClusterConfig,
    chips: dict[str, tuple[str, int]],
    line_gbit: float,
    rtt_ms: float,
    jitter_ms: float,
    slos_ms: dict[str, float],
    seed: int,
) -> dict[str, Any]:
    """The simulator's config for the live cluster `live` (its pdd-mode config: engine and
    policy settings), `chips` (role -> (chip profile, gpus): prefill, relay, main_decode and
    the same-dc decode), the modelled line and the goodput SLOs (ms)."""
    pol = live.policy
    p_chip, p_gpus = chips["prefill"]
    r_chip, r_gpus = chips["relay"]
    md_chip, md_gpus = chips["main_decode"]
    d_chip, d_gpus = chips["decode"]
    return {
        "seed": seed,
        "model": live.target_model,
        "tokens_per_unit": 1,
        "systems": [*SYSTEMS.values(), NO_DRC],
        "chips": {"p": p_chip, "r": r_chip, "md": md_chip, "d": d_chip},
        "pdd": {
            "prefill": _pool("p", p_gpus),
            "relay": _pool("r", r_gpus),
            "main_decode": _pool("md", md_gpus),
        },
        "baseline": {"prefill": _pool("p", p_gpus), "decode": _pool("d", d_gpus)},
        "line": line(live, line_gbit, rtt_ms, jitter_ms),
        "engine": {
            "block_tokens": live.prefill.block_size,
            "chunk_tokens": live.prefill.max_num_batched_tokens,
            "max_seqs": live.main_decode.max_num_seqs,
            # P batches waiting prompts into a running one's last chunk, as its engine does
            "p_max_seqs": live.prefill.max_num_seqs,
            "p_prefix_cache": live.prefill.prefix_cache != "off",
        },
        "policy": {
            "direct_budget_s": pol.direct_budget_s,
            "singular_filter": pol.singular_filter,
            "singular_margin": pol.singular_margin,
            "handoff": pol.handoff,
            "handoff_threshold": pol.handoff_threshold_tokens,
            "handoff_chunk": pol.handoff_chunk,
            "rld_load_limit": pol.rld_load_limit,
            "rld_max_requests": pol.rld_max_requests,
        },
        "sla": {
            "ttft_s": slos_ms.get("ttft", 5000.0) / 1e3,
            "tpot_s": slos_ms.get("tpot", 100.0) / 1e3,
        },
        "workload": {"arrivals": "closed", "requests": 1},
    }


def simulate_beside(
    config: dict[str, Any], workload: Sequence[AgentRequest], systems: dict[str, str]
) -> dict[str, dict[str, Any]]:
    """The simulator's reports of `systems` (name -> the simulator's system) on the live
    requests, keyed by name; each with its P's plans (`plan_records`: the daemons'
    `pdd.pipeline_decision` and the request's rid, its index in `sim_requests`' order) and
    every request's own figures (`request_records`, by rid too)."""
    from pddnet.sim.config import parse_config
    from pddnet.sim.runner import simulate

    requests = sim_requests(workload)
    cfg = parse_config({**config, "workload": {**config["workload"], "requests": len(requests)}})
    out = {}
    for name, system in systems.items():
        plans: list[dict[str, Any]] = []
        done: list[dict[str, Any]] = []
        report = simulate(cfg, system, requests=requests, plan_records=plans, request_records=done)
        out[name] = {**report, "plan_records": plans, "request_records": done}
    return out


def sim_order(workload: Sequence[AgentRequest]) -> list[int]:
    """Each request's rid in the simulator (`sim_requests`' order), by its index in `workload`."""
    order = sorted(range(len(workload)), key=lambda i: _arrival_order(workload[i]))
    rid = [0] * len(workload)
    for r, i in enumerate(order):
        rid[i] = r
    return rid


def with_host_latency(config: dict[str, Any], host: HostLatency) -> dict[str, Any]:
    """`config` with the simulator's host latency set to `host` ([engine]'s two keys)."""
    return {**config, "engine": {**config["engine"], **host.engine_settings()}}


def host_step_latency(
    records: Sequence[StreamRecord],
    stats: dict[str, dict[str, Any]],
    before: dict[str, dict[str, Any]] | None = None,
) -> float:
    """The testbed's host time per engine step (modelled seconds), from one live run: the
    client's mean gap between two tokens of a request (`records`; each request's first gap
    left out, P's token to the decode side's first, a KV hop and no step) less the decoding
    daemons' mean paced decode step per token (`stats`: every daemon's stats at the run's end,
    `before`: as its phase began; pddnet/obs/step_times.py's ``decode_by_batch``, steps
    weighted by their batch, as tokens are). The pacer makes each forward last its modelled
    time; what the engine loop does between two forwards is this, on every step, prefill
    chunks too. 0 when there is nothing to measure or the gaps are shorter."""
    gaps = [g for r in metrics.completed(records) for g in metrics.itl_s(r)[1:]]
    tokens = weighted = 0.0
    for role, s in stats.items():
        was = (((before or {}).get(role) or {}).get("engine_steps") or {}).get("decode_by_batch")
        for label, b in ((s.get("engine_steps") or {}).get("decode_by_batch") or {}).items():
            a = (was or {}).get(label) or {"steps": 0, "seconds": 0.0, "mean_batch": 0.0}
            steps = b["steps"] - a["steps"]
            if steps <= 0:
                continue
            seqs = b["steps"] * b["mean_batch"] - a["steps"] * a["mean_batch"]
            tokens += seqs
            weighted += (b["seconds"] - a["seconds"]) * seqs / steps
    if not gaps or tokens <= 0:
        return 0.0
    return max(0.0, sum(gaps) / len(gaps) - weighted / tokens)


def per_step_in_simulator_terms(
    config: dict[str, Any], workload: Sequence[AgentRequest], records: Sequence[StreamRecord]
) -> float:
    """The host time per engine step that makes the simulator's same-DC decode last as long as
    the live one: `config`'s own per-step part (`host_step_latency`: the live token gap less
    the daemons' paced step) less the simulator's mean TPOT beyond the live same-DC run's
    (`records`, of `workload`). The daemons' paced steps and the simulator's modelled ones on
    the same run are not quite the same steps (its batches are its own): in four full runs the
    simulator's same-DC TPOT came out 0.016-0.020 ms long (0.2%), ~9 ms a request, which the
    closed loop carries into every next turn's send time. Never < 0."""
    report = simulate_beside(config, workload, {"same-dc": "same-dc"})["same-dc"]
    sim = [r["tpot_s"] for r in report["request_records"] if r["tpot_s"] is not None]
    live = [t for r in metrics.completed(records) if (t := metrics.tpot_s(r)) is not None]
    per_step = config["engine"].get("host_latency_per_step_us", 0.0) / 1e6
    if not sim or not live:
        return per_step
    return max(0.0, per_step - (sum(sim) / len(sim) - sum(live) / len(live)))


def host_latency_probe(
    config: dict[str, Any],
    probe: Sequence[AgentRequest],
    records: Sequence[StreamRecord],
    per_step_s: float = 0.0,
) -> dict[str, Any]:
    """The testbed's host latency from the probe's requests (`probe`, sent one at a time to
    the idle same-DC cluster; `records`, the client's records of them) and its time per engine
    step (`per_step_s`, measured apart: `host_step_latency`): per request, its live TTFT
    (modelled: wall / k) less the simulator's TTFT of that request alone in same-DC with the
    per-step part only -- P's prefill as pddnet.device.cost paces the daemons plus the host's
    time per chunk, the KV's copy to D, which the daemons' KV path is paced to as well -- is
    the host overhead; fitted as a fixed part plus a part per prompt token
    (pddnet/sim/host_latency.py). A failed request is left out; fewer than two points is an
    error (the caller then runs the simulator without)."""
    base = with_host_latency(config, HostLatency(per_step_s=per_step_s))
    points: list[dict[str, Any]] = []
    for req, rec in zip(probe, records, strict=True):
        if rec.error is not None or rec.ttft_s is None:
            continue
        alone = simulate_beside(base, [req], {"same-dc": "same-dc"})["same-dc"]
        modelled = alone["ttft_s"]["mean"]
        points.append(
            {
                "prompt_tokens": len(req.prompt_token_ids),
                "live_ttft_ms": rec.ttft_s * 1e3,
                "modelled_ttft_ms": modelled * 1e3,
                "host_ms": (rec.ttft_s - modelled) * 1e3,
            }
        )
    if len(points) < 2:
        raise RuntimeError(f"host probe: {len(points)} of {len(probe)} requests answered")
    fit = fit_host_latency([(p["prompt_tokens"], p["host_ms"] / 1e3) for p in points])
    fit = HostLatency(fit.fixed_s, fit.per_token_s, per_step_s)
    return {"requests": len(probe), "points": points, "fit": fit.to_dict()}


PERCENTILES = (90.0, 99.0)  # beside the median: the table's


def vllm_figures(report: dict[str, Any]) -> dict[str, float | None]:
    """The simulator's report under the live benchmark's (vLLM's) key names, in ms. With its
    `request_records` (`simulate_beside`'s), TTFT, TPOT and end to end are taken over them by
    the live side's own function (pddnet.bench.metrics.stats_ms: linear interpolation);
    ITL, thousands of gaps the simulator keeps no list of, from its histogram."""

    def ms(section: str, stat: str) -> float | None:
        v = (report.get(section) or {}).get(stat)
        return None if v is None else v * 1e3

    out: dict[str, float | None] = {}
    for name, section in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("itl", "itl_s")):
        out[f"mean_{name}_ms"] = ms(section, "mean")
        out[f"median_{name}_ms"] = ms(section, "p50")
        for p in ("p90", "p99"):
            out[f"{p}_{name}_ms"] = ms(section, p)
    out["median_e2el_ms"] = ms("e2e_s", "p50")
    done = report.get("request_records")
    if done:
        for name, key in (("ttft", "ttft_s"), ("tpot", "tpot_s"), ("e2el", "e2e_s")):
            values = [r[key] for r in done if r[key] is not None]
            stats = metrics.stats_ms(name, values, PERCENTILES)
            out.update({k: v for k, v in stats.items() if not k.startswith("std_")})
    share = report.get("token_share") or {}
    out["rld_token_share"] = share.get("rld")
    wan = report.get("wan") or {}
    out["target_wan_kv_bytes"] = wan.get("kv_bytes")
    # vLLM's request_goodput: good requests / the run's duration (first sent -> last done)
    span = report.get("makespan_s") or 0.0
    good = (report.get("sla") or {}).get("good")
    out["request_goodput"] = good / span if good is not None and span > 0 else None
    out["busy"] = report.get("busy")  # type: ignore[assignment]
    out["pipelines"] = report.get("pipelines")  # type: ignore[assignment]
    out["line_utilisation"] = wan.get("utilisation")
    return out
