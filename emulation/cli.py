"""`pdd wan ...` and `pdd testbed ...` subcommands (registration only; handlers live beside)."""

from __future__ import annotations

import argparse


def register_wan(sub: argparse._SubParsersAction) -> None:
    from emulation.wan_cli import register

    register(sub)


def register_testbed(sub: argparse._SubParsersAction) -> None:
    from emulation.testbed_cli import register

    register(sub)
