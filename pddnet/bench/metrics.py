"""The serving metrics of every `pdd bench` and `pdd demo`, under vLLM's names and definitions
(`vllm bench serve`'s result JSON); docs/benchmarks.md, "Metrics", is where they are defined.

Per request, from what the client saw (`StreamRecord`: raw clock readings, durations divided by
its dilation k, so modelled time on emulated devices):

- ttft: sent -> first output token arrived;
- e2el: sent -> last output token arrived (end-to-end latency);
- tpot: (e2el - ttft) / (n - 1) for n > 1 output tokens (vLLM's definition; requests with one
  token have none, and count as tpot 0 for goodput, as in vLLM);
- itl: every gap between consecutive token arrivals, n - 1 per request, pooled over requests.

Per run, over `duration` (the run's makespan, modelled): request_throughput (completed / s),
output_throughput (output tokens / s), total_token_throughput ((input + output) tokens / s) and
request_goodput (completed requests meeting every SLO given with ``--goodput KEY:MS ...`` / s).

Stats of each duration metric X, in ms: mean_X_ms, median_X_ms, std_X_ms (population, numpy's
default) and pNN_X_ms for each of ``--metric-percentiles`` (linear interpolation, numpy's
default), None where there is no value (vLLM writes 0 there).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from pddnet.bench.results import percentile

SERVING_METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")  # vLLM's VALID_NAMES for --goodput
DEFAULT_PERCENTILES = (90.0, 99.0)  # vLLM's default is "99"; median is p50
DEFAULT_GOODPUT = {"ttft": 1000.0, "tpot": 50.0}  # ms; pddnet's default SLOs
PIPELINES = (("p_md", "P->MD"), ("p_rld_md", "P->RLD->MD"), ("p_rld", "P->RLD"))


# -- argument parsing (vLLM's syntax) -------------------------------------------------------------


def goodput_pair(text: str) -> tuple[str, float]:
    """One ``KEY:VALUE`` of ``--goodput`` (argparse type), parsed as vLLM's parse_goodput and
    checked as its check_goodput_args: exactly one ':', a float in ms, a known key, >= 0."""
    try:
        name, value = text.split(":")
        ms = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid service level objective {text!r}: give it as KEY:VALUE, where the key is "
            f"one of {', '.join(GOODPUT_METRICS)} and the value a number in milliseconds "
            f"(e.g. --goodput ttft:1000 tpot:50)"
        ) from None
    if name not in GOODPUT_METRICS:
        raise argparse.ArgumentTypeError(
            f"invalid metric name in {text!r}: the service level objective name should be one "
            f"of {', '.join(GOODPUT_METRICS)}"
        )
    if not ms >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(
            f"invalid value in {text!r}: the service level objective value should be a "
            f"non-negative number of milliseconds"
        )
    return name, ms


def metric_percentiles(text: str) -> list[float]:
    """``--metric-percentiles`` (argparse type): comma-separated, as vLLM's, each in 0..100."""
    try:
        values = [float(p) for p in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid percentiles {text!r}: give a comma-separated list of numbers, e.g. 50,90,99"
        ) from None
    bad = [p for p in values if not 0 <= p <= 100]
    if bad:
        raise argparse.ArgumentTypeError(f"percentiles must be within 0..100, got {bad[0]:g}")
    return values


def add_arguments(p: argparse.ArgumentParser, goodput: bool = True) -> None:
    """``--metric-percentiles`` and (with `goodput`) ``--goodput`` and the deprecated
    ``--sla-ttft-ms`` / ``--sla-tpot-ms``."""
    p.add_argument(
        "--metric-percentiles",
        type=metric_percentiles,
        default=list(DEFAULT_PERCENTILES),
        metavar="P[,P...]",
        help="percentiles reported for ttft, tpot, itl, e2el as pNN_<metric>_ms, as "
        "in vLLM's bench serve (default 90,99; median_<metric>_ms is always "
        "there)",
    )
    if not goodput:
        return
    p.add_argument(
        "--goodput",
        type=goodput_pair,
        nargs="+",
        default=None,
        metavar="KEY:MS",
        help="service level objectives for request_goodput, as in vLLM's bench "
        "serve: KEY:MS pairs with KEY in ttft, tpot, e2el (default: ttft:1000 "
        "tpot:50)",
    )
    p.add_argument("--sla-ttft-ms", type=float, default=None, help="deprecated: --goodput ttft:MS")
    p.add_argument("--sla-tpot-ms", type=float, default=None, help="deprecated: --goodput tpot:MS")


def goodput_config(
    args: argparse.Namespace, warn: Callable[[str], None] | None = None
) -> dict[str, float]:
    """The SLOs (ms by metric) from ``--goodput`` (the last pair of a key wins, as in vLLM),
    the deprecated ``--sla-*-ms`` (said on stderr; a clash with --goodput is an error), or the
    default ttft:1000 tpot:50 when neither is given."""
    pairs = getattr(args, "goodput", None)
    out: dict[str, float] = dict(pairs) if pairs else {}
    legacy = {
        "ttft": getattr(args, "sla_ttft_ms", None),
        "tpot": getattr(args, "sla_tpot_ms", None),
    }
    for key, value in legacy.items():
        if value is None:
            continue
        flag = f"--sla-{key}-ms"
        if not value >= 0:
            raise ValueError(f"{flag} must be a non-negative number of ms, got {value:g}")
        if key in out and out[key] != value:
            raise ValueError(
                f"{flag} {value:g} contradicts --goodput {key}:{out[key]:g} "
                f"({flag} is deprecated: use --goodput only)"
            )
        (warn or _stderr)(
            f"note: {flag} is deprecated; use --goodput {key}:{value:g} (vLLM's syntax)"
        )
        out[key] = value
    if not pairs and all(v is None for v in legacy.values()):
        out = dict(DEFAULT_GOODPUT)
    return out


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def goodput_label(slos: dict[str, float]) -> str:
    return " ".join(f"{k}:{v:g}" for k, v in slos.items()) or "none"


# -- per request ----------------------------------------------------------------------------------


def ttft_s(rec: Any) -> float | None:
    return rec.ttft_s


def e2el_s(rec: Any) -> float | None:
    """Sent -> last token arrived, modelled (None without tokens)."""
    return rec.span_s(rec.sent_at, rec.token_times[-1]) if rec.token_times else None


def tpot_s(rec: Any) -> float | None:
    """(e2el - ttft) / (n - 1), n = output tokens; None for n < 2 (vLLM's definition)."""
    n = len(rec.token_times)
    if n < 2:
        return None
    return rec.span_s(rec.token_times[0], rec.token_times[-1]) / (n - 1)


def itl_s(rec: Any) -> list[float]:
    """Every gap between consecutive token arrivals (tokens of one chunk: gap 0)."""
    return rec.inter_token_s()


def completed(records: Iterable[Any]) -> list[Any]:
    """The successful requests: no error and at least one token."""
    return [r for r in records if r.error is None and r.ttft_s is not None]


def meets_slos(rec: Any, slos: dict[str, float]) -> bool:
    """vLLM's goodput test: every given SLO >= the request's value (a request with a single
    token has tpot 0 here, as in vLLM)."""
    values = {"ttft": rec.ttft_s, "tpot": tpot_s(rec) or 0.0, "e2el": e2el_s(rec)}
    return all(values[k] is not None and ms / 1e3 >= values[k] for k, ms in slos.items())


# -- stats ----------------------------------------------------------------------------------------


def p_word(p: float) -> str:
    """vLLM's name of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def stats_ms(
    name: str,
    values_s: Sequence[float],
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    with_max: bool = False,
) -> dict[str, float | None]:
    """mean_/median_/std_/pNN_<name>_ms of seconds `values_s` (None for no values), plus
    max_<name>_ms with `with_max` (pddnet's, for its own figures)."""
    xs = [v * 1e3 for v in values_s]
    mean = sum(xs) / len(xs) if xs else None
    out: dict[str, float | None] = {
        f"mean_{name}_ms": mean,
        f"median_{name}_ms": percentile(xs, 50),
        f"std_{name}_ms": (
            math.sqrt(sum((x - mean) ** 2 for x in xs) / len(xs)) if mean is not None else None
        ),
    }
    for p in percentiles:
        out[f"p{p_word(p)}_{name}_ms"] = percentile(xs, p)
    if with_max:
        out[f"max_{name}_ms"] = max(xs) if xs else None
    return out


def serving_metrics(
    records: Sequence[Any],
    duration_s: float | None,
    slos: dict[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
) -> dict[str, Any]:
    """vLLM's bench serve result keys for `records` over `duration_s` (modelled seconds):
    duration, completed, failed, total_input_tokens, total_output_tokens, request_throughput,
    request_goodput (None without SLOs), output_throughput, total_token_throughput, the SLOs
    used (goodput_slos_ms) and the stats of ttft, tpot, itl and e2el."""
    ok = completed(records)
    out_tokens = sum(len(r.token_ids) for r in ok)
    in_tokens = sum(r.prompt_len or 0 for r in ok)
    good = sum(meets_slos(r, slos) for r in ok) if slos else None

    def per_s(n: float | None) -> float | None:
        return None if n is None or not duration_s else n / duration_s

    out: dict[str, Any] = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": per_s(len(ok)),
        "request_goodput": per_s(good),
        "output_throughput": per_s(out_tokens),
        "total_token_throughput": per_s(in_tokens + out_tokens),
        "goodput_slos_ms": dict(slos or {}),
        "good_completed": good,
    }
    samples = {
        "ttft": [r.ttft_s for r in ok],
        "tpot": [t for r in ok if (t := tpot_s(r)) is not None],
        "itl": [g for r in ok for g in itl_s(r)],
        "e2el": [e for r in ok if (e := e2el_s(r)) is not None],
    }
    for name in SERVING_METRICS:
        out.update(stats_ms(name, samples[name], percentiles))
    return out


# -- pddnet's own figures, beside them ------------------------------------------------------------

PRODUCERS = (
    ("prefill", "prefill_tokens"),
    ("relay", "relay_tokens"),
    ("main_decode", "main_tokens"),
)


def handoff_latency_s(pdd: dict[str, Any]) -> float | None:
    """From RLD starting the handoff (TAKEOVER seen) to MD's first token after the cut, in
    modelled time (the timeline's `time` is wall clock: / the router's dilation)."""
    ev = {e["event"]: e["time"] for e in pdd.get("timeline", [])}
    if "handoff_start" in ev and "first_md_token" in ev:
        k = float((pdd.get("emulation") or {}).get("dilation", 1.0))
        return (ev["first_md_token"] - ev["handoff_start"]) / k
    return None


def count(values: Iterable[Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[str(v)] = out.get(str(v), 0) + 1
    return out


def pdd_extras(
    records: Sequence[Any], percentiles: Sequence[float] = DEFAULT_PERCENTILES
) -> dict[str, Any]:
    """What vLLM has no name for, from each request's `pdd` object: who produced the output
    tokens, the WAN KV bytes (real, and the target model's on emulated devices), the handoffs
    (count and latency) and the pipeline split."""
    ok = completed(records)
    tokens = {name: sum(int(r.pdd.get(key, 0) or 0) for r in ok) for name, key in PRODUCERS}
    total = sum(tokens.values())
    share = {name: (n / total if total else 0.0) for name, n in tokens.items()}
    handoffs = [h for r in ok if (h := handoff_latency_s(r.pdd)) is not None]
    pipelines = count(r.pdd.get("pipeline") for r in ok)
    return {
        "errors": [r.error for r in records if r.error is not None][:5],
        "cluster_mode": next((r.pdd["mode"] for r in ok if r.pdd.get("mode")), None),
        "tokens_by_producer": tokens,
        "token_share": share,
        "rld_token_share": share["relay"],
        "md_token_share": share["main_decode"],
        "wan_kv_bytes": sum(int(r.pdd.get("wan_kv_bytes", 0) or 0) for r in ok),
        "target_wan_kv_bytes": sum(
            int(r.pdd.get("target_wan_kv_bytes", r.pdd.get("wan_kv_bytes", 0)) or 0) for r in ok
        ),
        "handoff_bytes": sum(int(r.pdd.get("handoff_bytes", 0) or 0) for r in ok),
        "prefix_hit_tokens": sum(int(r.pdd.get("prefix_hit_tokens", 0) or 0) for r in ok),
        "handoff_count": len(handoffs),
        **stats_ms("handoff_latency", handoffs, percentiles, with_max=True),
        "handoff_modes": count(r.pdd.get("handoff_mode") for r in ok if r.pdd.get("handoff_mode")),
        "pipeline_split": pipelines,
        # P->RLD->MD requests RLD finished before MD's copy was complete: no handoff
        "p_rld_md_finished_on_rld": sum(
            1
            for r in ok
            if r.pdd.get("pipeline") == "p_rld_md" and not int(r.pdd.get("main_tokens", 0) or 0)
        ),
        **stats_ms(
            "router_ttft",
            [r.pdd["ttft_s"] for r in ok if r.pdd.get("ttft_s") is not None],
            percentiles,
        ),
    }


# -- tables ---------------------------------------------------------------------------------------


def ms(v: float | None, width: int = 8, digits: int = 1) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def print_columns(
    rows: Sequence[tuple[str, dict[str, Any]]],
    columns: Sequence[tuple[str, Callable[[dict[str, Any]], str]]],
    label: str = "mode",
    indent: str = "",
) -> None:
    """A table: one row per (name, summary), one column per (header, cell of a summary);
    each column as wide as its header or widest cell."""
    cells = [[name] + [fn(s) for _, fn in columns] for name, s in rows]
    heads = [label] + [h for h, _ in columns]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]
    print(indent + "  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True)))
    for c in cells:
        print(indent + "  ".join(x.rjust(w) for x, w in zip(c, widths, strict=True)))


def serving_columns(
    percentiles: Sequence[float], goodput: bool = True
) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """The vLLM-named columns of a serving table (durations in ms, throughputs per s)."""

    def col(key: str, digits: int = 1) -> Callable[[dict[str, Any]], str]:
        return lambda s: ms(s.get(key), 1, digits)

    top = p_word(max(percentiles)) if percentiles else None
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("ok", lambda s: f"{s['completed']}/{s['completed'] + s['failed']}"),
        ("median_ttft", col("median_ttft_ms", 0)),
    ]
    cols += [(f"p{p_word(p)}_ttft", col(f"p{p_word(p)}_ttft_ms", 0)) for p in percentiles]
    cols += [("median_tpot", col("median_tpot_ms")), ("median_itl", col("median_itl_ms"))]
    if top is not None:
        cols.append((f"p{top}_itl", col(f"p{top}_itl_ms")))
    cols.append(("median_e2el", col("median_e2el_ms", 0)))
    if goodput:
        cols.append(("request_goodput", col("request_goodput", 2)))
    cols.append(("output_throughput", col("output_throughput", 1)))
    return cols


def pdd_columns(
    summaries: Iterable[dict[str, Any]] = (),
) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """pddnet's own columns: requests per pipeline (same-dc: "-", its one pipeline is P->D),
    handoffs and their latency (ms), RLD's and MD's share of the output tokens (same-dc's
    decode instance, D, counts as RLD), and MiB over the WAN: KV (and the target model's KV,
    where emulated devices make it differ), all MD received and sent where known."""
    summaries = list(summaries)

    def pipe(wire: str) -> Callable[[dict[str, Any]], str]:
        return lambda s: (
            "-" if s.get("cluster_mode") == "same-dc" else str(s["pipeline_split"].get(wire, 0))
        )

    def mib(key: str) -> Callable[[dict[str, Any]], str]:
        return lambda s: "-" if s.get(key) is None else f"{s[key] / 2**20:.1f}"

    cols = [(label, pipe(wire)) for wire, label in PIPELINES]
    cols += [
        ("handoffs", lambda s: str(s["handoff_count"])),
        ("mean_handoff_latency", lambda s: ms(s["mean_handoff_latency_ms"], 1, 0)),
        ("max_handoff_latency", lambda s: ms(s["max_handoff_latency_ms"], 1, 0)),
        (
            "RLD_share",
            lambda s: (
                f"{s['rld_token_share']:.1%}"
                + (" (D)" if s.get("cluster_mode") == "same-dc" else "")
            ),
        ),
        ("MD_share", lambda s: f"{s['md_token_share']:.1%}"),
        ("wan_kv_MiB", mib("wan_kv_bytes")),
    ]
    if any(s["target_wan_kv_bytes"] != s["wan_kv_bytes"] for s in summaries):
        cols.append(("target_wan_kv_MiB", mib("target_wan_kv_bytes")))
    if any("md_wan_bytes_received" in s for s in summaries):
        cols.append(("MD_in_MiB", mib("md_wan_bytes_received")))
    if any("md_wan_bytes_sent" in s for s in summaries):
        cols.append(("MD_out_MiB", mib("md_wan_bytes_sent")))
    return cols
