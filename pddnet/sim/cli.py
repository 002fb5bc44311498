"""`pdd sim run | plan | reproduce | calibrate`: the simulator's commands (docs/simulator.md).

Registration imports nothing heavy; handlers import the simulator when they run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sim",
        help="simulate PDD at datacenter scale (chips, cost, BCR)",
        description=__doc__.splitlines()[0],
    )
    ss = p.add_subparsers(dest="sim_command", required=True, metavar="SIM_COMMAND")

    run = ss.add_parser("run", help="simulate the systems of a config; JSON + PNG plots")
    run.add_argument("--config", required=True, help="simulation config (TOML or JSON)")
    run.add_argument(
        "--seed", type=int, default=None, help="override the config's seed (default: the config's)"
    )
    run.add_argument(
        "--requests",
        type=int,
        default=None,
        help="override workload.requests (default: the config's)",
    )
    _add_run_options(run, cmd_run)

    pl = ss.add_parser("plan", help="search pool sizes for the best benefit-cost ratio")
    pl.add_argument("--config", required=True, help="simulation config (TOML or JSON)")
    pl.add_argument("--system", default="pdd", help="pdd (P,RLD,MD), same-dc (P,D), ...")
    pl.add_argument("--prefill", default="1-4", help="P pool sizes: N, A-B or A,B,C")
    pl.add_argument("--relay", default="1", help="RLD pool sizes (PDD systems)")
    pl.add_argument("--decode", default="1-4", help="MD (or D) pool sizes")
    pl.add_argument(
        "--baseline",
        action="store_true",
        help="also plan same-dc on the same grid of P and D sizes; print BCR ratio",
    )
    _add_run_options(pl, cmd_plan)

    rp = ss.add_parser("reproduce", help="the source report's scenario, ours beside theirs")
    rp.add_argument("--quick", action="store_true", help="small scale (seconds, as in tests)")
    rp.add_argument("--seed", type=int, default=0, help="workload seed")
    _add_run_options(rp, cmd_reproduce)

    cal = ss.add_parser(
        "calibrate",
        help="fit the simulator to the real testbed and compare TTFT / ITL (heavy)",
        description="Calibrate the simulator against the real testbed: same workload, TTFT "
        "and ITL side by side (see docs/simulator.md and pddnet/sim/calibrate.py). Heavy: "
        "~(requests / rate) s of both cores plus ~1 min; run it wrapped in `timeout -s INT`.",
    )
    _calibrate_args(cal)
    cal.set_defaults(handler=cmd_calibrate)


def _calibrate_args(parser: argparse.ArgumentParser) -> None:
    from pddnet.sim.calibrate_fit import P_FITS  # light: the fits import numpy when they run

    parser.add_argument("--model", default="small")
    parser.add_argument("--requests", type=int, default=240, help="compare-tagged requests")
    parser.add_argument("--fit-requests", type=int, default=120, help="fit-tagged requests")
    parser.add_argument(
        "--rate",
        default="auto",
        help="requests/s of both runs, or 'auto' (--target-util of P's probe time)",
    )
    parser.add_argument("--target-util", type=float, default=0.5)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(256, 768))
    parser.add_argument("--fit-prompt-len", type=int, nargs=2, default=(128, 1024))
    parser.add_argument("--max-tokens", type=int, nargs=2, default=(16, 48))
    parser.add_argument("--rtt-ms", type=float, default=30.0)
    parser.add_argument("--jitter-ms", type=float, default=2.0)
    parser.add_argument("--bw-mbit", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0, help="compare run (fit run: seed + 1000)")
    parser.add_argument("--out", default="results/sim")
    parser.add_argument(
        "--window-s",
        type=float,
        default=900.0,
        help="cap on the arrival window: request counts shrink to fit it",
    )
    parser.add_argument(
        "--step-jitter",
        choices=("fit", "off"),
        default="fit",
        help="decode-step spread in the fitted profiles (step_jitter_cv): the fit "
        "run's measured spread, or none",
    )
    parser.add_argument(
        "--contention",
        choices=("load", "neighbours", "off"),
        default="load",
        help="the shared host's contention, explicit terms fitted from the fit "
        "run: 'neighbours' (P slower per decoding neighbour, decode slower "
        "while P prefills), 'load' (also slower per unit of the recorded load "
        "average above its floor: outside jobs), or 'off' (every profile "
        "averaged over the run)",
    )
    parser.add_argument(
        "--p-fit",
        choices=P_FITS,
        default="total",
        help="P's busy-period line: least squares on the lengths ('lstsq') or on "
        "relative errors ('relative'); '-total'/'total': then scaled so the "
        "fit periods' predicted total is their measured total (P's "
        "utilisation, which its queue answers to)",
    )
    parser.add_argument(
        "--export-wait",
        choices=("fit", "off"),
        default="fit",
        help="a finished prompt's KV copy waiting for P's next step when that one "
        "starts at once (PrefillInstance export_wait): the fit run's share, "
        "or never",
    )
    parser.add_argument(
        "--sim-draws",
        type=int,
        default=0,
        help="also simulate N more draws of the random streams (step jitter, "
        "export waits) and print the errors' range",
    )
    parser.add_argument(
        "--reuse",
        action="store_true",
        help="re-fit and re-simulate OUT/calibration_runs.json (no testbed)",
    )


def _add_run_options(parser: argparse.ArgumentParser, handler: Callable[..., int]) -> None:
    """What every simulation command ends with: where it writes, whether it plots, how it
    runs (processes, compiled), and its handler."""
    parser.add_argument("--out", default="results/sim", help="output folder")
    parser.add_argument("--no-plots", action="store_true", help="write the JSON only")
    parser.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="processes for independent simulations (default: one per core; "
        "1 runs everything in this process; results are the same)",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="run the simulator compiled with mypyc (~1.8x faster, the same "
        "results; built once per source version, needs a C compiler)",
    )
    parser.set_defaults(handler=handler)


def _enter_mode(args: argparse.Namespace, command: str) -> int | None:
    """Say how the simulator runs; with --compiled, re-execute this command on the compiled
    copy (pddnet/sim/compiled.py). Returns an exit code when the command must stop."""
    import os

    from pddnet.sim import compiled

    if args.compiled and not os.environ.get(compiled.TREE_ENV):
        try:
            compiled.reexec(args.argv, log=lambda s: print(s, file=sys.stderr, flush=True))
        except compiled.CompileError as exc:
            print(f"pdd sim {command}: {exc}", file=sys.stderr)
            return 2
    if args.compiled and not compiled.compiled_modules():
        print(
            f"pdd sim {command}: --compiled, but this process imports the pure-Python "
            f"package (from {compiled.source_root()})",
            file=sys.stderr,
        )
        return 2
    print(compiled.describe(), file=sys.stderr, flush=True)
    return None


def _jobs(args: argparse.Namespace) -> int:
    """--jobs, or one per core; raises ValueError for a bad value."""
    import os

    if args.jobs is None:
        return os.cpu_count() or 1
    if args.jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {args.jobs}")
    return args.jobs


def _write(out: str, name: str, data: dict[str, Any]) -> Path:
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(dumps(data))
    return path


def dumps(data: dict[str, Any]) -> str:
    """The canonical JSON of a result (what byte-identical means)."""
    return json.dumps(data, indent=1, sort_keys=True) + "\n"


def _bar(total: int, desc: str, position: int = 0) -> Any:
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(
        total=total,
        desc=desc,
        unit="req",
        leave=False,
        file=sys.stderr,
        position=position,
        disable=not sys.stderr.isatty(),
    )


def _load(args: argparse.Namespace) -> Any:
    import dataclasses

    from pddnet.sim.config import load_config

    cfg = load_config(args.config)
    if getattr(args, "seed", None) is not None:
        cfg = dataclasses.replace(cfg, seed=args.seed)
    if getattr(args, "requests", None) is not None:
        cfg = dataclasses.replace(
            cfg, workload=dataclasses.replace(cfg.workload, requests=args.requests)
        )
    return cfg


def cmd_run(args: argparse.Namespace) -> int:
    if (stop := _enter_mode(args, "run")) is not None:
        return stop
    from pddnet.sim.runner import compare, describe_config, run_systems

    try:
        cfg = _load(args)
        jobs = _jobs(args)
    except ValueError as exc:
        print(f"pdd sim run: {exc}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    # one bar per system, all drawn at once: with --jobs several advance together
    bars = {s: _bar(cfg.workload.requests, f"{s:>15}", i) for i, s in enumerate(cfg.systems)}

    def progress(system: str, n: int) -> None:
        if bars[system] is not None:
            bars[system].update(n)

    try:
        results = run_systems(cfg, cfg.systems, progress, jobs=jobs)
    except ValueError as exc:
        print(f"pdd sim run: {exc}", file=sys.stderr)
        return 2
    for b in bars.values():
        if b is not None:
            b.close()
    data = {"config": describe_config(cfg), "systems": results, "vs_baseline": compare(results)}
    path = _write(args.out, Path(args.config).stem, data)
    print_run(data)
    print(f"wrote {path} ({time.monotonic() - t0:.1f} s of wall time, {jobs} process(es))")
    if not args.no_plots:
        from pddnet.sim.plots import plot_run

        for p in plot_run(data, path):
            print(f"wrote {p}")
    return 0


def print_run(data: dict[str, Any]) -> None:
    print(
        f"{'system':>16} {'TTFT p50':>9} {'p90':>8} {'p99':>8} {'TPOT p50':>9} "
        f"{'goodput':>8} {'RLD share':>9} {'WAN GB':>9} {'$/h':>8} {'BCR x':>6}"
    )
    for name, r in data["systems"].items():
        t = r["ttft_s"]
        wan = r.get("wan", {}).get("kv_bytes", 0) / 1e9
        bcr = data["vs_baseline"].get(name, {}).get("bcr_x")
        print(
            f"{name:>16} {t['p50'] or 0:9.3f} {t['p90'] or 0:8.3f} {t['p99'] or 0:8.3f} "
            f"{r['tpot_s']['p50'] or 0:9.4f} {r['goodput_rps']:8.3f} "
            f"{r['token_share']['rld']:9.1%} {wan:9.1f} {r['cost_per_hour']:8.1f} "
            f"{'-' if bcr is None else f'{bcr:6.3f}'}"
        )


def cmd_plan(args: argparse.Namespace) -> int:
    if (stop := _enter_mode(args, "plan")) is not None:
        return stop
    from pddnet.sim.parallel import Task, run_tasks
    from pddnet.sim.plan import parse_range, plan

    try:
        cfg = _load(args)
        p, r, d = parse_range(args.prefill), parse_range(args.relay), parse_range(args.decode)
        jobs = _jobs(args)
    except ValueError as exc:
        print(f"pdd sim plan: {exc}", file=sys.stderr)
        return 2
    targets = [args.system] + (["same-dc"] if args.baseline and args.system != "same-dc" else [])
    tasks = [
        Task(plan, (cfg, s, [p, d] if s == "same-dc" else [p, r, d]), progress_kw="progress")
        for s in targets
    ]
    try:
        # with --baseline the two systems' searches run side by side
        plans = dict(zip(targets, run_tasks(tasks, jobs, lambda i, line: print(line)), strict=True))
    except ValueError as exc:
        print(f"pdd sim plan: {exc}", file=sys.stderr)
        return 2
    for system, pl in plans.items():
        print(f"\n{system}: frontier (cost -> goodput under SLA)")
        for c in pl["frontier"]:
            print(
                f"  sizes {c['sizes']}  gpus {c['gpus']}  {c['cost_per_hour']:.1f} $/h  "
                f"{c['goodput_rps']:.3f} req/s  BCR {c['bcr']:.5f}"
            )
        b = pl["best"]
        print(f"  best BCR: sizes {b['sizes']} ({b['bcr']:.5f})")
    if len(plans) == 2:
        a, b = plans[args.system]["best"], plans["same-dc"]["best"]
        if b["bcr"]:
            print(f"\nBCR {args.system} / same-dc: {a['bcr'] / b['bcr']:.3f}x")
    path = _write(args.out, f"plan-{Path(args.config).stem}", {"plans": plans})
    print(f"wrote {path}")
    if not args.no_plots:
        from pddnet.sim.plots import plot_frontier

        print(f"wrote {plot_frontier(plans, path.with_suffix('.png'))}")
    return 0


class TqdmProgress:
    """reproduce()'s progress as one tqdm bar per stage (to stderr; throttled when stderr is
    not a terminal, so a log file gets a few lines, not thousands)."""

    def __init__(self) -> None:
        self.bar: Any = None
        self.t0 = time.monotonic()

    def stage(self, name: str, total: int, unit: str) -> None:
        self.close()
        try:
            from tqdm import tqdm
        except ImportError:  # pragma: no cover
            print(f"{name}: {total} {unit}(s)", file=sys.stderr)
            return
        tty = sys.stderr.isatty()
        self.bar = tqdm(
            total=total,
            desc=f"{name:>14}",
            unit=unit,
            file=sys.stderr,
            mininterval=0.5 if tty else 30.0,
            dynamic_ncols=tty,
        )

    def advance(self, n: int = 1, note: str | None = None) -> None:
        if self.bar is None:
            if note:
                print(note, file=sys.stderr)
            return
        if note and n == 1 and self.bar.unit == "candidate":
            self.bar.write(f"  {note}", file=sys.stderr)
        elif note:
            self.bar.set_postfix_str(note, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def cmd_reproduce(args: argparse.Namespace) -> int:
    if (stop := _enter_mode(args, "reproduce")) is not None:
        return stop
    from pddnet.sim.reproduce import print_report, reproduce

    t0 = time.monotonic()
    try:
        jobs = _jobs(args)
    except ValueError as exc:
        print(f"pdd sim reproduce: {exc}", file=sys.stderr)
        return 2
    bars = TqdmProgress()
    try:
        data = reproduce(quick=args.quick, seed=args.seed, progress=bars, jobs=jobs)
    finally:
        bars.close()
    print_report(data)
    path = _write(args.out, "reproduce-quick" if args.quick else "reproduce", data)
    print(f"wrote {path} ({time.monotonic() - t0:.1f} s of wall time, {jobs} process(es))")
    if not args.no_plots:
        from pddnet.sim.plots import plot_frontier, plot_run

        for p in plot_run(data, path):
            print(f"wrote {p}")
        plans = data["ours"]["cost_table"]["plans"]
        print(f"wrote {plot_frontier(plans, path.with_name(path.stem + '-frontier.png'))}")
    return 0 if all(data["checks"].values()) else 1


def cmd_calibrate(args: argparse.Namespace) -> int:
    if not 0 < args.target_util < 1:
        print("pdd sim calibrate: --target-util must be in (0, 1)", file=sys.stderr)
        return 2
    if args.sim_draws < 0:
        print("pdd sim calibrate: --sim-draws must be >= 0", file=sys.stderr)
        return 2
    from pddnet.sim.calibrate import calibrate

    # only the calibration's own options (not pdd's handler and argv): they are saved with the
    # testbed run, and --reuse reads them back
    own = argparse.ArgumentParser(add_help=False)
    _calibrate_args(own)
    return calibrate(argparse.Namespace(**{a.dest: getattr(args, a.dest) for a in own._actions}))
