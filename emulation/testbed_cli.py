"""`pdd testbed up|down|status|exec`: the multi-namespace testbed from the shell.

Registration imports nothing heavy; handlers import what they need.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from emulation.wan_cli import add_link_arguments


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "testbed",
        help="two network namespaces (datacenters A, B) joined by an emulated WAN",
        description=__doc__,
    )
    tsub = p.add_subparsers(dest="testbed_command", metavar="up|down|status|exec")
    tsub.required = True

    up = tsub.add_parser("up", help="create the testbed and start its emulator, then return")
    _name(up)
    add_link_arguments(up)
    up.add_argument("--loss-pct", type=float, default=0.0, help="random loss per direction (%%)")
    up.add_argument("--mtu", type=int, default=9000, help="WAN MTU")
    up.add_argument(
        "--shell",
        choices=["packet", "kernel", "auto"],
        default="auto",
        help="packet (TUN + userspace forwarder), kernel (veth + netem), auto: "
        "kernel where the kernel has netem, else packet",
    )
    up.add_argument("--addr-a", default="10.77.0.1", help="address in A")
    up.add_argument("--addr-b", default="10.77.0.2", help="address in B")
    up.add_argument(
        "--tcp-rto-min-ms",
        type=float,
        default=None,
        help="TCP's minimum retransmission timeout in both namespaces (default: the kernel's, "
        "200 ms); k x 200 for daemons whose time is dilated by k",
    )
    up.set_defaults(handler=cmd_up)

    down = tsub.add_parser("down", help="remove everything the testbed made (also after a crash)")
    _name(down)
    down.set_defaults(handler=cmd_down)

    st = tsub.add_parser("status", help="the link, its counters and the processes inside")
    _name(st)
    st.add_argument("--json", action="store_true", help="print JSON")
    st.set_defaults(handler=cmd_status)

    ex = tsub.add_parser(
        "exec",
        help="run a command inside namespace a or b",
        usage="pdd testbed exec [--name N] a|b -- CMD [ARGS...]",
    )
    _name(ex)
    ex.add_argument("side", choices=["a", "b"], help="namespace of datacenter A or B")
    ex.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARGS...]")
    ex.set_defaults(handler=cmd_exec)


# `up`'s options are Testbed's parameters, by the same names
_UP_OPTIONS = (
    "name",
    "rtt_ms",
    "jitter_ms",
    "jitter_dist",
    "bw_mbit",
    "loss_pct",
    "queue_bytes",
    "mtu",
    "shell",
    "addr_a",
    "addr_b",
    "seed",
    "tcp_rto_min_ms",
)


def _name(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--name", default="pdd", help="testbed name: namespaces are <name>-a and <name>-b"
    )


def _fail(msg: str, code: int = 1) -> int:
    print(f"pdd testbed: {msg}", file=sys.stderr)
    return code


def _check_name(name: str) -> int | None:
    """None for a valid testbed name; else says why not and returns the usage error's code."""
    from emulation.testbed import check_testbed_name

    try:
        check_testbed_name(name)
    except ValueError as exc:
        return _fail(str(exc), 2)
    return None


def cmd_up(args: argparse.Namespace) -> int:
    import asyncio

    from emulation.testbed import Testbed

    try:
        tb = Testbed(**{key: getattr(args, key) for key in _UP_OPTIONS})
    except ValueError as exc:
        return _fail(str(exc), 2)
    try:
        asyncio.run(tb.start())
    except (FileExistsError, PermissionError, RuntimeError, TimeoutError, OSError) as exc:
        return _fail(str(exc))
    tb.detach()
    print(
        f"testbed {tb.name} up ({tb.shell} shell): A = {tb.ns_a} {tb.addr_a}, "
        f"B = {tb.ns_b} {tb.addr_b}, MTU {tb.mtu}"
    )
    print(f"control API: {tb.control_url}   emulator pid {tb.emulator_pid}")
    print(f"run inside:  pdd testbed exec --name {tb.name} a -- CMD")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    from emulation.testbed import teardown, unavailable_reason

    if (code := _check_name(args.name)) is not None:
        return code
    reason = unavailable_reason()
    if reason is not None:
        return _fail(reason)
    report = teardown(args.name)
    removed = report["namespaces"] or report["emulators"] or report["state_file"]
    print(
        f"testbed {args.name}: "
        + (
            "removed namespaces "
            + (", ".join(report["namespaces"]) or "none")
            + f", ended {len(report['processes'])} process(es) and "
            f"{len(report['emulators'])} emulator(s)"
            if removed
            else "nothing to remove"
        )
    )
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    import asyncio

    from emulation.testbed import status

    if (code := _check_name(args.name)) is not None:
        return code
    info = asyncio.run(status(args.name))
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
    else:
        print(format_status(info))
    return 0 if info["up"] else 1


def format_status(info: dict[str, Any]) -> str:
    state = info.get("state") or {}
    lines = [f"testbed {info['name']}: " + ("up" if info["up"] else "DOWN or broken")]
    if state:
        lines.append(
            f"  shell {state.get('shell')}  A {state.get('namespaces', {}).get('a')} "
            f"{state.get('addr_a')}  B {state.get('namespaces', {}).get('b')} "
            f"{state.get('addr_b')}  MTU {state.get('mtu')}"
        )
        lines.append(
            f"  control {state.get('control_url')}  emulator pid "
            f"{(state.get('emulator') or {}).get('pid')} "
            f"({'alive' if info.get('emulator_alive') else 'not running'})"
        )
    else:
        lines.append("  no state file")
    link = info.get("link")
    if link:
        for direction in ("a_to_b", "b_to_a"):
            d = link.get(direction, {})
            fx, c = d.get("effects", {}), d.get("counters", {})
            drops = {k: v for k, v in c.get("drops", {}).items() if v}
            lines.append(
                f"  {direction}: delay {fx.get('delay_ms')} ms jitter "
                f"{fx.get('jitter_ms')} ms ({fx.get('jitter_dist')}) rate "
                f"{fx.get('rate_mbit') or 'unlimited'} Mbit/s loss {fx.get('loss_pct')}%"
                + ("  PARTITIONED" if fx.get("partition") else "")
            )
            lines.append(
                f"    in {c.get('packets_in')} pkts / {c.get('bytes_in')} B, out "
                f"{c.get('packets_out')} pkts / {c.get('bytes_out')} B, queue "
                f"{c.get('queue', {}).get('bytes')} B, drops {drops or 0}"
            )
    elif info.get("link_error"):
        lines.append(f"  link: {info['link_error']}")
    procs = info.get("processes") or []
    lines.append(f"  processes ({len(procs)}):")
    lines += [f"    {p['pid']:>7} {p['where']:<8} {p['cmdline'][:100]}" for p in procs]
    return "\n".join(lines)


def cmd_exec(args: argparse.Namespace) -> int:
    from emulation import netns
    from emulation.testbed import namespaces_of

    command = list(args.command)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        return _fail("exec needs a command: pdd testbed exec [--name N] a|b -- CMD", 2)
    if (code := _check_name(args.name)) is not None:
        return code
    ns = namespaces_of(args.name)[0 if args.side == "a" else 1]
    if not netns.exists(ns):
        return _fail(
            f"testbed {args.name!r} is not up (no namespace {ns}); "
            f"start it with `pdd testbed up --name {args.name}`"
        )
    try:
        netns.exec_in(ns, command)  # setns + execvp: does not return
    except OSError as exc:
        return _fail(f"cannot enter {ns}: {exc}")
    return 127  # pragma: no cover


def main(argv: list[str] | None = None) -> int:
    """`python -m emulation.testbed_cli up|down|status|exec ...` (same as `pdd testbed ...`)."""
    parser = argparse.ArgumentParser(prog="python -m emulation.testbed_cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["testbed", *(sys.argv[1:] if argv is None else argv)])
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
