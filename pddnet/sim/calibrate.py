"""Calibrate the simulator against the real testbed: same workload, TTFT and ITL side by side.

The box is shared (other engineers' CPU-heavy jobs come and go), so fit and comparison must see
the same outside load: ONE cluster (LocalCluster, mode pdd, proxy WAN, 1 torch thread per
daemon) runs, after a warm-up,
1. the probe: PROBE_REQUESTS prompts one at a time; with ``--rate auto`` their prefill times
   set the rate to ``--target-util`` of P (default 0.5) over the mix of prompt lengths.
   Calibrate at moderate load: near P's saturation the queueing tail magnifies any
   service-time error, so agreement there says little about the model;
2. one Poisson arrival stream merging two seeded workloads, each request tagged: "fit"
   (seed + 1000, wider prompt range) and "compare" (``--seed``). The counts shrink together
   if their window would exceed ``--window-s``. The load average is printed at the start and
   end of every phase and sampled every 10 s during the stream.
Then, from the fit-tagged requests only (the compare-tagged ones count only as the batch and
the P load they share): the chip profiles and the shared host's contention --
   - P: its busy periods that computed a fit-tagged prompt (the engine steps back to back in
     one), length = steps x overhead + FLOPs / rate x (1 + gamma x decoders stepping +
     lambda x load), where "decoders stepping" is how many of RLD and MD were decoding (0..2,
     averaged over the period) and "load" the recorded 1-min load average above its floor
     (outside jobs on the two cores); ``--contention neighbours`` drops lambda, ``off`` both
     (the rate then averages the slowdown in); with ``--p-fit total`` (default) the rate is
     then scaled so the periods' predicted total is their measured one (P's utilisation);
   - P's export wait: the share of prompts whose KV copy waited for P's next step when that
     one was admitted at once (PrefillInstance ``export_wait``; ``--export-wait off``: none);
   - the P -> RLD path: t = latency + KV bytes / bandwidth, plus the fixed daemon latencies
     before P (router, KV_ALLOC: the simulator's [engine] host_latency_us) and after RLD's
     copy lands (first token to the client);
   - RLD and MD, each its own profile: every inter-token gap a role produced, against the
     batch it ran in and their context, t = a + b x batch + c x context tokens (least
     squares, the slowest 1% of gaps left out as stalls), mapped onto the roofline plus the
     per-sequence and per-context terms of pddnet/device/cost.py; the gaps' spread around that
     mean (split by whether P was prefilling, which is most of it) becomes the profile's
     ``step_jitter_cv`` unless ``--step-jitter off``. With contention the line is fitted to
     the gaps while P was idle and scaled by k0, then gap / line = k0 + delta x [P
     prefilling] + lambda x load: the step's slowdown while P prefills and per unit of load.
The whole stream (both tags, their real token ids as units, tokens_per_unit = 1) is replayed
in the simulator with those profiles, the testbed's pool sizes, policy settings and WAN (the
proxy's link model), P scheduling as the engine does (waiting prompts batched into a step up to
max_num_batched_tokens, admitted only between steps: PrefillInstance's max_seqs) and the
fitted contention as a pddnet.device.cost.SharedHost of P, RLD, MD and the recorded load; TTFT and ITL of the compare-tagged requests are set side by side (goal:
medians within 15%, P90 within 25%). Writes results/sim/calibration.json, calibration.png
(CDFs, decode fit) and calibration_runs.json (the raw testbed records; ``--reuse`` re-fits and
re-simulates them without the testbed).

Heavy: ~(requests / rate) seconds of both cores plus ~1 min. Run it wrapped in `timeout -s INT`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from pddnet.sim.calibrate_fit import busy_fraction, chip_toml, fit_all, ok_records
from pddnet.sim.calibrate_replay import simulate_same
from pddnet.sim.calibrate_report import fmt_err, fmt_ratio, plot, quantiles
from pddnet.sim.calibrate_testbed import interleaved_workload, phase_load, run_testbed

ROLES = ("prefill", "relay", "main_decode")


def calibrate(args: argparse.Namespace) -> int:
    """Run the testbed (or, with ``reuse``, read its saved run), then fit, replay and compare.
    ``args`` holds the options of `pdd sim calibrate` (pddnet/sim/cli.py) and nothing else:
    they are saved with the run, and ``--reuse`` reads them back."""
    from pddnet.device.profiles import load_model

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs_path = out / "calibration_runs.json"
    prof = load_model(args.model)
    if args.reuse:
        if not runs_path.exists():
            raise SystemExit(
                f"--reuse: no saved testbed run at {runs_path}: run without "
                f"--reuse first, or pass the --out folder that holds one"
            )
        runs = json.loads(runs_path.read_text())
        if "records" not in runs.get("run", {}):
            raise SystemExit(
                f"{runs_path} is not an interleaved run (older format): run without --reuse"
            )
    else:
        runs = {"args": vars(args)}
        runs["run"] = asyncio.run(run_testbed(args, prof, args.seed + 1000))
        runs["rate"] = runs["run"]["rate"]
        runs_path.write_text(json.dumps(runs))
    return analyse(runs, args, out, runs_path)


def analyse(runs: dict[str, Any], args: argparse.Namespace, out: Path, runs_path: Path) -> int:
    """Fit on the fit-tagged requests, simulate the whole interleaved stream, compare the
    compare-tagged requests."""
    from types import SimpleNamespace

    from pddnet.config import load_config as load_cluster
    from pddnet.device.profiles import load_model

    run_args = argparse.Namespace(**runs["args"])
    prof = load_model(run_args.model)
    rate, run = runs["rate"], runs["run"]
    all_records = run["records"]
    n_tag = {t: sum(1 for r in all_records if r["tag"] == t) for t in ("fit", "compare")}
    workload = interleaved_workload(
        run_args, rate, n_tag["fit"], n_tag["compare"], run_args.seed + 1000
    )
    for (tag, req), r in zip(workload, all_records, strict=True):  # the same stream?
        if (
            tag != r["tag"]
            or abs(req.arrival_s - r["arrival_s"]) > 1e-6
            or len(req.prompt_token_ids) != r["prompt"]
        ):
            raise RuntimeError(
                f"{runs_path}: request {r['i']} does not match the regenerated "
                f"workload (other seeds or arguments?)"
            )
    phase_load("fit + simulation", "start")
    fit = fit_all(all_records, run_args.model, args.contention, run.get("load_samples"), args.p_fit)
    pf, rp = fit["prefill"], fit["relay_path"]
    ps, hw = pf["steps"], fit["host_weights"]
    print(
        f"fitted from the {fit['completed']}/{fit['requests']} fit-tagged requests only "
        f"(compare-tagged: only as the batch and P work they shared; judged below), P busy "
        f"{fit['p_busy_fraction']:.0%}, contention {args.contention}:"
    )
    print(
        f"  P: {pf['flops_per_s'] / 1e9:.1f} GFLOP/s + {pf['overhead_s'] * 1e3:.1f} ms/step "
        f"from {ps['periods']} busy periods with a fit-tagged prompt ({ps['steps']} steps, "
        f"on average {ps['mean_decoders']:.2f} decoders stepping; period length error sd "
        f"{ps['rel_error_sd']:.0%}, --p-fit {args.p_fit}: predicted / measured total "
        f"{ps['total_pred_over_actual']:.3f}, median {ps['median_pred_over_actual']:.3f}); x(1 + {ps['p_per_decoder']:.2f} per decoding neighbour"
        f" + {ps['p_per_load']:.2f} per unit of load above {fit['load_floor'] or 0:.2f})"
        f"; alone (the {pf['isolated']} isolated prefills): "
        f"{pf['isolated_flops_per_s'] / 1e9:.1f} GFLOP/s"
    )
    ew = fit["export_wait"]
    export_wait = ew["share"] if args.export_wait == "fit" else 0.0
    print(
        f"  P's KV copy waits for the next step when it starts at once: {ew['waited']} of "
        f"the {ew['at_once']} fit-tagged prompts it could ({ew['share']:.0%}); simulated: "
        f"{export_wait:.0%} (--export-wait {args.export_wait})"
    )
    fixed_ms = (pf["to_engine_s"] + rp["to_client_s"]) * 1e3
    print(
        f"  P->RLD {rp['bytes_per_s'] / 1e9:.2f} GB/s + {rp['latency_s'] * 1e3:.1f} ms "
        f"({rp['samples']} isolated prefills), fixed {fixed_ms:.1f} ms"
    )
    for role in ("relay", "main_decode"):
        d = fit["decode"][role]
        c = d["contention"]
        share = (
            f" x(1 + {hw[role + '_while_p']:.2f} while P prefills + "
            f"{hw[role + '_per_load']:.2f} per unit of load)"
            if hw
            else ""
        )
        print(
            f"  {role}: step = {d['a_s'] * 1e3:.1f} ms + {d['b_s_per_seq'] * 1e3:.2f} ms/seq "
            f"+ {d['c_s_per_ctx'] * 1e6:.2f} us/context token{share}, jitter cv "
            f"{d['jitter_cv']:.2f} ({d['gaps']} gaps{', P idle' if d['p_idle_only'] else ''})"
            f"\n    gap / fitted step: P prefilling {fmt_ratio(c['p_busy'])}; P idle "
            f"{fmt_ratio(c['p_idle'])}; all {fmt_ratio(c['all'])}"
        )

    cl = load_cluster(None, {})
    chips_text: dict[str, str] = {}
    records = [r for r in ok_records(all_records) if r["tag"] == "compare"]
    real_ttft = [r["tokens"][0] - r["sent"] for r in records]
    real_itl = [b - a for r in records for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
    draws: list[dict[str, float | None]] = []

    def errors(h: dict[str, Any]) -> dict[str, float | None]:
        out_e: dict[str, float | None] = {}
        for name, real_v, hist in (("TTFT", real_ttft, h["ttft"]), ("ITL", real_itl, h["itl"])):
            q_real = quantiles(real_v)
            for q in (50, 90, 99):
                a, b = q_real[f"p{q}"], hist.quantile(q / 100)
                out_e[f"{name} p{q}"] = None if not a or b is None else (b - a) / a
        return out_e

    with tempfile.TemporaryDirectory() as tmp:
        for draw in range(args.sim_draws + 1):
            # draw 0 is the reported run; the others rename the chips, which reseeds their
            # random streams (step jitter, P's export waits): the spread one run hides
            suffix = f"-draw{draw}" if draw else ""
            chips: dict[str, Path] = {}
            for role in ROLES:
                blocks = getattr(cl, role).num_blocks * getattr(cl, role).block_size
                mem = (prof.weight_bytes + blocks * prof.kv_bytes_per_token) / 1e9
                text = chip_toml(
                    f"cpu-fitted-{role}{suffix}", fit, mem, role, jitter=args.step_jitter == "fit"
                )
                chips[role] = Path(tmp) / f"cpu-fitted-{role}{suffix}.toml"
                chips[role].write_text(text)
                if not draw:
                    chips_text[role] = text
            got = simulate_same(
                workload, chips, fit, run_args, Path(tmp), run.get("load_samples"), export_wait
            )
            if not draw:
                rep, sim, hists = got
            else:
                draws.append(errors(got[2]["compare"]))
    phase_load("fit + simulation", "end")
    sim_cmp = SimpleNamespace(ttft=hists["compare"]["ttft"], itl=hists["compare"]["itl"])

    def hsum(h: Any) -> dict[str, float | None]:
        return {
            "n": h.n,
            "mean": h.total / h.n if h.n else None,
            **{f"p{q}": h.quantile(q / 100) for q in (50, 90, 99)},
            "max": h.max,
        }

    sim_q = {"TTFT": hsum(sim_cmp.ttft), "ITL": hsum(sim_cmp.itl)}
    # in-sample first: the fit-tagged requests, simulated in the same run (what a modelling
    # choice may be judged on; the compare-tagged ones below are the test)
    fit_recs = [r for r in ok_records(all_records) if r["tag"] == "fit"]
    fit_real = {
        "TTFT": quantiles([r["tokens"][0] - r["sent"] for r in fit_recs]),
        "ITL": quantiles(
            [b - a for r in fit_recs for a, b in zip(r["tokens"], r["tokens"][1:], strict=False)]
        ),
    }
    fit_sim = {"TTFT": hsum(hists["fit"]["ttft"]), "ITL": hsum(hists["fit"]["itl"])}
    in_sample = []
    for name in ("TTFT", "ITL"):
        for q in ("p50", "p90", "p99"):
            a, b = fit_real[name][q], fit_sim[name][q]
            in_sample.append(
                {
                    "metric": name,
                    "q": q,
                    "testbed": a,
                    "sim": b,
                    "error": None if not a or b is None else (b - a) / a,
                }
            )
    print(
        "\nin-sample (fit-tagged requests), error: "
        + ", ".join(f"{r['metric']} {r['q']} {fmt_err(r['error'])}" for r in in_sample)
    )
    rows = []
    real = {"TTFT": quantiles(real_ttft), "ITL": quantiles(real_itl)}
    print(f"\ncompare-tagged requests ({len(records)} of {n_tag['compare']} completed)")
    print(f"{'metric':<10} {'testbed':>10} {'sim':>10} {'error':>8}   (seconds)")
    for name in ("TTFT", "ITL"):
        for q in ("p50", "p90", "p99"):
            a, b = real[name][q], sim_q[name][q]
            err = None if not a or b is None else (b - a) / a
            rows.append({"metric": name, "q": q, "testbed": a, "sim": b, "error": err})
            print(
                f"{name + ' ' + q:<10} {a or 0:10.4f} {b or 0:10.4f} "
                f"{'-' if err is None else f'{err:+7.1%}'}"
            )
    goal = {
        "medians within 15%": all(
            r["error"] is not None and abs(r["error"]) <= 0.15 for r in rows if r["q"] == "p50"
        ),
        "P90 within 25%": all(
            r["error"] is not None and abs(r["error"]) <= 0.25 for r in rows if r["q"] == "p90"
        ),
    }
    print("goal:", ", ".join(f"{k}: {'reached' if v else 'missed'}" for k, v in goal.items()))
    if draws:
        print(
            f"over {len(draws)} more draws of the random streams (--sim-draws), error "
            f"min..max: "
            + ", ".join(
                f"{k} {fmt_err(min(d[k] for d in draws))}..{fmt_err(max(d[k] for d in draws))}"
                for k in draws[0]
                if all(d[k] is not None for d in draws)
            )
        )
    pipes: dict[str, int] = {}
    modes: dict[str, int] = {}
    for r in records:
        pipes[str(r["pipeline"])] = pipes.get(str(r["pipeline"]), 0) + 1
        modes[str(r["handoff_mode"])] = modes.get(str(r["handoff_mode"]), 0) + 1
    rld_tok = sum(r["relay_tokens"] or 0 for r in records)
    all_tok = sum(len(r["tokens"]) for r in records)
    p_busy = busy_fraction(ok_records(all_records))
    print(
        f"testbed (compare-tagged): pipelines {pipes}, handoffs {modes}, RLD token share "
        f"{rld_tok / max(all_tok, 1):.1%}; P busy {p_busy:.0%} (whole stream)"
    )
    print(
        f"sim (whole stream): P busy {rep['busy']['prefill']:.0%}, pipelines "
        f"{rep['pipelines']}, handoffs {rep['handoffs']}, RLD token share "
        f"{rep['token_share']['rld']:.1%}"
    )
    samples = [x[1] for x in run.get("load_samples", [])]
    load = {
        "phases": run["phases"],
        "run_1min_samples": {
            "min": min(samples, default=None),
            "median": statistics.median(samples) if samples else None,
            "max": max(samples, default=None),
            "n": len(samples),
        },
    }
    print(f"load average during the run (1 min, every 10 s): {load['run_1min_samples']}")
    result = {
        "rate_per_s": rate,
        "target_util": run_args.target_util,
        "probe": run.get("probe"),
        "requests": n_tag,
        "fit": fit,
        "chip_profiles": chips_text,
        "rows": rows,
        "goal": goal,
        "in_sample_rows": in_sample,
        "draws": draws,
        "p_fit": args.p_fit,
        "testbed": {
            "completed": len(records),
            "requests": n_tag["compare"],
            "ttft_s": real["TTFT"],
            "itl_s": real["ITL"],
            "p_busy_fraction": p_busy,
            "pipelines": pipes,
            "handoffs": modes,
            "rld_token_share": rld_tok / max(all_tok, 1),
        },
        "sim": {
            "compare_ttft_s": sim_q["TTFT"],
            "compare_itl_s": sim_q["ITL"],
            "whole_stream": {
                k: rep[k]
                for k in (
                    "ttft_s",
                    "itl_s",
                    "pipelines",
                    "handoffs",
                    "token_share",
                    "busy",
                    "rld",
                    "wan",
                    "handoff_gap_s",
                    "unfinished",
                )
            },
        },
        "load_average": load,
        "load_samples": run.get("load_samples"),
        "args": runs["args"],
        "reused": args.reuse,
        "step_jitter": args.step_jitter,
        "export_wait": export_wait,
        "contention": args.contention,
    }
    path = out / "calibration.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    title = (
        f"{len(records)} compare-tagged of {sum(n_tag.values())} interleaved requests at "
        f"{rate:.2f}/s, {run_args.model}, {run_args.bw_mbit:g} Mbit/s {run_args.rtt_ms:g} "
        f"ms RTT; load avg {load['run_1min_samples']['min']:.1f}-"
        f"{load['run_1min_samples']['max']:.1f}; step jitter {args.step_jitter}; "
        f"export wait {export_wait:.0%}; "
        f"contention {args.contention}; goal "
        f"{'met' if all(goal.values()) else 'missed'}"
    )
    plot(out / "calibration.png", real_ttft, real_itl, sim_cmp, fit, title)
    print(f"wrote {path}, {out / 'calibration.png'}, {runs_path}")
    return 0
