"""`pdd` entry point: one argparse tree; each area registers its own subcommands.

Registration functions import nothing heavy (torch, aiohttp) at module import time, so
`pdd --help` stays fast; handlers import what they need when they run.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence

from pddnet.cli_format import with_defaults


def version() -> str:
    """pddnet's version: the installed package's metadata (from pyproject.toml), else the
    source tree's ``pddnet.__version__``."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("pddnet")
    except PackageNotFoundError:  # pragma: no cover - running from a tree that is not installed
        from pddnet import __version__

        return __version__


def walk_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ("pdd",)
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every parser of the tree with its command path, the root first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            seen: set[int] = set()
            for name, child in action._name_parser_map.items():
                if id(child) not in seen:  # aliases map to the same parser
                    seen.add(id(child))
                    yield from walk_parsers(child, (*path, name))


def build_parser() -> argparse.ArgumentParser:
    import pddnet
    from emulation.testbed_cli import register as register_testbed
    from emulation.wan_cli import register as register_wan
    from pddnet.bench.cli import register as register_bench
    from pddnet.cluster.cli import register as register_cluster
    from pddnet.engine.cli import register as register_generate
    from pddnet.model.cli import register as register_model
    from pddnet.sim.cli import register as register_sim

    parser = argparse.ArgumentParser(
        prog="pdd",
        description=(pddnet.__doc__ or "").strip(),
        epilog="pdd COMMAND --help shows a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"pddnet {version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    register_generate(sub)
    register_model(sub)
    register_wan(sub)
    register_testbed(sub)
    register_cluster(sub)
    register_bench(sub)  # bench, demo, trace
    register_sim(sub)
    # every --help page shows the defaults, whichever module registered the command
    for _, p in walk_parsers(parser):
        p.formatter_class = with_defaults(p.formatter_class)
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
