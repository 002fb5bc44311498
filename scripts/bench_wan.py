"""Benchmark of the WAN emulators at zero configured delay, against direct connections.

For each shell available here, in one run:
  packet  TCP between two namespaces through the TUN forwarder  vs  a plain veth pair between
          two namespaces (the same kernel TCP path, without the emulator)
  kernel  veth + netem (only where the kernel has sch_netem)     vs  the same plain veth pair
  proxy   TCP through WanProxy on loopback                       vs  direct loopback TCP
it measures bulk TCP goodput, TCP request/response RTT (64 B, TCP_NODELAY), and the CPU time the
emulator process used per GB forwarded (utime+stime from /proc/<pid>/stat). Prints ratios and
writes results/wan/<timestamp>.json (+ a PNG). Bounded: about a minute.

    sudo python scripts/bench_wan.py [--seconds 3] [--probes 300] [--mtu 9000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from emulation import kernel_shell, netns  # noqa: E402
from emulation.probes import TcpEcho, TcpSink, tcp_rtts, tcp_send_for  # noqa: E402
from emulation.proxy import proxy_process  # noqa: E402
from emulation.testbed import Testbed, proc_cpu_seconds, unavailable_reason  # noqa: E402


def listener(make: Any, addr: str) -> socket.socket:
    ls = make()
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((addr, 0))
    ls.listen(8)
    return ls


def measure(
    make_server: Any,
    make_client: Any,
    server_addr: str,
    connect_addr: str | None,
    connect_port: Any,
    seconds: float,
    probes: int,
    emulator_pid: Callable[[], int | None],
) -> dict[str, Any]:
    """Goodput (Mbit/s), RTT median/p99 (ms) and emulator CPU seconds during the bulk run.
    `connect_port(server_port)` maps the server's port to where the client connects (a proxy);
    `emulator_pid()` is asked after that (a proxy's process is known only then)."""
    out: dict[str, Any] = {}
    echo_ls = listener(make_server, server_addr)
    echo = TcpEcho(echo_ls)
    try:
        dst = (connect_addr or server_addr, connect_port(echo_ls.getsockname()[1]))
        tcp_rtts(make_client(), dst, 20, 0.001)  # warm-up (ARP, caches, first connection)
        rtts = sorted(tcp_rtts(make_client(), dst, probes, 0.002))
    finally:
        echo.stop()
        echo_ls.close()
    out["rtt_median_ms"] = statistics.median(rtts)
    out["rtt_p99_ms"] = rtts[int(0.99 * (len(rtts) - 1))]
    sink_ls = listener(make_server, server_addr)
    sink = TcpSink(sink_ls)
    try:
        dst = (connect_addr or server_addr, connect_port(sink_ls.getsockname()[1]))
        pid = emulator_pid()
        cpu0 = proc_cpu_seconds(pid) if pid else None
        start = time.monotonic()
        tcp_send_for(make_client(), dst, seconds)
        time.sleep(0.2)
        cpu1 = proc_cpu_seconds(pid) if pid else None
    finally:
        sink.stop()
        sink_ls.close()
    received = sink.total()
    out["goodput_mbit"] = (
        sink.bytes_between(start + 0.3, start + seconds) * 8 / (seconds - 0.3) / 1e6
    )
    out["bytes"] = received
    if cpu0 is not None and cpu1 is not None:
        out["emulator_cpu_s"] = cpu1 - cpu0
        out["emulator_cpu_s_per_gb"] = (cpu1 - cpu0) / (received / 1e9) if received else None
    return out


def in_ns(a: str, b: str) -> tuple[Any, Any]:
    return (lambda: netns.socket_in(b), lambda: netns.socket_in(a))


def bench_veth(seconds: float, probes: int, mtu: int) -> dict[str, Any]:
    a, b = f"pddbench-{os.getpid()}-va", f"pddbench-{os.getpid()}-vb"
    netns.create(a)
    try:
        netns.create(b)
        kernel_shell.create_veth(a, b, "10.77.0.1", "10.77.0.2", mtu)
        server, client = in_ns(a, b)
        return measure(
            server, client, "10.77.0.2", None, lambda p: p, seconds, probes, lambda: None
        )
    finally:
        for n in (a, b):
            netns.kill_all_in(n)
            netns.delete(n)


def bench_testbed(shell: str, seconds: float, probes: int, mtu: int) -> dict[str, Any]:
    async def run() -> dict[str, Any]:
        async with Testbed(name=f"pddbench{os.getpid()}", shell=shell, mtu=mtu) as tb:
            server, client = in_ns(tb.ns_a, tb.ns_b)
            res = await asyncio.to_thread(
                measure,
                server,
                client,
                tb.addr_b,
                None,
                lambda p: p,
                seconds,
                probes,
                lambda: tb.emulator_pid,
            )
            res["link_counters"] = {
                d: {k: v for k, v in x["counters"].items() if k != "delay"}
                for d, x in (await tb.link.show()).items()
                if d in ("a_to_b", "b_to_a")
            }
            return res

    return asyncio.run(run())


def bench_proxy(seconds: float, probes: int) -> dict[str, Any]:
    """One proxy process per measured server (echo, then sink): WanProxy has one upstream."""
    cpu_pid: list[int] = []

    def make() -> socket.socket:
        return socket.socket()

    with contextlib.ExitStack() as procs:

        def port_via_proxy(server_port: int) -> int:
            port, pid = procs.enter_context(proxy_process(server_port))
            cpu_pid[:] = [pid]
            return port

        # The CPU pid is the proxy's in front of the sink: measure() asks for it once it started.
        return measure(
            make, make, "127.0.0.1", None, port_via_proxy, seconds, probes, lambda: cpu_pid[0]
        )


def bench_loopback(seconds: float, probes: int) -> dict[str, Any]:
    def make() -> socket.socket:
        return socket.socket()

    return measure(make, make, "127.0.0.1", None, lambda p: p, seconds, probes, lambda: None)


def compare(shell: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {
        "goodput_ratio": shell["goodput_mbit"] / base["goodput_mbit"],
        "added_rtt_ms": shell["rtt_median_ms"] - base["rtt_median_ms"],
        "rtt_ratio": shell["rtt_median_ms"] / base["rtt_median_ms"],
    }


def plot(result: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shells = list(result["shells"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in (
        (axes[0], "goodput_mbit", "TCP goodput (Mbit/s)"),
        (axes[1], "rtt_median_ms", "TCP RTT median (ms)"),
    ):
        xs = range(len(shells))
        ax.bar(
            [x - 0.2 for x in xs], [result["shells"][s][key] for s in shells], 0.4, label="emulator"
        )
        ax.bar(
            [x + 0.2 for x in xs],
            [result["baselines"][result["baseline_of"][s]][key] for s in shells],
            0.4,
            label="direct",
        )
        ax.set_xticks(list(xs), shells)
        ax.set_title(label)
        ax.legend()
    fig.suptitle("WAN emulators at zero configured delay vs direct connections")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seconds", type=float, default=3.0, help="bulk transfer length per case")
    p.add_argument("--probes", type=int, default=300, help="RTT probes per case")
    p.add_argument("--mtu", type=int, default=9000, help="MTU of TUN/veth (packet/kernel shell)")
    p.add_argument("--out", default=os.path.join(ROOT, "results", "wan"))
    args = p.parse_args(argv)
    if not 0.5 < args.seconds <= 30 or not 10 <= args.probes <= 5000:
        p.error("--seconds must be in (0.5, 30] and --probes in [10, 5000]")

    result: dict[str, Any] = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "mtu": args.mtu,
        "seconds": args.seconds,
        "probes": args.probes,
        "kernel": os.uname().release,
        "cpus": os.cpu_count(),
        "shells": {},
        "baselines": {},
        "baseline_of": {},
        "ratios": {},
        "skipped": {},
    }
    print("loopback (direct) ...", flush=True)
    result["baselines"]["loopback"] = bench_loopback(args.seconds, args.probes)
    print("proxy shell ...", flush=True)
    result["shells"]["proxy"] = bench_proxy(args.seconds, args.probes)
    result["baseline_of"]["proxy"] = "loopback"
    reason = unavailable_reason()
    if reason is None:
        print("veth pair (direct) ...", flush=True)
        result["baselines"]["veth"] = bench_veth(args.seconds, args.probes, args.mtu)
        print("packet shell ...", flush=True)
        result["shells"]["packet"] = bench_testbed("packet", args.seconds, args.probes, args.mtu)
        result["baseline_of"]["packet"] = "veth"
        netem = kernel_shell.netem_unavailable_reason()
        if netem is None:
            print("kernel shell ...", flush=True)
            result["shells"]["kernel"] = bench_testbed(
                "kernel", args.seconds, args.probes, args.mtu
            )
            result["baseline_of"]["kernel"] = "veth"
        else:
            result["skipped"]["kernel"] = netem
    else:
        result["skipped"]["packet"] = result["skipped"]["kernel"] = reason

    print(
        f"\n{'shell':<8} {'goodput Mbit/s':>15} {'direct':>9} {'ratio':>6}   "
        f"{'RTT ms':>7} {'direct':>7} {'added':>7}   {'emulator CPU s/GB':>17}"
    )
    for shell, res in result["shells"].items():
        base = result["baselines"][result["baseline_of"][shell]]
        ratio = result["ratios"][shell] = compare(res, base)
        cpu = res.get("emulator_cpu_s_per_gb")
        print(
            f"{shell:<8} {res['goodput_mbit']:>15.0f} {base['goodput_mbit']:>9.0f} "
            f"{ratio['goodput_ratio']:>6.2f}   {res['rtt_median_ms']:>7.3f} "
            f"{base['rtt_median_ms']:>7.3f} {ratio['added_rtt_ms']:>+7.3f}   "
            f"{cpu if cpu is None else f'{cpu:.2f}':>17}"
        )
    for shell, why in result["skipped"].items():
        print(f"{shell:<8} skipped: {why}")
    packet = result["shells"].get("packet")
    if packet:
        verdict = "meets" if packet["goodput_mbit"] >= 500 else "MISSES"
        print(
            f"\npacket shell goodput {packet['goodput_mbit']:.0f} Mbit/s {verdict} the "
            "500 Mbit/s target"
        )

    os.makedirs(args.out, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = os.path.join(args.out, f"{stamp}.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=2, sort_keys=True)
    print(f"\nwrote {path}")
    png = os.path.join(args.out, f"{stamp}.png")
    if plot(result, png):
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
