"""`pdd wan packet --ns-a NAME --ns-b NAME [...]`: the packet shell between two existing
namespaces, with its control API on loopback (runs until SIGTERM/SIGINT).

Registration imports nothing heavy (no aiohttp, no pyroute2) so `pdd --help` stays fast. Also
runnable as `python -m emulation.packet_cli ...` (how the testbed starts its emulator process).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields
from typing import Any


def parse_hostport(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT (port 0-65535), got {text!r}")
    return host, int(port)


def add_effect_args(p: argparse.ArgumentParser) -> None:
    """Initial link effects, per direction (the same on both)."""
    g = p.add_argument_group("initial effects (each direction; change them later with pdd wan set)")
    g.add_argument(
        "--rtt-ms",
        type=float,
        default=None,
        help="round-trip delay: sets each direction's delay to half of it (default: "
        "0, or --delay-ms)",
    )
    g.add_argument("--delay-ms", type=float, default=None, help="one-way delay (ms) (default: 0)")
    g.add_argument("--jitter-ms", type=float, default=None, help="one-way jitter (ms) (default: 0)")
    g.add_argument(
        "--jitter-dist", default=None, help="uniform | normal | pareto-normal (default: normal)"
    )
    g.add_argument(
        "--bw-mbit",
        "--rate-mbit",
        dest="rate_mbit",
        type=float,
        default=None,
        help="bottleneck rate per direction (Mbit/s) (default: unlimited)",
    )
    g.add_argument(
        "--queue-bytes",
        type=int,
        default=None,
        help="bottleneck queue limit (bytes) (default: 1 MiB)",
    )
    g.add_argument("--loss-pct", type=float, default=None, help="random loss (%%) (default: 0)")
    g.add_argument("--seed", type=int, default=0, help="seed of the link model's randomness")


def effects_from_args(args: argparse.Namespace) -> dict[str, Any]:
    if args.rtt_ms is not None and args.delay_ms is not None:
        raise ValueError("give --rtt-ms or --delay-ms, not both")
    fx: dict[str, Any] = {}
    if args.rtt_ms is not None:
        fx["delay_ms"] = args.rtt_ms / 2.0
    if args.delay_ms is not None:
        fx["delay_ms"] = args.delay_ms
    for key in ("jitter_ms", "jitter_dist", "rate_mbit", "queue_bytes", "loss_pct"):
        value = getattr(args, key)
        if value is not None:
            fx[key] = value
    from emulation.effects import validate_effects

    return validate_effects(fx)


def add_packet_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ns-a", required=True, help="namespace of datacenter A (must exist)")
    p.add_argument("--ns-b", required=True, help="namespace of datacenter B (must exist)")
    p.add_argument(
        "--control",
        type=parse_hostport,
        default=("127.0.0.1", 0),
        help="control API address HOST:PORT (default: 127.0.0.1:0, a free port)",
    )
    p.add_argument("--addr-a", default="10.77.0.1", help="address of A's end")
    p.add_argument("--addr-b", default="10.77.0.2", help="address of B's end")
    p.add_argument("--mtu", type=int, default=9000, help="TUN MTU, 68..65535")
    p.add_argument("--ifname", default="wan0", help="TUN device name in each namespace")
    p.add_argument(
        "--ready-file",
        default=None,
        help="write {pid, control_url, ...} as JSON here once serving (default: none)",
    )
    add_effect_args(p)
    p.set_defaults(handler=run_packet)


def register_wan_packet(wan_subparsers: argparse._SubParsersAction) -> None:
    p = wan_subparsers.add_parser(
        "packet",
        help="packet shell: forward IP packets between TUN devices in two namespaces",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_packet_args(p)


def run_packet(args: argparse.Namespace) -> int:
    import asyncio

    from emulation.packet_shell import PacketShellConfig, serve

    try:
        effects = effects_from_args(args)
        host, port = args.control
        given = {
            f.name: vars(args)[f.name] for f in fields(PacketShellConfig) if f.name in vars(args)
        }
        cfg = PacketShellConfig(**given, control_host=host, control_port=port)
        from emulation import tun

        tun.TunConfig(cfg.ifname, cfg.addr_a, cfg.addr_b, cfg.mtu)  # validate before starting
    except ValueError as exc:
        print(f"pdd wan packet: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop

        runner = uvloop.run
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run
    try:
        runner(serve(cfg, effects, ready_file=args.ready_file))
    except (FileNotFoundError, PermissionError) as exc:
        print(f"pdd wan packet: {exc}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m emulation.packet_cli",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_packet_args(p)
    args = p.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
