"""The calibration's fits: chip profiles and the shared host's contention from the testbed's
fit-tagged records (P's busy periods, the P -> RLD path, export waits, RLD's and MD's decode
gaps). See pddnet.sim.calibrate.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from pddnet.device.cost import prefill_flops

Gap = tuple[int, int, float, bool, float]  # (batch, context tokens, gap, P busy, midpoint)
STALL_QUANTILE = 0.99  # decode gaps above this quantile are stalls, not steps
P_FITS = ("total", "lstsq", "relative-total", "relative")  # --p-fit: residuals, scale
AT_ONCE_S = 0.01  # P's next step began "at once": admitted this soon after a step


def ok_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r["error"] is None and r["tokens"]]


def lstsq(cols: list[list[float]], ys: list[float]) -> list[float]:
    import numpy as np

    coef, *_ = np.linalg.lstsq(np.array(cols, dtype=float).T, np.array(ys, dtype=float), rcond=None)
    return [float(c) for c in coef]


def isolated_prefills(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Requests whose prefill [start, end] overlapped no other prefill: their duration is
    P's service time alone (the engine batches waiting prompts into one step otherwise)."""
    iv = sorted(
        (r["events"]["prefill_start"], r["events"]["prefill_end"], i)
        for i, r in enumerate(records)
        if "prefill_start" in r["events"] and "prefill_end" in r["events"]
    )
    out = []
    for k, (s, e, i) in enumerate(iv):
        before = max((x[1] for x in iv[:k]), default=-math.inf)
        after = iv[k + 1][0] if k + 1 < len(iv) else math.inf
        if before < s and after > e:
            out.append(records[i])
    return out


def busy_fraction(records: list[dict[str, Any]]) -> float:
    """Share of the run P spent prefilling (union of prefill intervals / span)."""
    iv = sorted(
        (r["events"]["prefill_start"], r["events"]["prefill_end"])
        for r in records
        if "prefill_start" in r["events"] and "prefill_end" in r["events"]
    )
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


def fitted(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if r.get("tag", "fit") == "fit"]


def fit_prefill(records: list[dict[str, Any]], prof: Any) -> dict[str, Any]:
    """P's service time from fit-tagged prefills that overlapped no other prefill (isolation
    is judged against every request: the compare stream's prefills queue on the same P)."""
    iso = fitted(isolated_prefills(records))
    if len(iso) < 4:
        raise RuntimeError(
            f"only {len(iso)} isolated prefills in the fit run: P was saturated; "
            f"lower --rate or --target-util"
        )
    xs = [prefill_flops(prof, r["prompt"]) for r in iso]
    ys = [r["events"]["prefill_end"] - r["events"]["prefill_start"] for r in iso]
    a, slope = lstsq([[1.0] * len(xs), xs], ys)
    if slope <= 0:
        raise RuntimeError("prefill time does not grow with the prompt in the fit run")
    if a < 0:  # no negative overhead: refit through the origin
        a, slope = 0.0, lstsq([xs], ys)[0]
    into_p = [r["events"]["prefill_start"] - r["sent"] for r in iso]
    return {
        "flops_per_s": 1.0 / slope,
        "overhead_s": a,
        "isolated": len(iso),
        "to_engine_s": statistics.median(into_p),
        "points": sorted(zip([r["prompt"] for r in iso], ys, strict=True)),
    }


def decoder_spans(records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float]]]:
    """When each decode role was stepping for some request (either tag: they share the batch):
    from a request's first to its last token from that role (client times)."""
    spans: dict[str, list[tuple[float, float]]] = {"relay": [], "main_decode": []}
    for r in records:
        t = r["tokens"]
        n_rld = min(r["relay_tokens"] or 0, len(t))
        if n_rld:
            spans["relay"].append((t[0], t[n_rld - 1]))
        if n_rld < len(t):
            spans["main_decode"].append((t[n_rld], t[-1]))
    return spans


def covered(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Share of [a, b] that the union of `spans` covers."""
    if b <= a:
        return 0.0
    iv = sorted((max(s, a), min(e, b)) for s, e in spans if e > a and s < b)
    total, cur = 0.0, None
    for s, e in iv:
        if cur is not None and s <= cur[1]:
            cur = (cur[0], max(cur[1], e))
            continue
        if cur is not None:
            total += cur[1] - cur[0]
        cur = (s, e)
    if cur is not None:
        total += cur[1] - cur[0]
    return total / (b - a)


def busy_periods(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """P's busy periods: requests whose [prefill_start, prefill_end] chain into one another.
    The engine steps back to back inside one (prefill_start is the end of add_request, which
    runs between steps), so a period's length is the sum of its steps."""
    iv = sorted(
        (r for r in records if "prefill_start" in r["events"] and "prefill_end" in r["events"]),
        key=lambda r: r["events"]["prefill_start"],
    )
    out: list[list[dict[str, Any]]] = []
    end = -math.inf
    for r in iv:
        s, e = r["events"]["prefill_start"], r["events"]["prefill_end"]
        if out and s <= end:
            out[-1].append(r)
        else:
            out.append([r])
            end = e
        end = max(end, e)
    return out


def load_excess(samples: list[tuple[float, float]]) -> tuple[float, Any]:
    """The run's recorded 1-min load average above its lowest sample (the floor: the cluster
    itself at its quietest), as a function of run time (linear between the 10 s samples):
    how much other work the two cores had, in runnable threads. A lagging, smoothed measure
    that also counts the cluster's own threads -- the best record of outside jobs there is."""
    import bisect

    if len(samples) < 2:
        raise RuntimeError(
            "the run recorded fewer than 2 load samples: use --contention neighbours or off"
        )
    ts = [t for t, _ in samples]
    ls = [v for _, v in samples]
    floor = min(ls)

    def excess(t: float) -> float:
        k = bisect.bisect_right(ts, t) - 1
        if k < 0:
            return ls[0] - floor
        if k >= len(ts) - 1:
            return ls[-1] - floor
        f = (t - ts[k]) / (ts[k + 1] - ts[k])
        return ls[k] + f * (ls[k + 1] - ls[k]) - floor

    return floor, excess


def fit_prefill_steps(
    records: list[dict[str, Any]],
    prof: Any,
    contention: bool,
    load: Any = None,
    relative: bool = False,
    match_total: bool = True,
) -> dict[str, Any]:
    """P's forwards as they really ran: every busy period of P that computed a fit-tagged
    prompt (their members of either tag make the work, as they shared the steps), its length
    against steps x overhead + FLOPs / rate x (1 + gamma x d), d = how many of RLD and MD were
    decoding, averaged over the period (0..2: they take turns with P on the two cores). The
    steps of a period are its distinct prefill_end times (each step finishes a prompt here:
    no prompt exceeds the step's token budget). Without `contention`, gamma = 0: the rate
    then carries the period-average slowdown. With `load` (run time -> outside load, see
    `load_excess`), the factor also has + lambda x load at the period's midpoint."""
    spans = decoder_spans(records)
    rows = []
    for members in busy_periods(records):
        if not any(r.get("tag", "fit") == "fit" for r in members):
            continue
        a = min(r["events"]["prefill_start"] for r in members)
        b = max(r["events"]["prefill_end"] for r in members)
        flops = sum(prefill_flops(prof, r["prompt"]) for r in members)
        steps = len({round(r["events"]["prefill_end"], 3) for r in members})
        d = covered(spans["relay"], a, b) + covered(spans["main_decode"], a, b)
        ell = load((a + b) / 2) if load is not None else 0.0
        if b > a:
            rows.append((b - a, flops, steps, d, ell))
    if len(rows) < 6:
        raise RuntimeError(f"only {len(rows)} P busy periods with a fit-tagged prompt")
    # Relative residuals (every row divided by its length): the error is a share of the
    # length (contention multiplies it), so plain least squares would let the few longest
    # periods set the rate and over-predict the typical one.
    w = [1.0 / x[0] if relative else 1.0 for x in rows]
    ys = [x[0] * k for x, k in zip(rows, w, strict=True)]
    cols = {
        "overhead": [x[2] * k for x, k in zip(rows, w, strict=True)],
        "slope": [x[1] * k for x, k in zip(rows, w, strict=True)],
        "gamma": [x[1] * x[3] * k for x, k in zip(rows, w, strict=True)],
        "lambda": [x[1] * x[4] * k for x, k in zip(rows, w, strict=True)],
    }
    names = (
        ["overhead", "slope"]
        + (["gamma"] if contention else [])
        + (["lambda"] if load is not None else [])
    )
    while True:
        coef = dict(zip(names, lstsq([cols[n] for n in names], ys), strict=True))
        neg = [n for n in ("overhead", "gamma", "lambda") if n in coef and coef[n] < 0]
        if not neg:  # no negative overhead or speed-up from neighbours: drop that term
            break
        names.remove(neg[0])
    slope = coef["slope"]
    if slope <= 0:
        raise RuntimeError("P's busy periods do not grow with their FLOPs in the fit run")
    gamma = coef.get("gamma", 0.0) / slope
    lam = coef.get("lambda", 0.0) / slope
    ys_abs = [x[0] for x in rows]
    if match_total:
        # P's utilisation is what its queue (the TTFT) answers to: scale the line so the
        # periods' predicted total is their measured total (overhead and shape kept)
        work = sum(f * (1 + gamma * d + lam * ell) for _, f, _, d, ell in rows)
        fixed = coef.get("overhead", 0.0) * sum(x[2] for x in rows)
        slope = max(sum(ys_abs) - fixed, 1e-9) / work
    pred = [
        coef.get("overhead", 0.0) * st + slope * f * (1 + gamma * d + lam * ell)
        for _, f, st, d, ell in rows
    ]
    err = [(p - y) / y for p, y in zip(pred, ys_abs, strict=True)]
    return {
        "flops_per_s": 1.0 / slope,
        "overhead_s": coef.get("overhead", 0.0),
        "p_per_decoder": gamma,
        "p_per_load": lam,
        "periods": len(rows),
        "steps": sum(x[2] for x in rows),
        "relative": relative,
        "total_pred_over_actual": sum(pred) / sum(ys_abs),
        "median_pred_over_actual": statistics.median(
            p / y for p, y in zip(pred, ys_abs, strict=True)
        ),
        "mean_decoders": statistics.fmean(x[3] for x in rows),
        "rel_error_sd": statistics.pstdev(err),
        "contention": contention,
    }


def fit_relay_path(records: list[dict[str, Any]], kvpt: int) -> dict[str, Any]:
    """P -> RLD: KV copy time against its bytes, and RLD's copy -> the client's first token,
    over requests whose prefill ran alone (a full RLD would add its admission wait)."""
    rows = [
        r
        for r in fitted(isolated_prefills(records))
        if "rld_kv_complete" in r["events"]
        and "prefill_end" in r["events"]
        and r["events"]["rld_kv_complete"] >= r["events"]["prefill_end"]
    ]
    if len(rows) < 4:
        raise RuntimeError("too few requests went through RLD in the fit run to fit P -> RLD")
    xs = [r["prompt"] * kvpt for r in rows]
    ys = [r["events"]["rld_kv_complete"] - r["events"]["prefill_end"] for r in rows]
    # median per half of the byte range: robust to the seconds-long waits of a full RLD
    order = sorted(range(len(xs)), key=xs.__getitem__)
    lo, hi = order[: len(order) // 2], order[len(order) // 2 :]
    x1, y1 = statistics.median(xs[i] for i in lo), statistics.median(ys[i] for i in lo)
    x2, y2 = statistics.median(xs[i] for i in hi), statistics.median(ys[i] for i in hi)
    per_byte = max((y2 - y1) / (x2 - x1), 1e-12) if x2 > x1 else 1e-12
    lat = max(0.0, y1 - per_byte * x1)
    emit = [
        r["tokens"][0] - r["events"]["rld_kv_complete"]
        for r in rows
        if r["tokens"][0] >= r["events"]["rld_kv_complete"]
    ]
    return {
        "bytes_per_s": 1.0 / per_byte,
        "latency_s": lat,
        "to_client_s": statistics.median(emit) if emit else 0.0,
        "samples": len(rows),
    }


def fit_export_wait(records: list[dict[str, Any]]) -> dict[str, Any]:
    """How often a finished prompt's KV copy waits for P's next step (PrefillInstance's
    ``export_wait``): over fit-tagged prompts that went to RLD and after whose step P began
    another one at once (a prompt of it admitted within AT_ONCE_S of the end: it was
    waiting), the share whose copy reached RLD only past the middle of that next step (in
    practice at its end). Requests of either tag make the steps."""
    import bisect

    steps: dict[float, tuple[float, float]] = {}  # step end -> (first admission, end)
    for r in records:
        e = r["events"]
        if "prefill_start" in e and "prefill_end" in e:
            end = round(e["prefill_end"], 3)
            s0 = steps.get(end, (math.inf, e["prefill_end"]))[0]
            steps[end] = (min(s0, e["prefill_start"]), e["prefill_end"])
    order = sorted(steps.values())
    starts = [a for a, _ in order]
    at_once = waited = 0
    for r in fitted(records):
        e = r["events"]
        if "rld_kv_complete" not in e or "prefill_end" not in e:
            continue
        end = e["prefill_end"]
        k = bisect.bisect_left(starts, end - 1e-3)
        nxt = next(((a, b) for a, b in order[k : k + 8] if b > end + 1e-3), None)
        if nxt is None or nxt[0] > end + AT_ONCE_S:
            continue
        at_once += 1
        waited += e["rld_kv_complete"] > end + (nxt[1] - end) / 2
    return {"share": waited / at_once if at_once else 0.0, "at_once": at_once, "waited": waited}


def prefill_intervals(records: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Union of P's prefill intervals (daemon timelines), sorted."""
    iv = sorted(
        (r["events"]["prefill_start"], r["events"]["prefill_end"])
        for r in records
        if "prefill_start" in r["events"] and "prefill_end" in r["events"]
    )
    out: list[tuple[float, float]] = []
    for s, e in iv:
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def decode_gaps(records: list[dict[str, Any]]) -> dict[str, list[Gap]]:
    """(batch, context tokens, gap, P busy, midpoint) for every inter-token gap RLD or MD produced for a
    fit-tagged request. A request (of either tag: they share the batch) is in a role's batch
    from its first to its last token from that role (client times); the handoff gap (RLD's
    last token -> MD's first) is an extend plus the line, not a step. "P busy": P was
    prefilling at the gap's midpoint (it competes for the same two cores)."""
    import bisect

    busy = prefill_intervals(records)
    starts = [s for s, _ in busy]

    def p_busy(t: float) -> bool:
        k = bisect.bisect_right(starts, t) - 1
        return k >= 0 and t <= busy[k][1]

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
    out: dict[str, list[Gap]] = {"relay": [], "main_decode": []}
    for k, r in enumerate(records):
        if r.get("tag", "fit") != "fit":
            continue
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
                    ctx += o["prompt"] + bisect.bisect_right(o["tokens"], mid)
            out[role].append((max(batch, 1), ctx, t[i] - t[i - 1], p_busy(mid), mid))
    return out


def fit_decode(rows: list[Gap], p_idle_only: bool = False) -> dict[str, Any]:
    """Mean step time t = a + b x batch + c x context (least squares, stalls left out); with
    `p_idle_only`, from the gaps while P was not prefilling (the step without P's share of the
    cores: the contention term adds that back)."""
    if len(rows) < 30:
        raise RuntimeError(f"only {len(rows)} decode gaps for a role in the fit run")
    cut = sorted(x[2] for x in rows)[int(STALL_QUANTILE * (len(rows) - 1))]
    kept = [x for x in rows if x[2] <= cut and not (p_idle_only and x[3])]
    if len(kept) < 30:
        raise RuntimeError(f"only {len(kept)} decode gaps with P idle for a role in the fit run")
    rows = [x for x in rows if not (p_idle_only and x[3])]
    ones = [1.0] * len(kept)
    b_col = [float(x[0]) for x in kept]
    c_col = [float(x[1]) for x in kept]
    ys = [x[2] for x in kept]
    a, b, c = lstsq([ones, b_col, c_col], ys)
    if c < 0:  # context does not show: per-sequence only
        c = 0.0
        a, b = lstsq([ones, b_col], ys)
    if b < 0:
        b = 0.0
        a, c = lstsq([ones, c_col], ys)
        c = max(c, 0.0)
    by_batch: dict[int, list[float]] = {}
    ctx_of: dict[int, list[int]] = {}
    for bb, cc, g, *_ in rows:
        by_batch.setdefault(bb, []).append(g)
        ctx_of.setdefault(bb, []).append(cc)
    return {
        "a_s": a,
        "b_s_per_seq": b,
        "c_s_per_ctx": c,
        "gaps": len(rows),
        "stall_cut_s": cut,
        "p_idle_only": p_idle_only,
        "by_batch": {
            str(k): {
                "n": len(v),
                "median_s": statistics.median(v),
                "mean_s": statistics.fmean(v),
                "mean_context": statistics.fmean(ctx_of[k]),
            }
            for k, v in sorted(by_batch.items())
        },
    }


def decode_chip_terms(fit: dict[str, Any], weight_bytes: float, kvpt: int) -> dict[str, float]:
    """Map t = a + b n + c C onto overhead + bytes / bw + per_seq n + per_ctx (C + n), bytes =
    weights + (C + n) x kvpt: the bandwidth is the largest that keeps overhead and per-context
    term >= 0, so the roofline carries as much of the line as it can."""
    a, b, c = max(fit["a_s"], 1e-4), fit["b_s_per_seq"], fit["c_s_per_ctx"]
    bw = max(weight_bytes / a, kvpt / c if c > 0 else 0.0)
    overhead = a - weight_bytes / bw
    per_ctx = max(0.0, c - kvpt / bw)
    per_seq = max(0.0, b - kvpt / bw - per_ctx)
    return {
        "memory_bw_gbs": bw / 1e9,
        "step_overhead_ms": overhead * 1e3,
        "step_per_seq_us": per_seq * 1e6,
        "step_per_ctx_token_ns": per_ctx * 1e9,
    }


def fit_all(
    records: list[dict[str, Any]],
    model: str,
    contention: str = "load",
    load_samples: list[tuple[float, float]] | None = None,
    p_fit: str = "total",
) -> dict[str, Any]:
    """Every fitted term, from the fit-tagged requests (see the module docstring). With
    `contention`, the shared host is explicit: P's rate alone plus its slowdown per decoding
    neighbour, the decode steps with P idle plus their slowdown while P prefills (the
    ``host_weights`` of pddnet.device.cost.SharedHost); "load" adds, for every role, a
    slowdown per unit of the recorded load average above its floor (`load_excess`); "off":
    every profile is the average over the run, contention folded in."""
    if contention not in ("off", "neighbours", "load"):
        raise ValueError(f"contention must be off, neighbours or load, got {contention!r}")
    from pddnet.device.profiles import load_model

    prof = load_model(model)
    recs = ok_records(records)
    iso = fit_prefill(recs, prof)
    floor, load = load_excess(load_samples or []) if contention == "load" else (None, None)
    if p_fit not in P_FITS:
        raise ValueError(f"p_fit must be one of {', '.join(P_FITS)}, got {p_fit!r}")
    steps = fit_prefill_steps(
        recs,
        prof,
        contention != "off",
        load,
        relative=p_fit.startswith("relative"),
        match_total=p_fit.endswith("total"),
    )
    pre = dict(
        iso,
        flops_per_s=steps["flops_per_s"],
        overhead_s=steps["overhead_s"],
        isolated_flops_per_s=iso["flops_per_s"],
        isolated_overhead_s=iso["overhead_s"],
        steps=steps,
    )
    path = fit_relay_path(recs, prof.kv_bytes_per_token)
    export = fit_export_wait(recs)
    gaps = decode_gaps(recs)
    dec = {role: fit_decode(rows, p_idle_only=contention != "off") for role, rows in gaps.items()}
    weights = {"p_per_decoder": steps["p_per_decoder"], "p_per_load": steps["p_per_load"]}
    for role, rows in gaps.items():
        if contention != "off":
            weights.update(decode_contention(dec[role], rows, role, load))
        dec[role]["contention"] = contention_split(dec[role], rows)
        if contention == "off":
            dec[role]["jitter_cv"] = dec[role]["contention"]["all"]["cv"] or 0.0
    terms = {
        role: decode_chip_terms(f, prof.weight_bytes, prof.kv_bytes_per_token)
        for role, f in dec.items()
    }
    return {
        "prefill": pre,
        "relay_path": path,
        "export_wait": export,
        "decode": dec,
        "decode_terms": terms,
        "host_weights": weights if contention != "off" else None,
        "load_floor": floor,
        "p_busy_fraction": busy_fraction(recs),
        "completed": len(fitted(recs)),
        "requests": len(fitted(records)),
    }


def decode_contention(
    fit: dict[str, Any], rows: list[Gap], role: str, load: Any
) -> dict[str, float]:
    """The decode step's share of the host, from the gaps (stalls left out) over the P-idle
    fit `fit`: ratio = k0 + delta x [P prefilling] (+ lambda x outside load with `load`), least
    squares; the step becomes k0 x fit x (1 + delta / k0 x P + lambda / k0 x load), so `fit`'s
    terms are scaled by k0 here, and its ``jitter_cv`` is the ratios' spread around that."""
    kept = [x for x in rows if x[2] <= fit["stall_cut_s"]]
    ratio = [
        g / (fit["a_s"] + fit["b_s_per_seq"] * b + fit["c_s_per_ctx"] * c) for b, c, g, *_ in kept
    ]
    cols = [[1.0] * len(kept), [float(x[3]) for x in kept]]
    if load is not None:
        cols.append([load(x[4]) for x in kept])
    coef = lstsq(cols, ratio)
    if load is not None and coef[2] < 0:  # no speed-up from outside work: drop it
        cols, coef = cols[:2], lstsq(cols[:2], ratio)
    k0, delta = coef[0], max(0.0, coef[1])
    lam = max(0.0, coef[2]) if len(coef) > 2 else 0.0
    if k0 <= 0:
        raise RuntimeError(f"{role}: the decode contention fit has a non-positive base")
    for k in ("a_s", "b_s_per_seq", "c_s_per_ctx"):
        fit[k] *= k0
    pred = [1 + delta / k0 * x[3] + (lam / k0 * load(x[4]) if lam else 0.0) for x in kept]
    rel = [r / k0 / p for r, p in zip(ratio, pred, strict=True)]
    fit["jitter_cv"] = statistics.pstdev(rel) / statistics.fmean(rel)
    fit["base_scale"] = k0
    return {f"{role}_while_p": delta / k0, f"{role}_per_load": lam / k0}


def contention_split(fit: dict[str, Any], rows: list[Gap]) -> dict[str, Any]:
    """Decode gaps over the fitted mean step, split by whether P was prefilling: how much of
    the step-time spread is the daemons competing for the cores (stalls left out)."""
    out: dict[str, Any] = {}
    for name, flags in (("p_busy", (True,)), ("p_idle", (False,)), ("all", (True, False))):
        r = [
            g / (fit["a_s"] + fit["b_s_per_seq"] * b + fit["c_s_per_ctx"] * c)
            for b, c, g, f, _ in rows
            if f in flags and g <= fit["stall_cut_s"]
        ]
        out[name] = {
            "gaps": len(r),
            "mean_ratio": statistics.fmean(r) if r else None,
            "median_ratio": statistics.median(r) if r else None,
            "cv": (statistics.pstdev(r) / statistics.fmean(r)) if len(r) > 1 else None,
        }
    return out


def chip_toml(
    name: str, fit: dict[str, Any], memory_gb: float, role: str, jitter: bool = True
) -> str:
    """One role's fitted profile: compute from P's prefills, the RDMA path from P -> RLD,
    decode terms from that role's own steps (P's memory bandwidth: MD's, it barely matters);
    with `jitter`, the decode roles' step spread: the coefficient of variation of the fit-run
    gaps around the fitted mean (stalls left out) -- the cores shared with P, the other roles
    and outside jobs make a step's time vary that much."""
    tf = fit["prefill"]["flops_per_s"] / 1e12
    gbit = fit["relay_path"]["bytes_per_s"] * 8 / 1e9
    if role == "prefill":
        terms = dict(
            fit["decode_terms"]["main_decode"],
            step_per_seq_us=0.0,
            step_per_ctx_token_ns=0.0,
            step_overhead_ms=fit["prefill"]["overhead_s"] * 1e3,
        )
        cv = 0.0
    else:
        terms = fit["decode_terms"][role]
        cv = fit["decode"][role]["jitter_cv"] if jitter else 0.0
    how = "contention: see host_weights" if fit.get("host_weights") else "contention included"
    return (
        f"# fitted by pdd sim calibrate to the testbed ({role}), {how}\n"
        f'name = "{name}"\nmemory_gb = {memory_gb:.6f}\n'
        f"memory_bw_gbs = {terms['memory_bw_gbs']:.6f}\nscale_up_gbs = 10\n"
        f"scale_out_gbit = {gbit:.6f}\nprice_per_hour = 0.05\ncompute_efficiency = 1.0\n"
        f"bandwidth_efficiency = 1.0\nstep_overhead_ms = {terms['step_overhead_ms']:.6f}\n"
        f"step_per_seq_us = {terms['step_per_seq_us']:.3f}\n"
        f"step_per_ctx_token_ns = {terms['step_per_ctx_token_ns']:.3f}\n"
        f"step_jitter_cv = {cv:.4f}\n"
        f"[tflops]\nfp32 = {tf:.9f}\nbf16 = {tf:.9f}\nfp8 = {tf:.9f}\n"
    )
