"""The kernel shell: a veth pair between the two namespaces shaped by the kernel, netem for delay,
jitter, loss and duplication with a tbf child for the rate, all through pyroute2.

Where the kernel has sch_netem this is the cheapest faithful-ish WAN; it keeps netem's own
semantics (jitter reorders packets, uniform jitter only: pyroute2 cannot load netem's
distribution tables, no Gilbert-Elliott). Kernels built without sch_netem (this project's CI
machine among them) are detected by adding a netem qdisc on the loopback of a scratch
namespace; the answer is cached per process and comes with the reason.

The emulator process of a kernel-shell testbed (`python -m emulation.kernel_shell serve`) holds a
Link model only as the record of the effects asked for: it serves the same control API as the
other shells and, after every control change and every 50 ms (timed reverts, schedules), applies the
effects to the qdiscs. Counters come from the kernel (GET /kernel), not from the model.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

from emulation import netns

# priority_dscp would need a prio qdisc with a u32 filter on the TOS byte in front of netem: not
# built (this box's kernel has neither netem nor prio to test it on).
NETEM_UNSUPPORTED = ("jitter_corr_pct", "reorder_pct", "ge_p_pct", "priority_dscp")
_netem_reason: list[str | None] = []  # cache: [] = not probed yet


def netem_unavailable_reason() -> str | None:
    """Why the kernel shell cannot run here (None when it can). Probed once per process."""
    if not _netem_reason:
        _netem_reason.append(_probe_netem())
    return _netem_reason[0]


def netem_available() -> bool:
    return netem_unavailable_reason() is None


def _probe_netem() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, qdiscs)"
    name = f"pddprobe-{os.getpid()}"
    try:
        netns.create(name)
    except OSError as exc:
        return f"cannot create a scratch network namespace to probe netem: {exc}"
    try:

        def probe() -> str | None:
            from pyroute2 import IPRoute
            from pyroute2.netlink.exceptions import NetlinkError

            with IPRoute() as ipr:
                lo = ipr.link_lookup(ifname="lo")[0]
                try:
                    ipr.tc("add", "netem", lo, handle="1:", delay=1000)
                except NetlinkError as exc:
                    return (
                        f"the kernel has no sch_netem (adding a netem qdisc failed: "
                        f"{os.strerror(exc.code)}; kernel {os.uname().release})"
                    )
            return None

        return netns.run_in_netns(name, probe)
    finally:
        netns.delete(name)


def create_veth(
    ns_a: str, ns_b: str, addr_a: str, addr_b: str, mtu: int = 9000, ifname: str = "wan0"
) -> None:
    """A veth pair `ifname` in ns_a <-> `ifname` in ns_b, point-to-point addressed and up. Made
    inside the namespaces (the peer is created directly in ns_b), so no link ever exists in the
    host namespace and deleting the namespaces removes the pair."""
    from emulation.tun import check_ifname, check_ipv4, check_mtu

    check_ifname(ifname)
    check_mtu(mtu)
    check_ipv4(addr_a, "addr_a")
    check_ipv4(addr_b, "addr_b")

    def make_pair() -> None:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            ipr.link(
                "add",
                ifname=ifname,
                kind="veth",
                peer={"ifname": ifname, "net_ns_fd": netns.netns_path(ns_b)},
            )

    def configure(local: str, peer: str) -> None:
        from pyroute2 import IPRoute

        from emulation.tun import _disable_ipv6

        with IPRoute() as ipr:
            idx = ipr.link_lookup(ifname=ifname)[0]
            _disable_ipv6(ifname)
            ipr.link("set", index=idx, mtu=mtu)
            ipr.addr("add", index=idx, local=local, address=peer, prefixlen=32)
            ipr.link("set", index=idx, state="up")

    netns.run_in_netns(ns_a, make_pair)
    netns.run_in_netns(ns_a, configure, addr_a, addr_b)
    netns.run_in_netns(ns_b, configure, addr_b, addr_a)


def qdisc_params(effects: dict[str, Any], mtu: int = 9000) -> tuple[dict[str, Any], dict | None]:
    """Map one direction's link effects to (netem kwargs, tbf kwargs or None) for pyroute2.

    Pure. Raises ValueError for effects netem (as pyroute2 drives it) cannot express."""
    for name in NETEM_UNSUPPORTED:
        if effects.get(name):
            raise ValueError(
                f"{name}={effects[name]!r} is not supported by the kernel shell "
                "(netem through pyroute2); use the packet shell"
            )
    if effects.get("jitter_ms") and effects.get("jitter_dist", "normal") != "uniform":
        raise ValueError(
            "the kernel shell has uniform jitter only (pyroute2 cannot load netem "
            f"distribution tables), got jitter_dist={effects.get('jitter_dist')!r}"
        )
    blocked = bool(effects.get("partition") or effects.get("blackhole"))
    netem = {
        "delay": int(round(effects.get("delay_ms", 0.0) * 1000)),  # us
        "jitter": int(round(effects.get("jitter_ms", 0.0) * 1000)),  # us (uniform half-width)
        "loss": 100.0 if blocked else float(effects.get("loss_pct", 0.0)),
        "duplicate": float(effects.get("duplicate_pct", 0.0)),
        # netem's own limit is in packets: deep enough never to be the bottleneck queue.
        "limit": 100_000,
    }
    rate = effects.get("rate_mbit")
    if rate is None:
        return netem, None
    tbf = {
        "rate": int(rate * 1e6 / 8),  # bytes/s
        "burst": max(int(effects.get("burst_bytes", 15_000)), mtu + 64),
        "limit": max(int(effects.get("queue_bytes", 1 << 20)), mtu + 64),
    }
    return netem, tbf


def apply_qdiscs(ns: str, ifname: str, effects: dict[str, Any], mtu: int = 9000) -> None:
    """Shape `ifname`'s egress in `ns`: netem at the root (1:), tbf below it (10:) for a rate."""
    netem, tbf = qdisc_params(effects, mtu)

    def apply() -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute() as ipr:
            idx = ipr.link_lookup(ifname=ifname)[0]
            ipr.tc("replace", "netem", idx, handle="1:", **netem)
            if tbf is not None:
                ipr.tc("replace", "tbf", idx, parent="1:1", handle="10:", **tbf)
            else:
                try:
                    ipr.tc("del", "tbf", idx, parent="1:1", handle="10:")
                except NetlinkError:
                    pass  # there was no rate limit

    netns.run_in_netns(ns, apply)


def qdisc_stats(ns: str, ifname: str) -> list[dict[str, Any]]:
    """Kernel counters of the qdiscs on `ifname` (bytes, packets, drops, backlog)."""

    def read() -> list[dict[str, Any]]:
        from pyroute2 import IPRoute

        out = []
        with IPRoute() as ipr:
            idx = ipr.link_lookup(ifname=ifname)[0]
            for q in ipr.get_qdiscs(idx):
                st = q.get_attr("TCA_STATS") or {}
                out.append(
                    {
                        "kind": q.get_attr("TCA_KIND"),
                        "handle": q["handle"],
                        "parent": q["parent"],
                        **{
                            k: st.get(k)
                            for k in ("bytes", "packets", "drops", "overlimits", "qlen", "backlog")
                        },
                    }
                )
        return out

    return netns.run_in_netns(ns, read)


async def serve(
    ns_a: str,
    ns_b: str,
    addr_a: str,
    addr_b: str,
    mtu: int,
    effects: dict[str, Any],
    control_host: str = "127.0.0.1",
    control_port: int = 0,
    ready_file: str | None = None,
    ifname: str = "wan0",
) -> None:
    """The kernel shell's emulator process: veth + qdiscs + control API until SIGTERM/SIGINT."""
    from aiohttp import web

    from emulation.control import make_control_app, start_control_server
    from emulation.link import Link
    from emulation.packet_shell import announce

    reason = netem_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"kernel shell unavailable: {reason}")
    link = Link(**effects)
    link.restrict(NETEM_UNSUPPORTED, "not supported by the kernel shell (netem via pyroute2)")
    create_veth(ns_a, ns_b, addr_a, addr_b, mtu, ifname)
    applied: dict[str, dict[str, Any]] = {}

    def sync() -> None:
        now = time.monotonic()
        for direction, ns in (("a_to_b", ns_a), ("b_to_a", ns_b)):
            d = link.direction(direction)
            d.poll(now)  # lets timed reverts and schedule steps take effect
            fx = d.effects()
            if applied.get(direction) != fx:
                apply_qdiscs(ns, ifname, fx, mtu)
                applied[direction] = fx

    sync()
    link.subscribe(sync)
    app = make_control_app(link, clock=time.monotonic)

    async def kernel_stats(request: Any) -> Any:
        return web.json_response(
            {"a_to_b": qdisc_stats(ns_a, ifname), "b_to_a": qdisc_stats(ns_b, ifname)}
        )

    app.router.add_get("/kernel", kernel_stats)
    runner, port = await start_control_server(app, control_host, control_port)
    stop = asyncio.Event()
    announce(
        ready_file,
        stop,
        {
            "shell": "kernel",
            "ifname": ifname,
            "control_url": f"http://{control_host}:{port}",
            "mtu": mtu,
            "addr_a": addr_a,
            "addr_b": addr_b,
        },
    )
    try:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), 0.05)
            except asyncio.TimeoutError:
                sync()
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> int:
    from emulation.packet_cli import add_effect_args, effects_from_args, parse_hostport

    p = argparse.ArgumentParser(prog="python -m emulation.kernel_shell serve")
    p.add_argument("command", choices=["serve", "probe"])
    p.add_argument("--ns-a")
    p.add_argument("--ns-b")
    p.add_argument("--addr-a", default="10.77.0.1")
    p.add_argument("--addr-b", default="10.77.0.2")
    p.add_argument("--mtu", type=int, default=9000)
    p.add_argument("--control", type=parse_hostport, default=("127.0.0.1", 0))
    p.add_argument("--ready-file", default=None)
    add_effect_args(p)
    args = p.parse_args(argv)
    if args.command == "probe":
        reason = netem_unavailable_reason()
        print("netem available" if reason is None else f"netem unavailable: {reason}")
        return 0 if reason is None else 1
    if not args.ns_a or not args.ns_b:
        p.error("serve needs --ns-a and --ns-b")
    try:
        effects = effects_from_args(args)
    except ValueError as exc:
        print(f"kernel shell: {exc}", file=sys.stderr)
        return 2
    host, port = args.control
    try:
        asyncio.run(
            serve(
                args.ns_a,
                args.ns_b,
                args.addr_a,
                args.addr_b,
                args.mtu,
                effects,
                host,
                port,
                args.ready_file,
            )
        )
    except (RuntimeError, ValueError, OSError) as exc:
        print(f"kernel shell: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
