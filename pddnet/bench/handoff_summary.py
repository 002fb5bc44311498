"""handoff bench: the summary of the trials (pure), the table it prints and its plots."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pddnet.bench.handoff_rig import CONDITIONS
from pddnet.bench.handoff_setup import KV_DIRECT, PATHS, TOKEN_ID
from pddnet.bench.metrics import stats_ms
from pddnet.bench.plots import cdf_plot, panels_plot

HEADLINE_TOKENS = 100  # the source's comparison point (4649 KB vs 1.5 KB for 100 tokens)
# The source's 100-token handoff (pddnet/sim/reproduce.py's SOURCE["handoff"], docs/simulator.md)
SOURCE_FIGURE: dict[str, Any] = {
    "relay_tokens": HEADLINE_TOKENS,
    "payload_kb": {TOKEN_ID: 1.5, KV_DIRECT: 4649.0},
    "mean_ms": {TOKEN_ID: 305.0, KV_DIRECT: 185.0},
    "max_ms": {TOKEN_ID: 321.4, KV_DIRECT: 512.6},
}
# Issue 26's target for that figure: under jitter with competing traffic, token-id's max/mean
# at most this and KV-direct's at least that; judged on a plain FIFO line and on one that serves
# the control lanes first (each where the run has it): condition -> the line's name
TARGET_CONDITIONS = {"jitter+bulk": "FIFO line", "jitter+bulk+priority": "control class"}
TOKEN_ID_MAX_OVER_MEAN = 1.10
KV_DIRECT_MAX_OVER_MEAN = 2.0
TAIL_MULTIPLES = (TOKEN_ID_MAX_OVER_MEAN, KV_DIRECT_MAX_OVER_MEAN)

# -- summarising (pure) ---------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def path_summary(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One path's handoffs at one relay count and condition: the stats of the handoff latency
    and its parts under vLLM's stat-key names (mean_/median_/std_/p90_/p99_/max_<x>_ms;
    pddnet.bench.metrics), max / mean, the bytes and the forward sizes."""

    def st(name: str, key: str) -> dict[str, float | None]:
        return stats_ms(name, [t[key] for t in trials], with_max=True)

    lat, wire = st("handoff_latency", "latency_s"), st("wire", "wire_s")
    mean_s = (lat["mean_handoff_latency_ms"] or 0.0) / 1e3
    return {
        "n": len(trials),
        **lat,
        "max_over_mean": _ratio(lat["max_handoff_latency_ms"], lat["mean_handoff_latency_ms"]),
        # how many handoffs lie at or beyond each multiple of the mean the target names: a
        # max/mean is one handoff, this says whether it was one of many or a lone one
        "at_least_x_mean": {
            f"{x:g}": sum(t["latency_s"] >= x * mean_s for t in trials) for x in TAIL_MULTIPLES
        },
        **wire,
        "wire_max_over_mean": _ratio(wire["max_wire_ms"], wire["mean_wire_ms"]),
        **st("md", "md_s"),
        **st("forward", "forward_s"),
        **st("import", "import_s"),
        "payload_bytes": max((t["payload_bytes"] for t in trials), default=None),
        "payload_bytes_min": min((t["payload_bytes"] for t in trials), default=None),
        "payload_target_bytes": max((t["payload_target_bytes"] for t in trials), default=None),
        "kv_bytes_received": max((t["kv_bytes_received"] for t in trials), default=None),
        "forward_tokens": sorted({t["forward_tokens"] for t in trials}),
        "token_exact": all(t["token_exact"] for t in trials),
        # how many of them TCP had to repair (None: the system reports no counters)
        "handoffs_retransmitting": _count_tcp(trials, "retrans_segments"),
        "handoffs_with_rto": _count_tcp(trials, "rtos"),
    }


def _count_tcp(trials: Sequence[dict[str, Any]], counter: str) -> int | None:
    """The trials in which RLD's lanes counted at least one `counter` (TcpCounters' field)."""
    counted = 0
    for t in trials:
        lanes = [c for c in (t.get("tcp") or {}).values() if c and c[counter] is not None]
        if not lanes:
            return None
        counted += any(c[counter] > 0 for c in lanes)
    return counted


# the latency stats whose KV-direct / token-id ratio a row and the headline report
RATIO_KEYS = (
    "mean_handoff_latency_ms",
    "median_handoff_latency_ms",
    "p99_handoff_latency_ms",
    "max_handoff_latency_ms",
    "mean_wire_ms",
    "max_wire_ms",
)


def summarise(
    trials: Sequence[dict[str, Any]], conditions: Sequence[str], counts: Sequence[int]
) -> dict[str, list[dict[str, Any]]]:
    """Per condition, one row per relay count: each path's figures and KV-direct / token-id."""
    out: dict[str, list[dict[str, Any]]] = {}
    for cond in conditions:
        rows = []
        for n in sorted(set(counts)):
            per = {
                p: path_summary(
                    [
                        t
                        for t in trials
                        if t["condition"] == cond and t["relay_tokens"] == n and t["path"] == p
                    ]
                )
                for p in PATHS
            }
            tok, kv = per[TOKEN_ID], per[KV_DIRECT]
            ratios = {
                "payload": _ratio(kv["payload_bytes"], tok["payload_bytes"]),
                "max_over_mean": _ratio(kv["max_over_mean"], tok["max_over_mean"]),
            }
            for key in RATIO_KEYS:
                ratios[key] = _ratio(kv[key], tok[key])
            rows.append(
                {"relay_tokens": n, TOKEN_ID: tok, KV_DIRECT: kv, "kv_direct_over_token_id": ratios}
            )
        out[cond] = rows
    return out


HEADLINE_KEYS = (
    "n",
    "mean_handoff_latency_ms",
    "p99_handoff_latency_ms",
    "max_handoff_latency_ms",
    "max_over_mean",
    "at_least_x_mean",
    "handoffs_retransmitting",
    "handoffs_with_rto",
    "mean_wire_ms",
    "max_wire_ms",
    "wire_max_over_mean",
)


def headline(
    rows: dict[str, list[dict[str, Any]]], target: int = HEADLINE_TOKENS
) -> dict[str, Any]:
    """The source's comparison point: the relay count nearest `target` tokens."""
    any_rows = next(iter(rows.values()))
    n = min((r["relay_tokens"] for r in any_rows), key=lambda c: (abs(c - target), c))
    out: dict[str, Any] = {"relay_tokens": n, "conditions": {}}
    for cond, cond_rows in rows.items():
        row = next(r for r in cond_rows if r["relay_tokens"] == n)
        out["payload_bytes"] = {p: row[p]["payload_bytes"] for p in PATHS}
        out["payload_ratio"] = row["kv_direct_over_token_id"]["payload"]
        target = {p: row[p]["payload_target_bytes"] for p in PATHS}
        out["payload_target_bytes"] = target
        out["payload_target_ratio"] = _ratio(target[KV_DIRECT], target[TOKEN_ID])
        out["conditions"][cond] = {
            **{p: {k: row[p][k] for k in HEADLINE_KEYS} for p in PATHS},
            "kv_direct_over_token_id": row["kv_direct_over_token_id"],
        }
    base = out["conditions"].get("quiet")
    for cond, c in out["conditions"].items():  # what the disturbance added, path by path
        if base is not None and cond != "quiet":
            c["over_quiet"] = {
                p: {
                    k: _ratio(c[p][k], base[p][k])
                    for k in (
                        "mean_handoff_latency_ms",
                        "max_handoff_latency_ms",
                        "mean_wire_ms",
                        "max_wire_ms",
                    )
                }
                for p in PATHS
            }
    return out


def figure(head: dict[str, Any], devices: dict[str, Any]) -> dict[str, Any]:
    """The source's handoff figure from a run's `headline` and its `device_report`: per
    condition and path the latency's mean, max and max/mean (modelled ms when emulated), the
    payload in real and target bytes, whether issue 26's target holds in each of
    TARGET_CONDITIONS the run has, and whether the run's devices kept pace (`valid`; None unpaced: the
    times are this box's)."""
    conditions = {
        cond: {
            p: {
                "mean_ms": c[p]["mean_handoff_latency_ms"],
                "max_ms": c[p]["max_handoff_latency_ms"],
                "max_over_mean": c[p]["max_over_mean"],
                # (.get: results from before these were recorded)
                "handoffs": c[p].get("n"),
                "at_least_x_mean": c[p].get("at_least_x_mean"),
                "retransmitting": c[p].get("handoffs_retransmitting"),
                "with_rto": c[p].get("handoffs_with_rto"),
            }
            for p in PATHS
        }
        for cond, c in head["conditions"].items()
    }
    met: dict[str, bool] = {}
    for cond in TARGET_CONDITIONS:
        jb = conditions.get(cond)
        if jb is not None and None not in (jb[p]["max_over_mean"] for p in PATHS):
            met[cond] = (
                jb[TOKEN_ID]["max_over_mean"] <= TOKEN_ID_MAX_OVER_MEAN
                and jb[KV_DIRECT]["max_over_mean"] >= KV_DIRECT_MAX_OVER_MEAN
            )
    emulated = bool(devices.get("emulated"))
    return {
        "relay_tokens": head["relay_tokens"],
        "payload_bytes": head["payload_bytes"],
        "payload_ratio": head["payload_ratio"],
        "payload_target_bytes": head["payload_target_bytes"],
        "payload_target_ratio": head["payload_target_ratio"],
        "conditions": conditions,
        "target": {
            "token_id_max_over_mean_at_most": TOKEN_ID_MAX_OVER_MEAN,
            "kv_direct_max_over_mean_at_least": KV_DIRECT_MAX_OVER_MEAN,
            "met": met,  # per condition the run has
        },
        "emulated": emulated,
        "dilation": devices.get("dilation", 1.0) if emulated else 1.0,
        "valid": devices["valid"] if emulated else None,
        # the k at which its slowest forward would not have overrun (None unpaced)
        "dilation_needed": devices.get("dilation_needed") if emulated else None,
        "overruns": devices.get("overruns") if emulated else None,
        "steps": devices.get("steps") if emulated else None,
        "source": SOURCE_FIGURE,
    }


def wan_line(wan: dict[str, Any] | None) -> str:
    """What carried the handoffs, in words (`WanLink.describe()`; None: not recorded)."""
    if not wan:
        return "not recorded"
    if wan.get("shell") == "packet":
        rto = wan.get("tcp_rto_min_ms")  # (older results did not record it)
        rto_words = "" if rto is None else f", minimum RTO {rto:g} ms of wall clock"
        return (
            f"the packet shell (real TCP, {wan.get('tcp_congestion_control')}, MTU "
            f"{wan.get('mtu')}{rto_words}; the buffer drops what does not fit)"
        )
    if wan.get("shell") == "proxy":
        return "the proxy shell (lossless: a full buffer holds the sender back)"
    return str(wan.get("shell"))


# -- output ---------------------------------------------------------------------------------------


def print_table(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, Any]]],
    head: dict[str, Any],
    kv_per_token: int,
    infos: dict[str, Any],
    devices_line: str,
    wan: dict[str, Any] | None = None,
) -> None:
    def ms(v: float | None) -> str:
        return f"{'-':>6}" if v is None else f"{v:6.1f}"

    def x(v: float | None) -> str:
        return f"{'-':>5}" if v is None else f"{v:5.2f}"

    print(
        f"\nhandoff benchmark: model {args.model} ({kv_per_token} B of KV per token), prompt "
        f"{args.prompt_len} tokens, WAN {args.rtt_ms:g} ms RTT, {args.bw_mbit:g} Mbit/s, "
        f"buffer {args.queue_ms:g} ms, on {wan_line(wan)}; {args.repeats} handoffs per point "
        f"and path\n{devices_line}"
    )
    for cond, cond_rows in rows.items():
        info = infos[cond]
        extra = []
        if CONDITIONS[cond]["jitter"]:
            extra.append(f"jitter {args.jitter_ms:g} ms")
        if info["bulk"]:
            extra.append(f"bulk traffic at {info['bulk']['measured_load']:.0%} of the link")
        if CONDITIONS[cond]["priority"]:
            extra.append("the control lane in a priority class")
        load = info["loadavg_1min"]
        if load["before"] is not None and load["after"] is not None:
            extra.append(f"load average {load['before']:.1f} -> {load['after']:.1f}")
        print(
            f"\n[{cond}] {', '.join(extra)}\n  handoff_latency in ms, from RLD's cut to MD's "
            f"first token sampled (mean, median, p99, max; max/mean)"
        )
        print(
            f"{'relay':>5} | {'payload B tok':>13} {'KV-direct':>10} {'x':>6} | "
            f"{'tok mean':>8} {'median':>6} {'p99':>6} {'max':>6} {'max/mn':>6} | "
            f"{'KV mean':>7} {'median':>6} {'p99':>6} {'max':>6} {'max/mn':>6} | "
            f"{'KV/tok mean':>11} {'max':>5} | exact"
        )
        for r in cond_rows:
            tok, kv, q = r[TOKEN_ID], r[KV_DIRECT], r["kv_direct_over_token_id"]

            def lat(s: dict[str, Any]) -> str:
                return " ".join(ms(s[f"{k}_handoff_latency_ms"]) for k in ("median", "p99", "max"))

            exact = "yes" if tok["token_exact"] and kv["token_exact"] else "NO"
            print(
                f"{r['relay_tokens']:>5} | {tok['payload_bytes']:>13} "
                f"{kv['payload_bytes']:>10} {q['payload'] or 0:6.0f} | "
                f"{ms(tok['mean_handoff_latency_ms']):>8} {lat(tok)} "
                f"{x(tok['max_over_mean']):>6} | {ms(kv['mean_handoff_latency_ms']):>7} "
                f"{lat(kv)} {x(kv['max_over_mean']):>6} | "
                f"{x(q['mean_handoff_latency_ms']):>11} {x(q['max_handoff_latency_ms'])} | "
                f"{exact}"
            )
        print("  of which on the wire (cut -> MD has decoded the last frame it needs), and MD:")
        for r in cond_rows:
            tok, kv = r[TOKEN_ID], r[KV_DIRECT]
            print(
                f"{r['relay_tokens']:>5} | token-id wire mean {ms(tok['mean_wire_ms'])} max "
                f"{ms(tok['max_wire_ms'])} max/mn {x(tok['wire_max_over_mean'])}, MD "
                f"{ms(tok['mean_md_ms'])} | KV-direct wire mean {ms(kv['mean_wire_ms'])} "
                f"max {ms(kv['max_wire_ms'])} max/mn {x(kv['wire_max_over_mean'])}, MD "
                f"{ms(kv['mean_md_ms'])}"
            )
        if any(r[p]["handoffs_retransmitting"] for r in cond_rows for p in PATHS):
            print("  handoffs in which TCP retransmitted (of them, after a timeout):")
            for r in cond_rows:
                print(
                    f"{r['relay_tokens']:>5} | "
                    + ", ".join(
                        f"{p} {r[p]['handoffs_retransmitting']} of {r[p]['n']} "
                        f"({r[p]['handoffs_with_rto']})"
                        for p in PATHS
                    )
                )
    n = head["relay_tokens"]
    pb, tb = head["payload_bytes"], head["payload_target_bytes"]
    target = ""
    if tb != pb:
        target = (
            f"; as the target model's KV: {tb[TOKEN_ID]} B vs {tb[KV_DIRECT]} B "
            f"({head['payload_target_ratio']:.0f}x)"
        )
    print(
        f"\nat {n} relay tokens: payload token-id {pb[TOKEN_ID]} B vs KV-direct "
        f"{pb[KV_DIRECT]} B ({head['payload_ratio']:.0f}x{target}; source: 1.5 KB vs 4649 KB)"
    )
    for cond, c in head["conditions"].items():
        t, k = c[TOKEN_ID], c[KV_DIRECT]
        q = c["kv_direct_over_token_id"]
        print(
            f"  {cond:>11}: token-id mean {t['mean_handoff_latency_ms']:.1f} ms, max "
            f"{t['max_handoff_latency_ms']:.1f} ms (max/mean {t['max_over_mean']:.2f}); "
            f"KV-direct mean {k['mean_handoff_latency_ms']:.1f} ms, max "
            f"{k['max_handoff_latency_ms']:.1f} ms (max/mean {k['max_over_mean']:.2f}); "
            f"KV-direct / token-id mean {q['mean_handoff_latency_ms']:.2f}x, max "
            f"{q['max_handoff_latency_ms']:.2f}x"
        )
        print(
            f"  {'':>11}  wire only: token-id max/mean {t['wire_max_over_mean']:.2f}, "
            f"KV-direct {k['wire_max_over_mean']:.2f}"
        )
        if "over_quiet" in c:
            g = c["over_quiet"]
            gt, gk = g[TOKEN_ID], g[KV_DIRECT]
            print(
                f"  {'':>11}  vs quiet: token-id mean {gt['mean_handoff_latency_ms']:.2f}x, "
                f"max {gt['max_handoff_latency_ms']:.2f}x, wire mean "
                f"{gt['mean_wire_ms']:.2f}x; KV-direct mean "
                f"{gk['mean_handoff_latency_ms']:.2f}x, max {gk['max_handoff_latency_ms']:.2f}x,"
                f" wire mean {gk['mean_wire_ms']:.2f}x"
            )


def plot(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, Any]]],
    trials: Sequence[dict[str, Any]],
    head: dict[str, Any],
    path: Path,
) -> list[str]:
    def series(key: Callable[[dict[str, Any]], float | None]) -> dict[str, Any]:
        out = {}
        for cond, cond_rows in rows.items():
            for p in PATHS:
                pts = [(r["relay_tokens"], key(r[p])) for r in cond_rows if key(r[p]) is not None]
                out[f"{p}, {cond}"] = ([a for a, _ in pts], [b for _, b in pts])
        return out

    def ms(q: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda s: s[f"{q}_handoff_latency_ms"]

    written = []
    png = panels_plot(
        [
            ("mean_handoff_latency (ms)", series(ms("mean"))),
            ("max_handoff_latency (ms)", series(ms("max"))),
            ("max / mean", series(lambda s: s["max_over_mean"])),
        ],
        path.with_suffix(".png"),
        "relay tokens handed over",
        f"Token-id vs KV-direct handoff, model {args.model}, {args.rtt_ms:g} ms "
        f"RTT, {args.bw_mbit:g} Mbit/s",
        logx=True,
    )
    if png:
        written.append(str(png))
    n = head["relay_tokens"]
    samples = {
        f"{p}, {cond}": [
            t["latency_s"]
            for t in trials
            if t["relay_tokens"] == n and t["path"] == p and t["condition"] == cond
        ]
        for cond in rows
        for p in PATHS
    }
    cdf = cdf_plot(
        samples,
        path.with_name(path.stem + "-cdf.png"),
        "handoff latency (ms)",
        f"Handoff latency at {n} relay tokens",
    )
    if cdf:
        written.append(str(cdf))
    return written
