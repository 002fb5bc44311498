"""`pdd bench NAME`, `pdd demo` and `pdd trace REQUEST_ID`.

Benchmarks are listed in `BENCHES`; adding one is one entry:

    BenchSpec("drc", "pddnet.bench.drc", "WAN KV bytes and TTFT with and without DRC"),

where the module defines `add_arguments(parser)` (including `--quick` and `--out`) and
`async run(args) -> dict` (which prints its table, writes results/<bench>/<timestamp>.json and
PNGs, and returns at least {"path": ...}). Modules are imported only when their benchmark
runs, so `pdd --help` stays fast whatever they import.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType


@dataclass(frozen=True)
class BenchSpec:
    name: str
    module: str  # dotted path of a module with add_arguments(p) and async run(args)
    help: str

    def load(self) -> ModuleType:
        mod = importlib.import_module(self.module)
        for attr in ("add_arguments", "run"):
            if not callable(getattr(mod, attr, None)):
                raise TypeError(f"benchmark module {self.module} has no {attr}()")
        return mod

    def parser(self) -> argparse.ArgumentParser:
        from pddnet.cli_format import DefaultsHelpFormatter

        mod = self.load()
        p = argparse.ArgumentParser(
            prog=f"pdd bench {self.name}",
            description=(mod.__doc__ or self.help).splitlines()[0],
            formatter_class=DefaultsHelpFormatter,
        )
        mod.add_arguments(p)
        return p


BENCHES: dict[str, BenchSpec] = {
    s.name: s
    for s in (
        BenchSpec(
            "ttft",
            "pddnet.bench.ttft",
            "same-dc vs cross-dc vs pdd: ttft, tpot, itl, e2el, request_goodput, RLD/MD "
            "token shares",
        ),
        BenchSpec(
            "reproduce",
            "pddnet.bench.reproduce",
            "the source's experiments on emulated H100/H200 daemons, the simulator beside",
        ),
        BenchSpec(
            "handoff-mode",
            "pddnet.bench.handoff_mode",
            "one-shot vs streaming vs dynamic handoff over RLD backlogs of 8..512 tokens",
        ),
        BenchSpec(
            "transport",
            "pddnet.bench.transport",
            "shm write vs memcpy, WAN goodput vs rate, decode daemon vs reference engine",
        ),
        BenchSpec(
            "drc",
            "pddnet.bench.drc",
            "WAN KV bytes and TTFT with and without the decode-side RadixCache",
        ),
        BenchSpec(
            "handoff",
            "pddnet.bench.handoff",
            "token-id vs KV-direct handoff: payload, latency, quiet and jittery WAN",
        ),
        BenchSpec(
            "engine",
            "pddnet.bench.engine",
            "engine step time vs context: gather vs paged attention, and the roofline target",
        ),
    )
}


def register(sub: argparse._SubParsersAction) -> None:
    """Add `bench`, `demo` and `trace` to the `pdd` subcommands."""
    listing = "\n".join(f"  {s.name:<14} {s.help}" for s in BENCHES.values())
    b = sub.add_parser(
        "bench",
        help="run a benchmark (pdd bench NAME --help)",
        description=f"Benchmarks (each with --quick):\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    b.add_argument("name", nargs="?", metavar="NAME", help="benchmark to run; none: list them")
    b.add_argument(
        "bench_args",
        nargs=argparse.REMAINDER,
        metavar="...",
        help="the benchmark's own options (pdd bench NAME --help)",
    )
    b.set_defaults(handler=run_bench)

    from pddnet.bench import demo

    d = sub.add_parser(
        "demo",
        help="bring up pdd, cross-dc and same-dc and compare them",
        description=(demo.__doc__ or "").strip(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    demo.add_arguments(d)
    d.set_defaults(handler=run_demo)

    t = sub.add_parser(
        "trace",
        help="a request's timeline as a Chrome/Perfetto trace",
        description="Find REQUEST_ID's `pdd` object (a completion body, or a "
        "benchmark's result JSON) and write it as a Chrome/Perfetto trace "
        "(open in https://ui.perfetto.dev).",
    )
    t.add_argument("request_id", metavar="REQUEST_ID")
    t.add_argument(
        "--in",
        dest="inputs",
        nargs="+",
        default=["results"],
        metavar="PATH",
        help="JSON files or folders to search (default: results/)",
    )
    t.add_argument("-o", "--output", help="trace file (default: trace-REQUEST_ID.json)")
    t.set_defaults(handler=run_trace)


def run_bench(args: argparse.Namespace) -> int:
    if not args.name:
        print("benchmarks (pdd bench NAME [--quick] ...):")
        for s in BENCHES.values():
            print(f"  {s.name:<14} {s.help}")
        return 0
    spec = BENCHES.get(args.name)
    if spec is None:
        print(
            f"pdd bench: unknown benchmark {args.name!r}; known: {', '.join(BENCHES)}",
            file=sys.stderr,
        )
        return 2
    return run_spec(spec, list(args.bench_args))


def run_spec(spec: BenchSpec, argv: list[str]) -> int:
    import asyncio

    from pddnet.bench.results import source_commit

    p = spec.parser()
    ns = p.parse_args(argv)
    ns.bench_spec = spec.name
    source_commit()  # read now: the tree may change while a long benchmark runs
    try:
        asyncio.run(spec.load().run(ns))
    except ValueError as exc:  # a bad option combination, said precisely by the benchmark
        p.error(str(exc))
    return 0


def run_demo(args: argparse.Namespace) -> int:
    import asyncio

    from pddnet.bench import demo

    asyncio.run(demo.run(args))
    return 0


def _json_files(inputs: list[str]) -> list[Path]:
    files: list[Path] = []
    for name in inputs:
        path = Path(name)
        if path.is_dir():
            found = sorted(path.rglob("*.json"), key=lambda f: f.stat().st_mtime, reverse=True)
            files += [f for f in found if not f.name.endswith(".trace.json")]
        elif path.is_file():
            files.append(path)
        else:
            raise FileNotFoundError(f"{name}: no such file or folder")
    return files


def run_trace(args: argparse.Namespace) -> int:
    from pddnet.obs.trace import find_pdd_objects, find_token_times, write_trace

    try:
        files = _json_files(args.inputs)
    except FileNotFoundError as exc:
        print(f"pdd trace: {exc}", file=sys.stderr)
        return 2
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        found = find_pdd_objects(data, args.request_id)
        if found:
            out = Path(args.output or f"trace-{args.request_id}.json")
            times = find_token_times(data, args.request_id)
            write_trace(out, found[0], {args.request_id: times} if times else None)
            pdd = found[0]
            print(
                f"{args.request_id}: mode {pdd.get('mode')}, pipeline {pdd.get('pipeline')}, "
                f"{len(pdd['timeline'])} milestones (from {f})"
            )
            print(f"wrote {out}  (open it in https://ui.perfetto.dev or chrome://tracing)")
            return 0
    print(
        f"pdd trace: request {args.request_id!r} not found in {len(files)} JSON file(s) under "
        f"{', '.join(args.inputs)} (benchmarks store every request's `pdd` object; or save a "
        f"completion's JSON body and pass it with --in)",
        file=sys.stderr,
    )
    return 1
