"""The packet shell measured from outside: real UDP/TCP between two namespaces through the
TUN forwarder, checked against what the link is configured to do."""

from __future__ import annotations

import asyncio
import math
import socket
import statistics
import time

import pytest
from conftest import root_netns_missing_reason

from emulation.effects import implied_jitter_std_ms
from emulation.probes import TcpSink, UdpEcho, tcp_send_for, udp_rtts, udp_stream
from emulation.testbed import Testbed
from tests.link_measurement import assert_measured
from tests.polling import wait_for

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        root_netns_missing_reason() is not None, reason=str(root_netns_missing_reason())
    ),
]

_names = iter(range(1000))


def tb_name() -> str:
    return f"pddtp{next(_names)}"


def udp_pair(tb: Testbed, port: int) -> tuple[socket.socket, socket.socket]:
    server = tb.socket("b", socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((tb.addr_b, port))
    client = tb.socket("a", socket.AF_INET, socket.SOCK_DGRAM)
    return client, server


def tcp_listener(tb: Testbed, port: int) -> socket.socket:
    ls = tb.socket("b")
    ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    ls.bind((tb.addr_b, port))
    ls.listen(8)
    return ls


async def rtts(tb: Testbed, count: int, interval_s: float) -> list[float]:
    client, server = udp_pair(tb, 7000)
    echo = UdpEcho(server)
    try:
        got = await asyncio.to_thread(udp_rtts, client, (tb.addr_b, 7000), count, interval_s)
    finally:
        echo.stop()
        client.close()
        server.close()
    assert all(r is not None for r in got), "probes were lost on a loss-free link"
    return [r for r in got if r is not None]


@pytest.mark.link_measurement
async def test_delay_15ms_each_way_gives_30ms_rtt_median():
    async with Testbed(name=tb_name(), rtt_ms=30, shell="packet") as tb:
        got = await rtts(tb, 120, 0.005)
    assert_measured(statistics.median(got), 30.0 - 1.0, 30.0 + 1.0, "RTT median (ms)")
    assert min(got) >= 30.0  # nothing can leave before its delay


@pytest.mark.link_measurement
async def test_normal_jitter_std_matches_the_model_and_does_not_reorder():
    async with Testbed(
        name=tb_name(), rtt_ms=30, jitter_ms=5, jitter_dist="normal", shell="packet"
    ) as tb:
        # Probes >= 25 ms apart: the in-order rule (a packet never overtakes the one ahead)
        # then almost never binds, so the RTT is the sum of two independent draws.
        got = await rtts(tb, 200, 0.025)
        implied = math.sqrt(2) * implied_jitter_std_ms(5.0, "normal")
        measured = statistics.pstdev(got)
        assert_measured(measured, 0.8 * implied, 1.2 * implied, "RTT std (ms)")

        # A dense one-way stream (0.2 ms apart, jitter 5 ms) arrives in order...
        tx, rx = udp_pair(tb, 7001)
        order = await asyncio.to_thread(udp_stream, tx, rx, (tb.addr_b, 7001), 300)
        assert order == list(range(300))
        # ...and reorders as soon as reordering is asked for (so the check above can fail).
        await tb.link.set("a_to_b", reorder_pct=100.0)
        order = await asyncio.to_thread(udp_stream, tx, rx, (tb.addr_b, 7001), 300)
        assert sorted(order) == list(range(300)) and order != list(range(300))
        tx.close()
        rx.close()


async def bulk(tb: Testbed, port: int, seconds: float, flows: int = 1) -> TcpSink:
    sink = TcpSink(tcp_listener(tb, port))
    try:
        sent = await asyncio.gather(
            *[
                asyncio.to_thread(tcp_send_for, tb.socket("a"), (tb.addr_b, port), seconds)
                for _ in range(flows)
            ]
        )
        await wait_for(lambda: sink.total() >= sum(sent), 10, "what is still queued to arrive")
    finally:
        sink.stop()
        sink.listener.close()
    return sink


def rate_mbit(sink: TcpSink, t0: float, t1: float, conn: int | None = None) -> float:
    return sink.bytes_between(t0, t1, conn) * 8 / (t1 - t0) / 1e6


@pytest.mark.link_measurement
async def test_bulk_tcp_reaches_the_rate_and_two_flows_share_it():
    async with Testbed(name=tb_name(), rtt_ms=10, bw_mbit=200, shell="packet") as tb:
        start = time.monotonic()
        sink = await bulk(tb, 5001, 3.0)
        # Steady state: skip slow start (first 0.5 s) and the tail.
        goodput = rate_mbit(sink, start + 0.5, start + 3.0)
        assert_measured(goodput, 0.90 * 200, 1.02 * 200, "goodput (Mbit/s)")

        start = time.monotonic()
        sink = await bulk(tb, 5002, 3.0, flows=2)
        assert len(sink.arrivals) == 2
        each = [rate_mbit(sink, start + 0.5, start + 3.0, conn=i) for i in range(2)]
        assert_measured(sum(each), 0.90 * 200, 1.02 * 200, f"two flows' goodput {each} (Mbit/s)")
        # Both get a real share.
        assert_measured(min(each) / sum(each), 0.25, 1.0, f"the smaller flow's share of {each}")


async def test_small_queue_tail_drops_are_counted():
    async with Testbed(
        name=tb_name(), rtt_ms=20, bw_mbit=100, queue_bytes=30_000, shell="packet"
    ) as tb:
        sink = await bulk(tb, 5003, 2.0)
        counters = (await tb.link.show())["a_to_b"]["counters"]
    assert counters["drops"]["queue_full"] > 0
    assert counters["queue"]["max_bytes"] <= 30_000
    assert sink.total() > 0  # TCP recovered from the drops and kept going
    # Every packet that entered was either delivered, dropped or is still in the link.
    assert counters["packets_in"] == (
        counters["packets_out"]
        + sum(counters["drops"].values())
        + counters["queue"]["packets"]
        + counters["in_flight_packets"]
        - counters["duplicated"]
    )


def binomial_interval(n: int, p: float, conf: float = 0.99) -> tuple[int, int]:
    """Central interval [lo, hi] holding at least `conf` of Binomial(n, p)."""

    def log_pmf(k: int) -> float:
        return (
            math.lgamma(n + 1)
            - math.lgamma(k + 1)
            - math.lgamma(n - k + 1)
            + k * math.log(p)
            + (n - k) * math.log1p(-p)
        )

    pmf = [math.exp(log_pmf(k)) for k in range(n + 1)]
    tail = (1 - conf) / 2
    lo, acc = 0, 0.0
    while acc + pmf[lo] < tail:
        acc += pmf[lo]
        lo += 1
    hi, acc = n, 0.0
    while acc + pmf[hi] < tail:
        acc += pmf[hi]
        hi -= 1
    return lo, hi


async def test_one_percent_random_loss_is_binomial():
    n = 3000
    async with Testbed(name=tb_name(), loss_pct=1.0, shell="packet", seed=7) as tb:
        tx, rx = udp_pair(tb, 7002)
        got = await asyncio.to_thread(udp_stream, tx, rx, (tb.addr_b, 7002), n)
        tx.close()
        rx.close()
        counters = (await tb.link.show())["a_to_b"]["counters"]
    lost = n - len(set(got))
    lo, hi = binomial_interval(n, 0.01)
    assert lo <= lost <= hi, (lost, lo, hi)
    assert counters["drops"]["loss"] == lost  # the model's counter is the measured loss


@pytest.mark.link_measurement
async def test_partition_stops_traffic_then_the_same_tcp_connection_recovers():
    async with Testbed(name=tb_name(), rtt_ms=10, shell="packet") as tb:
        sink = TcpSink(tcp_listener(tb, 5004))
        sender = tb.socket("a")
        sender.settimeout(10)
        await asyncio.to_thread(sender.connect, (tb.addr_b, 5004))
        stop = asyncio.Event()

        async def trickle() -> None:
            while not stop.is_set():  # 1 KB every 20 ms, through the partition too
                await asyncio.to_thread(sender.sendall, b"p" * 1024)
                await asyncio.sleep(0.02)

        task = asyncio.create_task(trickle())
        try:
            await wait_for(lambda: sink.total() > 0, 10, "the trickle to arrive")
            assert sink.total() > 0
            await tb.link.partition()
            cut = time.monotonic()
            await asyncio.sleep(2.0)  # the partition's length: TCP backs off meanwhile
            await tb.link.heal()
            healed = time.monotonic()
            # Nothing crossed while partitioned (0.1 s after the cut for what was in flight).
            crossed = sink.bytes_between(cut + 0.1, healed)
            assert_measured(crossed, 0, 0, "bytes across the partition")
            await wait_for(  # TCP's retransmission timer backs off to ~1.6 s here
                lambda: sink.bytes_between(healed, time.monotonic()),
                8,
                "TCP to recover after the heal",
            )
            assert len(sink.arrivals) == 1  # the same connection, not a new one
            drops = (await tb.link.show())["a_to_b"]["counters"]["drops"]["partition"]
            assert drops > 0
        finally:
            stop.set()
            await task
            sender.close()
            sink.stop()
            sink.listener.close()


@pytest.mark.link_measurement
async def test_schedule_rate_collapse_takes_effect_on_time():
    async with Testbed(
        name=tb_name(), rtt_ms=2, bw_mbit=200, queue_bytes=200_000, shell="packet"
    ) as tb:
        sink = TcpSink(tcp_listener(tb, 5005))
        send = asyncio.create_task(
            asyncio.to_thread(tcp_send_for, tb.socket("a"), (tb.addr_b, 5005), 2.5)
        )
        try:
            await asyncio.sleep(0.7)  # the flow at full rate before the schedule is loaded
            reply = await tb.link.schedule([{"at": 0.8, "direction": "a_to_b", "rate_mbit": 10}])
            step_at = reply["link"]["a_to_b"]["pending"]["next_step_at"]
            await send
        finally:
            sink.stop()
            sink.listener.close()
    before = rate_mbit(sink, step_at - 0.4, step_at)
    # From 50 ms after the step on, only the new rate gets through (plus one bucket of burst).
    late = sink.bytes_between(step_at + 0.05, step_at + 0.65)
    assert_measured(before, 150, math.inf, "rate before the step (Mbit/s)")
    # The new rate (and at least half of it: the link still carries it).
    late_max = 10e6 / 8 * 0.6 * 1.1 + 15_000 + 9000
    assert_measured(late, 10e6 / 8 * 0.6 * 0.5, late_max, "bytes from 50 ms after the step")


def test_packet_dscp_reads_the_ipv4_tos_and_the_ipv6_traffic_class() -> None:
    from emulation.packet_shell import packet_dscp

    ipv4_ef = bytes([0x45, 46 << 2]) + bytes(18)
    ipv6_ef = bytes([0x60 | (46 >> 2), (46 & 0x3) << 6]) + bytes(38)
    assert packet_dscp(ipv4_ef) == 46 and packet_dscp(ipv6_ef) == 46
    assert packet_dscp(bytes([0x45, 0x00]) + bytes(18)) == 0
    assert packet_dscp(bytes([0x45, 0x01])) == 0  # ECN bits are not DSCP
    assert packet_dscp(b"") == packet_dscp(b"\x45") == 0
