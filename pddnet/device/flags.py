"""The emulated-device flags every command that starts a cluster takes (``pdd up``, the
benchmarks): ``--target-model NAME``, ``--device ROLE=CHIP[:GPUS]`` (repeatable) and
``--dilation K|auto``. Light to import: nothing here loads torch until ``auto`` is resolved."""

from __future__ import annotations

import argparse
from typing import Any

from pddnet.device.emulated import parse_device_flags


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "emulated accelerators (docs/emulated-devices.md)",
        "pace every forward to a target model's roofline time on a modelled chip, carry its KV "
        "volume on the wire, and stretch time by k",
    )
    g.add_argument(
        "--target-model",
        default=None,
        metavar="NAME",
        help="model profile whose speed and KV bytes to emulate (llama-3-70b, "
        "deepseek-v3, ...; default: none, the CPU's own time)",
    )
    g.add_argument(
        "--device",
        action="append",
        default=[],
        metavar="ROLE=CHIP[:GPUS]",
        help="a role's modelled chip and chips per instance, e.g. prefill=h100-sxm:8 "
        "(roles: prefill, relay, main-decode; repeatable)",
    )
    g.add_argument(
        "--dilation",
        default=None,
        metavar="K|auto",
        help="time dilation k >= 1 (compute and link delays x k, rates / k, reported "
        "times / k), or auto: the smallest k a short probe runs without "
        "overruns (default 1)",
    )


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Config overrides from the flags (``auto`` is left out: see ``resolve_auto``)."""
    out: dict[str, Any] = {"target_model": args.target_model}
    out.update(parse_device_flags(args.device))
    if args.dilation is not None and args.dilation != "auto":
        try:
            out["dilation"] = float(args.dilation)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--dilation takes a number >= 1 or auto, got {args.dilation!r}"
            ) from None
    return out


def resolve_auto(config: Any, args: argparse.Namespace, log: Any = print) -> None:
    """With ``--dilation auto``, probe this box and set ``config.dilation`` (then validate)."""
    if args.dilation != "auto":
        return
    from pddnet.device.probe import probe_dilation

    result = probe_dilation(config, log=log)
    config.dilation = result.dilation
    config.validate()
