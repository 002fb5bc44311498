"""`pdd` entry point: one argparse tree; each area registers its own subcommands.

Registration functions import nothing heavy (torch, aiohttp) at module import time, so
`pdd --help` stays fast; handlers import what they need when they run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from emulation.cli import register_testbed, register_wan
    from pddnet.bench.cli import register as register_bench
    from pddnet.cluster.cli import register as register_cluster
    from pddnet.engine.cli import register_generate
    from pddnet.model.cli import register_model
    from pddnet.sim.cli import register as register_sim

    parser = argparse.ArgumentParser(prog="pdd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_generate(sub)
    register_model(sub)
    register_wan(sub)
    register_testbed(sub)
    register_cluster(sub)
    register_bench(sub)     # bench, demo, trace
    register_sim(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # the command line as given: a command that re-executes itself (pdd sim --compiled) needs it
    args.argv = list(sys.argv[1:] if argv is None else argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    try:
        rc = handler(args)
    except KeyboardInterrupt:
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
