"""`pdd wan proxy|set|show|chaos|reset` (and `pdd wan packet`, registered by the packet part).

Registration imports nothing heavy; each handler imports aiohttp & co. when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def _host_port(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


def _effect_value(text: str) -> Any:
    """CLI values: JSON where it parses (numbers, true/false, null), else the plain string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def _key_values(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"pdd wan: expected key=value, got {pair!r}")
        out[key.strip()] = _effect_value(value.strip())
    return out


def add_link_arguments(p: argparse.ArgumentParser) -> None:
    """The emulated link at start (each direction alike) and its seed: the options `pdd wan
    proxy` and `pdd testbed up` share. Unset (None), an effect is the link model's default."""
    p.add_argument("--rtt-ms", type=float, default=0.0, help="round-trip delay (ms), half each way")
    p.add_argument("--jitter-ms", type=float, default=0.0, help="jitter per direction (ms)")
    p.add_argument(
        "--jitter-dist",
        default=None,
        help="uniform | normal | pareto-normal (default: the link model's, normal)",
    )
    p.add_argument(
        "--bw-mbit",
        type=float,
        default=None,
        help="bottleneck rate per direction (Mbit/s) (default: unlimited)",
    )
    p.add_argument(
        "--queue-bytes",
        type=int,
        default=None,
        help="bottleneck queue limit (default: the link model's, 1 MiB)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the link model's randomness")


def register(sub: argparse._SubParsersAction) -> None:
    wan = sub.add_parser(
        "wan",
        help="the emulated WAN on its own, with a runtime control API",
        description="Run a WAN emulator or talk to a running one's control API.",
    )
    wan_sub = wan.add_subparsers(dest="wan_command", required=True, metavar="WAN_COMMAND")

    proxy = wan_sub.add_parser(
        "proxy",
        help="TCP proxy through the link model (no root)",
        description="Proxy TCP from --listen to --upstream through the "
        "link model; runs until SIGINT/SIGTERM.",
    )
    proxy.add_argument(
        "--listen",
        type=_host_port,
        required=True,
        metavar="HOST:PORT",
        help="address to accept connections on",
    )
    proxy.add_argument(
        "--upstream",
        type=_host_port,
        required=True,
        metavar="HOST:PORT",
        help="address to forward them to",
    )
    proxy.add_argument(
        "--control",
        type=_host_port,
        default=("127.0.0.1", 0),
        metavar="HOST:PORT",
        help="control API address (default: 127.0.0.1:0, any free port)",
    )
    add_link_arguments(proxy)
    proxy.add_argument(
        "--burst-bytes",
        type=int,
        default=None,
        help="token bucket depth (default: the link model's, 15000)",
    )
    proxy.add_argument(
        "--chunk-bytes", type=int, default=32 * 1024, help="largest byte chunk handed to the model"
    )
    proxy.add_argument(
        "--schedule",
        default=None,
        metavar="FILE",
        help="trace (.csv/.jsonl) or steps (.json) to replay from the start (default: none)",
    )
    proxy.add_argument("--loop", action="store_true", help="repeat --schedule")
    proxy.set_defaults(handler=run_proxy)

    def client(
        name: str, help_text: str, direction: str | None = None, duration: str | None = None
    ) -> argparse.ArgumentParser:
        """A command that talks to a running emulator's control API; with `direction` (what it
        does to the chosen direction) it takes --direction, with `duration` (that option's
        help) --duration."""
        p = wan_sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument(
            "--control",
            required=True,
            metavar="URL",
            help="control API, e.g. http://127.0.0.1:7070",
        )
        if direction is not None:
            p.add_argument(
                "--direction",
                default="both",
                choices=["both", "a_to_b", "b_to_a"],
                help=f"which direction to {direction}",
            )
        if duration is not None:
            p.add_argument("--duration", type=float, default=None, help=duration)
        return p

    show = client("show", "print a running emulator's effects and counters", direction="print")
    show.add_argument("--json", action="store_true", help="the raw JSON")
    show.set_defaults(handler=run_show)

    set_ = client(
        "set",
        "change effects: pdd wan set --control URL delay_ms=40 rate_mbit=100",
        direction="change",
        duration="seconds after which the change reverts by itself (default: it stays)",
    )
    set_.add_argument(
        "--clear",
        action="store_true",
        help="first return to the initial effects (then apply any key=value)",
    )
    set_.add_argument("effects", nargs="*", metavar="key=value")
    set_.set_defaults(handler=run_set)

    chaos = client(
        "chaos",
        "one chaos verb with a duration: partition | latency-spike "
        "(add_ms=) | bandwidth-collapse (fraction=) | loss-burst (loss_pct=) | "
        "jitter-storm (jitter_ms=) | heal",
        duration="seconds the fault lasts (no default: required)",
    )
    chaos.add_argument(
        "kind",
        help="partition | latency-spike | bandwidth-collapse | loss-burst | jitter-storm | heal",
    )
    chaos.add_argument("params", nargs="*", metavar="key=value")
    chaos.set_defaults(handler=run_chaos)

    reset = client("reset", "reset (RST) every connection through the emulator")
    reset.set_defaults(handler=run_reset)

    try:
        from emulation.packet_cli import register_wan_packet
    except ImportError as exc:
        reason = str(exc)
        packet = wan_sub.add_parser("packet", help="packet shell (unavailable here)")
        packet.set_defaults(handler=lambda args: _packet_missing(reason))
    else:
        register_wan_packet(wan_sub)


def _packet_missing(reason: str) -> int:
    print(f"pdd wan packet: the packet shell is not available ({reason})", file=sys.stderr)
    return 2


def run_proxy(args: argparse.Namespace) -> int:
    import asyncio

    from emulation.link import Link

    effects: dict[str, Any] = {
        "delay_ms": args.rtt_ms / 2.0,
        "jitter_ms": args.jitter_ms,
        "rate_mbit": args.bw_mbit,
    }
    for key in ("jitter_dist", "queue_bytes", "burst_bytes"):  # unset: the link model's
        if getattr(args, key) is not None:
            effects[key] = getattr(args, key)
    try:
        link = Link(seed=args.seed, **effects)
    except ValueError as exc:
        print(f"pdd wan proxy: {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        uvloop = None
    runner = uvloop.run if uvloop is not None else asyncio.run
    return runner(_serve_proxy(args, link))


async def _serve_proxy(args: argparse.Namespace, link: Any) -> int:
    import asyncio
    import signal
    import time

    from emulation.control import make_control_app, start_control_server
    from emulation.proxy import WanProxy

    try:
        proxy = WanProxy(args.listen, args.upstream, link, chunk_bytes=args.chunk_bytes)
        if args.schedule:
            link.load_schedule(time.monotonic(), args.schedule, loop=args.loop)
    except ValueError as exc:
        print(f"pdd wan proxy: {exc}", file=sys.stderr)
        return 2
    try:
        await proxy.start()
        app = make_control_app(link, time.monotonic, on_reset=proxy.reset_connections)
        runner, cport = await start_control_server(app, args.control[0], args.control[1])
    except OSError as exc:
        await proxy.close()
        print(f"pdd wan proxy: cannot listen: {exc}", file=sys.stderr)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    print(
        f"wan proxy: {args.listen[0]}:{proxy.port} -> {args.upstream[0]}:{args.upstream[1]}; "
        f"control http://{args.control[0]}:{cport}",
        flush=True,
    )
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await proxy.close()
    return 0


def _run_client(coro_factory: Any) -> int:
    import asyncio

    from emulation.control import ControlError

    try:
        result = asyncio.run(coro_factory())
    except ControlError as exc:
        print(f"pdd wan: {exc.message} (HTTP {exc.status})", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"pdd wan: cannot reach the control API: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # aiohttp client errors are not OSErrors in every version
        if type(exc).__module__.startswith("aiohttp"):
            print(f"pdd wan: cannot reach the control API: {exc}", file=sys.stderr)
            return 1
        raise
    if result is not None:
        print(result)
    return 0


def _summary(snapshot: dict[str, Any]) -> str:
    from emulation.effects import DEFAULT_EFFECTS

    lines = []
    for name in ("a_to_b", "b_to_a"):
        if name not in snapshot:
            continue
        d = snapshot[name]
        fx = {k: v for k, v in d["effects"].items() if DEFAULT_EFFECTS.get(k) != v}
        c = d["counters"]
        drops = {k: v for k, v in c["drops"].items() if v}
        delay = c["delay"]
        mean = f"{delay['mean_ms']:.2f} ms" if delay["mean_ms"] is not None else "-"
        lines.append(f"{name}: effects {json.dumps(fx) if fx else '(none)'}")
        lines.append(
            f"  in {c['packets_in']} items / {c['bytes_in']} B, out {c['packets_out']} "
            f"/ {c['bytes_out']} B, queue {c['queue']['bytes']} B "
            f"(max {c['queue']['max_bytes']}), delay mean {mean}, "
            f"drops {json.dumps(drops) if drops else 0}"
        )
        pending = d.get("pending", {})
        if pending.get("reverts") or pending.get("next_step_at") is not None:
            lines.append(f"  pending {json.dumps(pending)}")
    return "\n".join(lines)


def run_show(args: argparse.Namespace) -> int:
    from emulation.control import ControlClient

    async def go() -> str:
        snap = await ControlClient(args.control).show(args.direction)
        return json.dumps(snap, indent=2) if args.json else _summary(snap)

    return _run_client(go)


def run_set(args: argparse.Namespace) -> int:
    from emulation.control import ControlClient

    effects = _key_values(args.effects)
    if not effects and not args.clear:
        print("pdd wan set: give key=value effects (e.g. delay_ms=40) or --clear", file=sys.stderr)
        return 2

    async def go() -> str:
        client = ControlClient(args.control)
        if args.clear:
            snap = await client.clear(args.direction)
        if effects:
            snap = await client.set(args.direction, args.duration, **effects)
        return _summary(snap["link"])

    return _run_client(go)


def run_chaos(args: argparse.Namespace) -> int:
    from emulation.control import ControlClient

    params = _key_values(args.params)

    async def go() -> str:
        client = ControlClient(args.control)
        if args.kind == "heal":
            snap = await client.heal()
        else:
            if args.duration is None:
                raise SystemExit("pdd wan chaos: --duration SECONDS is required")
            snap = await client.chaos(args.kind, args.duration, **params)
        return _summary(snap["link"])

    return _run_client(go)


def run_reset(args: argparse.Namespace) -> int:
    from emulation.control import ControlClient

    async def go() -> str:
        result = await ControlClient(args.control).reset_connections()
        return f"reset {result['reset']} connection(s)"

    return _run_client(go)
