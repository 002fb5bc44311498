"""`pdd bench reproduce`'s figures: the source's number, the live daemons' and the simulator's
side by side, and the issue's targets checked on the live figures.

Every duration is modelled time (wall / k) in ms, under vLLM's names (docs/benchmarks.md,
Metrics). "sim vs live" is (sim - live) / live: the simulator models compute exactly as the
daemons are paced and is given the testbed's host path as measured (`host`: the probe's points
and fit, shown under the table), so what it leaves out is network, queueing and protocol detail.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pddnet.bench import metrics
from pddnet.bench.handoff_summary import (
    KV_DIRECT_MAX_OVER_MEAN,
    TARGET_CONDITIONS,
    TOKEN_ID_MAX_OVER_MEAN,
    wan_line,
)
from pddnet.bench.reproduce_sim import vllm_figures
from pddnet.bench.reproduce_spread import draw_ratios, meets, spread_notes
from pddnet.bench.ttft import mode_summary
from pddnet.workload.agent import AgentRequest

# The source report's figures (its TTFT in ms; shares of the decode tokens; handoff in ms).
SOURCE: dict[str, Any] = {
    "ttft_ms": {
        "same-dc": {"median": 3900, "p90": 10400, "p99": 17200},
        "pdd": {"median": 4200, "p90": 9800, "p99": 14400},
        "cross-dc": {"median": 6700, "p90": 18300, "p99": 29700},
    },
    "rld_share": 0.062,
    "md_share": 0.938,
    "drc_cut_x": 10.0,
    "md_hit": 0.90,  # "~90% average prefix hit"
    "md_hit_above_95": 0.75,  # "70-80% of requests above 95%"
    "handoff_kv_bytes": 4.6e6,  # "~4.6 MB for 100 tokens"
    "handoff_ms": {
        "token-id": {"mean": 305.0, "max": 321.4},
        "kv-direct": {"mean": 185.0, "max": 512.6},
    },
}
# The targets (benchmark output, never timed tests).
TARGETS = {
    "pdd_p99_vs_same_dc_max": 1.2,
    "cross_dc_p99_vs_same_dc_min": 3.0,
    "rld_share_factor": 1.5,
    "drc_cut_min": 9.0,
    "overrun_share_max": 0.01,
    "wall_s_max": 1800.0,
    "token_id_max_over_mean": TOKEN_ID_MAX_OVER_MEAN,
    "kv_direct_max_over_mean_min": KV_DIRECT_MAX_OVER_MEAN,
    "sim_vs_live_max": 0.10,
}
# the targets stated on a TTFT ratio to same-DC: ratio's name -> ("max" | "min", bound)
RATIO_TARGETS = {
    "pdd/same-dc p99": ("max", TARGETS["pdd_p99_vs_same_dc_max"]),
    "cross-dc/same-dc p99": ("min", TARGETS["cross_dc_p99_vs_same_dc_min"]),
}
STATS = ("median", "p90", "p99")


def _rld_share(summary: dict[str, Any]) -> float | None:
    """RLD's share of the output tokens (the source's 6.2%; the simulator's token_share.rld)."""
    return summary.get("rld_token_share") if summary.get("completed") else None


def relay_tokens(record: Any) -> int:
    """The tokens RLD made of a request (its `pdd` object's count)."""
    return int(record.pdd.get("relay_tokens", 0) or 0)


def rld_share_of(records: list[Any]) -> float | None:
    """RLD's share of these requests' output tokens (`metrics.pdd_extras`'), None without any."""
    return metrics.pdd_extras(records)["rld_token_share"] if records else None


def handed_off_rld_share(records: list[Any]) -> dict[str, Any]:
    """RLD's share of the output tokens of the P->RLD->MD requests MD took over (RLD decodes
    while the KV crosses, MD makes the rest), on the main workload's mixed shapes."""
    handed = [
        r
        for r in records
        if r.error is None
        and r.pdd.get("pipeline") == "p_rld_md"
        and int(r.pdd.get("main_tokens", 0) or 0) > 0
    ]
    return {"requests": len(handed), "share": rld_share_of(handed)}


def _busy(
    stats: dict[str, Any], makespan_s: float, before: dict[str, Any] | None = None
) -> dict[str, float | None]:
    """Each daemon's modelled busy time over the run's modelled makespan; with `before` (the
    daemons' stats as the phase began) only the phase's own (not the warm-up's or the host
    probe's)."""

    def busy_s(s: dict[str, Any] | None) -> float | None:
        return ((s or {}).get("device") or {}).get("modelled_busy_s")

    out: dict[str, float | None] = {}
    for role, s in stats.items():
        busy = busy_s(s)
        if busy is not None:
            busy -= busy_s((before or {}).get(role)) or 0.0
        out[role] = busy / makespan_s if busy is not None and makespan_s > 0 else None
    return out


def _decision(record: dict[str, Any], k: float) -> dict[str, Any]:
    """A `pdd.pipeline_decision` (the daemons' or the simulator's) in modelled ms and target
    tokens: the live one's times are wall (/ k) and its bytes the small model's real KV."""
    x = record["inputs"]
    kvpt = x["kv_bytes_per_token"]
    return {
        "pipeline": record["pipeline"],
        "estimated_wan_ms": record["estimated_wan_transfer_s"] / k * 1e3,
        "hit_tokens": x["hit_tokens"],
        "backlog_tokens": round(x["wan_backlog_bytes"] / kvpt),
        "bandwidth_tokens_per_ms": x["bandwidth_bps"] / kvpt * k / 1e3,
        "rtt_ms": x["rtt_s"] / k * 1e3,
        "rld_ms_per_token": x["rld_s_per_token"] / k * 1e3,
    }


def pipeline_decisions(
    records: list[Any], workload: list[AgentRequest], sim_plans: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """P's plan of every pdd request, live (its `pdd.pipeline_decision`) beside the
    simulator's for the same request, with the inputs that decide it in modelled units, and
    the pipeline it was served by (an RLD refusal, or the daemon's recheck on MD's answer,
    can change the plan's)."""
    from pddnet.bench.reproduce_sim import sim_order

    sim_by_rid = {p["rid"]: p for p in sim_plans}
    out = []
    for rec, req, rid in zip(records, workload, sim_order(workload), strict=True):
        live = rec.pdd.get("pipeline_decision")
        sim = sim_by_rid.get(rid)
        out.append(
            {
                "conversation": req.conversation_id,
                "turn": req.turn,
                "prompt_tokens": len(req.prompt_token_ids),
                "max_tokens": req.max_tokens,
                "live": None if live is None else _decision(live, rec.dilation),
                "live_served": rec.pdd.get("pipeline"),
                "sim": None if sim is None else _decision(sim, 1.0),
                "sim_rld_refused": bool(sim and sim.get("rld_refused")),
            }
        )
    return out


def _error(sim: float | None, live: float | None) -> float | None:
    return None if sim is None or not live else (sim - live) / live


def shape_figures(
    run: dict[str, Any] | None,
    sim: dict[str, Any] | None,
    warm: AgentRequest,
    conversations: list[AgentRequest],
) -> dict[str, Any] | None:
    """RLD's share of the output tokens on the 64K-in / 1K-out shape, live (the conversations'
    requests; the warm-up is reported apart) and simulated (the conversations' RLD tokens: the
    simulator's run with them less its run of the warm-up alone)."""
    if run is None:
        return None
    recs = run["records"]["shape"]
    done = [r for r in recs if r.error is None]
    (w,) = run["records"]["warm-up"]
    total = sum(len(r.token_ids) for r in done)
    prompts = [r.prompt_len or 0 for r in done]
    hits = [int(r.pdd.get("prefix_hit_tokens", 0) or 0) for r in done]
    pipelines = metrics.count(r.pdd.get("pipeline") for r in done)
    out: dict[str, Any] = {
        "requests": len(recs),
        "failed": len(recs) - len(done),
        "mean_prompt_tokens": sum(prompts) / len(prompts) if prompts else None,
        "output_tokens": total,
        "md_hit_ratio": sum(hits) / sum(prompts) if sum(prompts) else None,
        "pipelines": pipelines,
        "rld_share": rld_share_of(done),
        "per_request": [
            {
                "prompt_tokens": p,
                "md_hit_tokens": h,
                "pipeline": r.pdd.get("pipeline"),
                "relay_tokens": relay_tokens(r),
                "tokens": len(r.token_ids),
                "ttft_ms": None if r.ttft_s is None else r.ttft_s * 1e3,
            }
            for r, p, h in zip(done, prompts, hits, strict=True)
        ],
        "warm_up": {
            "pipeline": w.pdd.get("pipeline"),
            "relay_tokens": relay_tokens(w),
            "main_tokens": int(w.pdd.get("main_tokens", 0) or 0),
            "error": w.error,
        },
        "ttft_ms": mode_summary(done, None, run["makespan_s"]["shape"]).get("median_ttft_ms"),
        "devices": run["devices"],
        "sim_rld_share": None,
    }
    if sim is not None:
        alone, both = sim["warm_up"], sim["with_conversations"]
        n_warm = warm.max_tokens
        n_all = n_warm + sum(r.max_tokens for r in conversations)
        rld_both = both["token_share"]["rld"] * n_all
        rld_alone = alone["token_share"]["rld"] * n_warm
        out["sim_rld_share"] = (rld_both - rld_alone) / (n_all - n_warm)
        out["sim_md_hit_ratio"] = (both.get("prefix") or {}).get("decode_side_hit_ratio")
    return out


def drc_figures(
    compared: dict[str, Any] | None, sim: dict[str, dict[str, Any]] | None
) -> dict[str, Any] | None:
    """The decode-side cache's cut of the WAN KV bytes on the long conversations (`pdd bench
    drc`'s comparison, live) and the simulator's on the same requests."""
    if compared is None:
        return None
    out = dict(compared)
    out["hit_ratio_of_tokens"] = sum(r["hit_tokens"] for r in compared["rows"]) / max(
        sum(r["prompt_tokens"] for r in compared["rows"]), 1
    )
    out["sim_cut_x"] = None
    if sim is not None:
        with_b = sim["drc"]["wan"]["kv_bytes"]
        without_b = sim["no-drc"]["wan"]["kv_bytes"]
        out["sim_cut_x"] = without_b / with_b if with_b else None
        out["sim_hit_ratio_of_tokens"] = sim["drc"]["prefix"]["decode_side_hit_ratio"]
    return out


def figures(
    live: dict[str, dict[str, Any]],
    handoff: dict[str, Any] | None,
    sim: dict[str, dict[str, Any]] | None,
    slos: dict[str, float],
    wall_s: float,
    shape: dict[str, Any] | None = None,
    drc: dict[str, Any] | None = None,
    host: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The result's figures: per mode the live summary and the simulator's, the shape's RLD
    share, the decode-side cache's cut, the handoff, the rows of the side-by-side table, the
    targets' checks, and the host latency the simulator was given (`host`: the probe's, None
    when it did not run)."""
    summaries = {
        m: mode_summary(run["records"]["agent"], slos, run["makespan_s"]["agent"])
        for m, run in live.items()
    }
    sims = {m: vllm_figures(r) for m, r in (sim or {}).items()}
    rows: list[dict[str, Any]] = []

    def row(name: str, source: Any, live_v: Any, sim_v: Any = None, unit: str = "ms") -> None:
        rows.append(
            {
                "figure": name,
                "unit": unit,
                "source": source,
                "live": live_v,
                "sim": sim_v,
                "sim_vs_live": _error(sim_v, live_v)
                if isinstance(live_v, (int, float)) and isinstance(sim_v, (int, float))
                else None,
            }
        )

    for m, s in summaries.items():
        for stat in STATS:
            key = f"{stat}_ttft_ms"
            src = SOURCE["ttft_ms"].get(m, {}).get(stat)
            row(f"TTFT {stat} {m}", src, s.get(key), sims.get(m, {}).get(key))
        row(f"ITL median {m}", None, s.get("median_itl_ms"), sims.get(m, {}).get("median_itl_ms"))
        row(
            f"TPOT median {m}", None, s.get("median_tpot_ms"), sims.get(m, {}).get("median_tpot_ms")
        )
        row(
            f"goodput {m}",
            None,
            s.get("request_goodput"),
            sims.get(m, {}).get("request_goodput"),
            "req/s",
        )
    if "pdd" in summaries:
        row(
            "RLD share of output tokens (pdd)",
            SOURCE["rld_share"],
            _rld_share(summaries["pdd"]),
            sims.get("pdd", {}).get("rld_token_share"),
            "share",
        )
    handed = handed_off_rld_share(live["pdd"]["records"]["agent"]) if "pdd" in live else None
    if handed is not None:
        row(
            f"RLD share, P->RLD->MD handed off ({handed['requests']} requests)",
            SOURCE["rld_share"],
            handed["share"],
            None,
            "share",
        )
    ratios = draw_ratios({m: {"p99": s.get("p99_ttft_ms")} for m, s in summaries.items()})
    if shape is not None:
        row(
            f"RLD share, 64K-in / 1K-out shape ({shape['requests']} requests, "
            f"{(shape['mean_prompt_tokens'] or 0) / 1e3:.0f}K in, MD hit "
            f"{shape['md_hit_ratio'] or 0:.0%})",
            SOURCE["rld_share"],
            shape["rld_share"],
            shape["sim_rld_share"],
            "share",
        )
        row("TTFT median, 64K-in / 1K-out shape (pdd)", None, shape["ttft_ms"], None)
    if drc is not None:
        row(
            f"decode-side hit, long conversations ({drc['requests']} requests)",
            SOURCE["md_hit"],
            drc["hit_ratio_of_tokens"],
            drc.get("sim_hit_ratio_of_tokens"),
            "share",
        )
        row(
            "  of them hitting > 95% (source: 70-80%)",
            SOURCE["md_hit_above_95"],
            drc["hit_distribution_measured"].get("95-100%"),
            None,
            "share",
        )
        row(
            "WAN KV cut by the DRC",
            SOURCE["drc_cut_x"],
            drc["byte_reduction"],
            drc["sim_cut_x"],
            "x",
        )
    if handoff:
        row("handoff payload, token-id", None, handoff["payload_bytes"].get("token-id"), None, "B")
        row(
            "handoff payload, KV-direct (target's KV)",
            SOURCE["handoff_kv_bytes"],
            handoff["payload_target_bytes"].get("kv-direct"),
            None,
            "B",
        )
        for cond, paths in handoff["conditions"].items():
            for path, h in paths.items():
                src = SOURCE["handoff_ms"].get(path, {}) if cond in TARGET_CONDITIONS else {}
                for stat in ("mean", "max"):
                    row(f"handoff {stat} {path}, {cond}", src.get(stat), h[f"{stat}_ms"])
    devices = {m: run["devices"] for m, run in live.items()}
    utilisation = {
        m: {
            "live": _busy(
                run["stats"],
                run["makespan_s"]["agent"],
                run.get("stats_before", {}).get("agent"),
            ),
            "sim": (sim or {}).get(m, {}).get("busy"),
            "sim_line": ((sim or {}).get(m, {}).get("wan") or {}).get("utilisation"),
        }
        for m, run in live.items()
    }
    if shape is not None:
        devices["pdd shape"] = shape["devices"]
    checks = _checks(summaries, ratios, drc, shape, handoff, devices, rows, wall_s)
    return {
        "source": SOURCE,
        "targets": TARGETS,
        "live": summaries,
        "sim": sims,
        "rows": rows,
        "ttft_p99_ratios": ratios,
        "handed_off_rld_share": handed,
        "shape": shape,
        "drc": drc,
        "handoff": handoff,
        "utilisation": utilisation,
        "devices": devices,
        "checks": checks,
        "wall_s": wall_s,
        "host_latency": host,
    }


def _checks(
    summaries: dict[str, Any],
    ratios: dict[str, float | None],
    drc: dict[str, Any] | None,
    shape: dict[str, Any] | None,
    handoff: dict[str, Any] | None,
    devices: dict[str, Any],
    rows: list[dict[str, Any]],
    wall_s: float,
) -> dict[str, bool | None]:
    """Each target: True / False on this run's figures, None where the run has no such figure."""
    t = TARGETS

    def at_most(v: float | None, bound: float) -> bool | None:
        return None if v is None else v <= bound

    def at_least(v: float | None, bound: float) -> bool | None:
        return None if v is None else v >= bound

    def ratio_check(name: str) -> bool | None:
        """A target on a TTFT ratio to same-DC, as RATIO_TARGETS states it (the spread's too)."""
        v = ratios.get(name)
        return None if v is None else meets(v, *RATIO_TARGETS[name])

    # the source's figure is RLD's share at 64K in / 1K out: the shape's run, every request
    rld = (shape or {}).get("rld_share")
    lo, hi = (
        SOURCE["rld_share"] / t["rld_share_factor"],
        SOURCE["rld_share"] * t["rld_share_factor"],
    )
    # the daemons' own verdict: every role of every mode at most 1% of its forwards overran
    valid = [d.get("valid") for d in devices.values() if d]
    sim_rows = [
        r["sim_vs_live"]
        for r in rows
        if r["sim_vs_live"] is not None
        and (r["figure"].startswith(("TTFT median", "TTFT p90", "ITL median")))
    ]
    out: dict[str, bool | None] = {
        "PDD TTFT P99 <= 1.2x same-dc": ratio_check("pdd/same-dc p99"),
        "naive cross-dc TTFT P99 >= 3x same-dc": ratio_check("cross-dc/same-dc p99"),
        "RLD share on the 64K-in / 1K-out shape within 1.5x of 6.2%": None
        if rld is None
        else lo <= rld <= hi,
        "DRC cuts WAN KV bytes >= 9x (long conversations, ~90% hit)": at_least(
            (drc or {}).get("byte_reduction"), t["drc_cut_min"]
        ),
        "overruns < 1% of steps (every daemon)": None if not valid or None in valid else all(valid),
        "whole run < 30 min": wall_s < t["wall_s_max"],
        "sim within 10% of live (TTFT P50/P90, ITL P50)": None
        if not sim_rows
        else max(abs(e) for e in sim_rows) <= t["sim_vs_live_max"],
    }
    if handoff:
        for cond, line in TARGET_CONDITIONS.items():
            jb = handoff["conditions"].get(cond)
            if jb is None:
                continue
            out[f"token-id handoff max/mean <= 1.10 (jitter + traffic, {line})"] = at_most(
                jb.get("token-id", {}).get("max_over_mean"), t["token_id_max_over_mean"]
            )
            out[f"KV-direct handoff max/mean >= 2 (jitter + traffic, {line})"] = at_least(
                jb.get("kv-direct", {}).get("max_over_mean"), t["kv_direct_max_over_mean_min"]
            )
        if handoff.get("valid") is False:
            out["handoff devices kept pace (overruns < 1%)"] = False
    return out


def notes(result: dict[str, Any]) -> list[str]:
    """The lines under the table (terminal and Markdown alike): each mode's busy shares and
    pipeline split, live and simulated; the shape run's pipelines and warm-up."""

    def shares(busy: dict[str, float | None] | None) -> str:
        return ", ".join(f"{r} {v:.0%}" for r, v in (busy or {}).items() if v is not None) or "-"

    out = [host_note(result.get("host_latency"), bool(result["sim"]))]
    out += line_notes(result.get("lines"))
    out += [
        f"busy, {m}: live {shares(u['live'])}; sim {shares(u['sim'])}"
        for m, u in result["utilisation"].items()
    ]
    for m, s in result["live"].items():
        sim_split = (result["sim"].get(m) or {}).get("pipelines")
        out.append(f"pipelines, {m}: live {s['pipeline_split']}; sim {sim_split or '-'}")
    out += decision_notes(result.get("pipeline_decisions"))
    out += swap_notes(result.get("order_swaps"))
    out += spread_notes(result)
    if result.get("handoff"):
        h = result["handoff"]
        ran = (
            f"; RLD and MD ran {h['model']}, the competing traffic on {h['bulk_stripes']} lanes"
            if "model" in h  # not in a result from before they were recorded
            else ""
        )
        out.append(f"handoff figure's line: {wan_line(h.get('wan'))}{ran}")
        out += handoff_tail_notes(h)
        for a in h.get("attempts", ()):
            out.append(
                f"handoff figure at k = {h['dilation']:g}: at k = {a['dilation']:g} its devices "
                f"overran on {a['overruns']} of {a['steps']} forwards (not valid; {a['path']})"
            )
    shape = result.get("shape")
    if shape:
        w = shape["warm_up"]
        out.append(
            f"64K-in / 1K-out shape: pipelines {shape['pipelines']}; per request RLD made "
            + ", ".join(f"{r['relay_tokens']}/{r['tokens']}" for r in shape["per_request"])
            + f"; the warm-up went {w['pipeline']} (RLD {w['relay_tokens']}, MD "
            f"{w['main_tokens']} tokens)"
        )
    return out


def line_notes(lines: dict[str, Any] | None) -> list[str]:
    """Per mode with a WAN, its line from P's side to MD's as the cluster's emulator had it:
    the rate and buffer in real bytes, the delay and jitter in wall ms, and the buffer in
    modelled ms (what the simulator's line is given: docs/reproduction.md's 20 ms)."""
    out = []
    for mode, line in ((lines or {}).get("modes") or {}).items():
        fx = (line or {}).get("a_to_b")
        if not fx:
            continue
        k = lines["dilation"]  # type: ignore[index]
        rate, queue = fx.get("rate_mbit"), fx.get("queue_bytes")
        buffer = f", {queue * 8 / (rate * 1e6) * 1e3 / k:.1f} modelled ms" if rate and queue else ""
        out.append(
            f"line, {mode} (as its emulator had it, P's side to MD's): "
            f"{rate if rate is None else f'{rate:.3f}'} Mbit/s of real bytes, delay "
            f"{fx.get('delay_ms'):g} ms + jitter {fx.get('jitter_ms'):g} ms of wall clock, "
            f"buffer {queue} B{buffer}"
        )
    return out


def handoff_tail_notes(h: dict[str, Any]) -> list[str]:
    """Per line the target is judged on: how many of the handoffs reach the multiple of their
    mean that the target names for each path (KV-direct's max/mean >= 2 is one handoff: this
    says whether it was one of many), with TCP's repairs on KV-direct's."""
    out = []
    for cond, line in TARGET_CONDITIONS.items():
        c = h["conditions"].get(cond) or {}
        tok, kv = c.get("token-id") or {}, c.get("kv-direct") or {}
        if not tok.get("at_least_x_mean") or not kv.get("at_least_x_mean"):
            continue  # (results from before these were recorded)
        repairs = ""
        if kv.get("retransmitting") is not None:
            repairs = (
                f" ({kv['retransmitting']} retransmitted, {kv['with_rto']} waited for a "
                "retransmission timeout)"
            )
        x_kv, x_tok = f"{KV_DIRECT_MAX_OVER_MEAN:g}", f"{TOKEN_ID_MAX_OVER_MEAN:g}"
        out.append(
            f"handoff tail, {line}: KV-direct {kv['at_least_x_mean'][x_kv]} of "
            f"{kv['handoffs']} handoffs at >= {x_kv}x their mean{repairs}; token-id "
            f"{tok['at_least_x_mean'][x_tok]} of {tok['handoffs']} at >= {x_tok}x"
        )
    return out


# Two requests of a mode sent this close together (modelled s) may reach P in either order, and
# which one P takes first can decide both their TTFTs; a pair is listed when the simulator had
# them the other way round and either one's TTFT is off the live one by more than SWAP_EFFECT.
SWAP_WINDOW_S = 0.5
SWAP_EFFECT = 0.25


def order_swaps(
    records: list[Any], workload: list[AgentRequest], sim_rows: list[dict[str, Any] | None]
) -> list[dict[str, Any]]:
    """The pairs of one mode's requests sent in one order live (`records`: the client's, in
    `workload`'s order) and offered in the other in the simulator (`sim_rows`, the same order:
    its request records with `arrival_s`), within SWAP_WINDOW_S of each other both times, where
    the order mattered (SWAP_EFFECT); first in live order. Send times in modelled s (live's
    from its first send, the simulator's from its start: only gaps are compared), gaps and
    TTFTs in modelled ms."""
    sent = [r.sent_at for r in records]
    t0 = min(sent, default=0.0)
    rows = []
    for rec, req, sim in zip(records, workload, sim_rows, strict=True):
        if sim is None or rec.ttft_s is None or sim.get("arrival_s") is None:
            continue
        rows.append(
            {
                "conversation": req.conversation_id,
                "turn": req.turn,
                "live_sent_s": (rec.sent_at - t0) / rec.dilation,
                "sim_arrival_s": sim["arrival_s"],
                "live_ttft_ms": rec.ttft_s * 1e3,
                "sim_ttft_ms": sim["ttft_s"] * 1e3,
            }
        )
    rows.sort(key=lambda r: r["live_sent_s"])
    out = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            live_gap = b["live_sent_s"] - a["live_sent_s"]
            if live_gap > SWAP_WINDOW_S:
                break
            sim_gap = b["sim_arrival_s"] - a["sim_arrival_s"]
            if sim_gap >= 0 or -sim_gap > SWAP_WINDOW_S:
                continue
            off = max(abs(r["sim_ttft_ms"] / r["live_ttft_ms"] - 1) for r in (a, b))
            if off > SWAP_EFFECT:
                out.append(
                    {
                        "first_live": a,
                        "first_sim": b,
                        "live_gap_ms": live_gap * 1e3,
                        "sim_gap_ms": -sim_gap * 1e3,
                    }
                )
    return out


def swap_notes(swaps: dict[str, list[dict[str, Any]]] | None) -> list[str]:
    """One line per pair `order_swaps` found, by mode."""

    def name(r: dict[str, Any]) -> str:
        return f"conversation {r['conversation']} turn {r['turn']}"

    out = []
    for mode, pairs in (swaps or {}).items():
        for p in pairs:
            a, b = p["first_live"], p["first_sim"]
            out.append(
                f"order at P differs, {mode}: {name(a)} was sent {p['live_gap_ms']:.1f} ms "
                f"before {name(b)} live, {p['sim_gap_ms']:.1f} ms after it in the simulator "
                f"(TTFT live {a['live_ttft_ms']:.0f} / {b['live_ttft_ms']:.0f} ms, sim "
                f"{a['sim_ttft_ms']:.0f} / {b['sim_ttft_ms']:.0f})"
            )
    return out


def decision_notes(rows: list[dict[str, Any]] | None) -> list[str]:
    """The pdd requests P planned differently live and in the simulator, with the inputs."""
    if not rows:
        return []
    apart = [
        r for r in rows if r["live"] and r["sim"] and r["live"]["pipeline"] != r["sim"]["pipeline"]
    ]

    def side(d: dict[str, Any]) -> str:
        return (
            f"{d['pipeline']} (KV {d['estimated_wan_ms']:.0f} ms: hit {d['hit_tokens']}, "
            f"backlog {d['backlog_tokens']} tokens, {d['bandwidth_tokens_per_ms']:.2f} tokens/ms; "
            f"RLD {d['rld_ms_per_token']:.1f} ms/token)"
        )

    out = [
        f"P's plans in pdd: {len(rows) - len(apart)} of {len(rows)} requests alike live and simulated"
    ]
    out += [
        f"  conversation {r['conversation']} turn {r['turn']} ({r['prompt_tokens']} in, "
        f"{r['max_tokens']} out): live {side(r['live'])}; sim {side(r['sim'])}"
        for r in apart
    ]
    return out


def host_note(host: dict[str, Any] | None, simulated: bool) -> str:
    """The host latency the simulator was given, and the probe's points it was fitted to."""
    if host is None:
        return "host latency in the simulator: 0 (no probe)" if simulated else "no simulator"
    fit = host["fit"]
    points = ", ".join(
        f"{p['prompt_tokens'] / 1e3:.1f}K: {p['host_ms']:.1f}" for p in host["points"]
    )
    return (
        f"host latency in the simulator: {fit['fixed_ms']:.1f} ms + "
        f"{fit['per_1k_tokens_ms']:.2f} ms per 1K prompt tokens, fitted to {len(host['points'])} "
        f"idle same-dc requests (live TTFT - simulated, ms: {points}), and "
        f"{fit.get('per_step_ms', 0.0):.3f} ms per engine step ({step_origin(host)})"
    )


def step_origin(host: dict[str, Any]) -> str:
    """Where the per-step part came from: measured, and moved into the simulator's terms."""
    measured = host.get("per_step_measured_ms")
    said = "same-dc's mean token gap less its paced decode step"
    if measured is None:  # a result from before the move
        return said
    return (
        f"{said}, {measured:.3f} ms, less the simulator's same-dc TPOT beyond the live one's "
        "on that run"
    )


def _cell(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "share":
        return f"{v:.1%}"
    if unit == "x":
        return f"{v:.1f}x"
    if unit == "B":
        return f"{v:,.0f}"
    if unit == "req/s":
        return f"{v:.3f}"
    return f"{v:.0f}"


def workload_words(config: dict[str, Any]) -> str:
    """The agent workload in words: its size and how warm it is (an ideal cache's hits)."""
    words = f"{config['requests']} requests of {config['conversations']} agent conversations"
    hit = config.get("prefix_hit")  # (older results did not record it)
    if hit:
        words += (
            f" (an ideal prefix cache hits {hit['mean']:.0%} of a prompt, {hit['above_95']:.0%}"
            " of them above 95%; source ~90%, 70-80%)"
        )
    return words


def print_report(
    result: dict[str, Any], config: dict[str, Any], path: Path, files: list[str]
) -> None:
    print(
        f"\nreproduce: {workload_words(config)}; "
        f"line {config['line_gbit']:g} Gbit/s, k = {config['dilation_k']:g}; "
        f"wall {config['wall_s'] / 60:.1f} min; load {config['load_before'][0]:.2f} -> "
        f"{config['load_after'][0]:.2f}"
    )
    print("durations in modelled ms (wall / k); sim vs live = (sim - live) / live")
    heads = ("figure", "source", "live", "sim", "sim vs live")
    cells = [
        (
            r["figure"],
            _cell(r["source"], r["unit"]),
            _cell(r["live"], r["unit"]),
            _cell(r["sim"], r["unit"]),
            "-" if r["sim_vs_live"] is None else f"{r['sim_vs_live']:+.0%}",
        )
        for r in result["rows"]
    ]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    print(
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(heads, widths, strict=True))
        )
    )
    for c in cells:
        print(
            "  ".join(
                x.ljust(w) if i == 0 else x.rjust(w)
                for i, (x, w) in enumerate(zip(c, widths, strict=True))
            )
        )
    for line in notes(result):
        print(line)
    if result["handoff"]:
        h = result["handoff"]
        print(
            f"handoff, {h['relay_tokens']} relay tokens: payload token-id "
            f"{h['payload_bytes'].get('token-id')} B vs KV-direct "
            f"{h['payload_target_bytes'].get('kv-direct')} B of the target's KV "
            f"(details: {h['path']})"
        )
    for name, why in result.get("failed_stages", {}).items():
        print(f"FAILED STAGE {name}: {why} (its figures are missing)")
    print("\ntargets:")
    for name, ok in result["checks"].items():
        print(f"  {'PASS' if ok else ('n/a ' if ok is None else 'FAIL')}  {name}")
    print(f"\nwrote {path}")
    for f in files:
        print(f"wrote {f}")


def markdown(result: dict[str, Any], config: dict[str, Any], command: str) -> str:
    """The run as the Markdown docs/reproduction.md quotes: the command, commit, load and k,
    the side-by-side table, the busy shares and the targets."""
    lines = [
        f"`{command}` at commit `{config.get('commit')}`: {workload_words(config)}, "
        f"line {config['line_gbit']:g} Gbit/s, "
        f"k = {config['dilation_k']:g}, {config['wall_s'] / 60:.1f} min of wall time, load "
        f"average {config['load_before'][0]:.2f} before, {config['load_after'][0]:.2f} after.",
        "",
        "| figure | source | live | sim | sim vs live |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for r in result["rows"]:
        err = "-" if r["sim_vs_live"] is None else f"{r['sim_vs_live']:+.0%}"
        lines.append(
            f"| {r['figure']} | {_cell(r['source'], r['unit'])} | {_cell(r['live'], r['unit'])} "
            f"| {_cell(r['sim'], r['unit'])} | {err} |"
        )
    lines.append("")
    lines += [f"- {line}" for line in notes(result)]
    lines.append("")
    for name, why in result.get("failed_stages", {}).items():
        lines.append(f"- FAILED STAGE {name}: {why} (its figures are missing)")
    for name, ok in result["checks"].items():
        lines.append(f"- {'PASS' if ok else ('n/a' if ok is None else 'FAIL')}: {name}")
    return "\n".join(lines) + "\n"
