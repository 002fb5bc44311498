"""The proxy shell over loopback: measured delay, jitter, rate, partition, reset, schedules.

These measure the emulated link (as issue 4 asks), with the issue's tolerances; each run is a
few seconds at most.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import socket
import statistics
import time
from collections.abc import AsyncIterator

import pytest

from emulation.effects import implied_jitter_std_ms
from emulation.link import Link
from emulation.proxy import WanProxy
from tests.link_measurement import assert_measured
from tests.polling import wait_for

LOOP = "127.0.0.1"


class LoopbackServer:
    """A server on LOOP for one test: `async with` gives its port; subclasses say what each
    connection gets (`_handle`)."""

    server: asyncio.base_events.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> int:
        self.server = await asyncio.start_server(self._handle, LOOP, 0)
        return self.server.sockets[0].getsockname()[1]

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        await self.server.wait_closed()


class Echo(LoopbackServer):
    """Loopback echo server that also notes when each connection saw EOF."""

    def __init__(self) -> None:
        self.eof_at: list[float] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1 << 16):
                writer.write(data)
                await writer.drain()
            self.eof_at.append(time.monotonic())
        except ConnectionError:
            pass
        finally:
            writer.close()


class Sink(LoopbackServer):
    """Loopback server that counts received bytes with timestamps per connection."""

    def __init__(self) -> None:
        self.flows: list[list[tuple[float, int]]] = []
        self.digests: list[str] = []

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        marks: list[tuple[float, int]] = []
        self.flows.append(marks)
        total = 0
        digest = hashlib.sha256()
        try:
            while data := await reader.read(1 << 16):
                total += len(data)
                digest.update(data)
                marks.append((time.monotonic(), total))
        except ConnectionError:
            pass
        finally:
            self.digests.append(digest.hexdigest())
            writer.close()


async def through_the_proxy(link: Link, data: bytes, timeout: float, **proxy_options) -> list[str]:
    """Send `data` on one connection through a WanProxy over `link` into a Sink; the digests of
    what the sink received once the stream has ended there (within `timeout` s)."""
    sink = Sink()
    async with sink as port, WanProxy((LOOP, 0), (LOOP, port), link, **proxy_options) as proxy:
        _, writer = await asyncio.open_connection(LOOP, proxy.port)
        writer.write(data)
        await writer.drain()
        writer.close()
        await wait_for(lambda: sink.digests, timeout, "the sink to see the stream end", step=0.02)
    return sink.digests


def bytes_between(marks: list[tuple[float, int]], t0: float, t1: float) -> int:
    def at(t: float) -> int:
        return max([b for ts, b in marks if ts <= t] or [0])

    return at(t1) - at(t0)


async def send_for(port: int, seconds: float, block: bytes = b"\x00" * (1 << 16)) -> int:
    _, writer = await asyncio.open_connection(LOOP, port)
    sent = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        writer.write(block)
        await writer.drain()
        sent += len(block)
    writer.close()
    return sent


async def bulk_flows(link: Link, n: int) -> list[list[tuple[float, int]]]:
    """`n` connections sending as fast as they can for 3.2 s through a WanProxy over `link`;
    each flow's (time, bytes so far) marks at the sink, once every flow's tail has arrived."""
    sink = Sink()
    async with sink as port, WanProxy((LOOP, 0), (LOOP, port), link) as proxy:
        await asyncio.gather(*(send_for(proxy.port, 3.2) for _ in range(n)))
        await wait_for(lambda: len(sink.digests) == n, 5, f"{n} flows' tails at the sink")
    return sink.flows


def goodput_mbit(marks: list[tuple[float, int]], t0: float) -> float:
    """A flow's goodput in Mbit/s from 0.5 s to 3 s after `t0` (past slow start, before the end)."""
    return bytes_between(marks, t0 + 0.5, t0 + 3.0) * 8 / 2.5 / 1e6


async def open_marked(port: int, dscp: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to LOOP:port whose packets carry `dscp` from the handshake on."""
    sock = socket.socket()
    sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (LOOP, port))
    return await asyncio.open_connection(sock=sock)


async def probe_rtts(port: int, count: int, size: int = 64, dscp: int = 0) -> list[float]:
    reader, writer = await open_marked(port, dscp)
    rtts = []
    try:
        for i in range(count):
            payload = i.to_bytes(4, "big") * (size // 4)
            t0 = time.monotonic()
            writer.write(payload)
            echoed = await asyncio.wait_for(reader.readexactly(size), 5)
            rtts.append((time.monotonic() - t0) * 1000.0)
            assert echoed == payload  # in order, not mixed with another probe's bytes
    finally:
        writer.close()
    return rtts


@pytest.fixture
async def echo_port() -> AsyncIterator[int]:
    echo = Echo()
    async with echo as port:
        yield port


@pytest.mark.link_measurement
async def test_small_probe_rtt_median_is_within_1ms_of_configured(echo_port: int) -> None:
    link = Link(delay_ms=15)
    async with WanProxy((LOOP, 0), (LOOP, echo_port), link) as proxy:
        rtts = await probe_rtts(proxy.port, 150)
    median = statistics.median(rtts)
    print(f"RTT median {median:.3f} ms, p10 {sorted(rtts)[15]:.3f}, p90 {sorted(rtts)[135]:.3f}")
    assert_measured(median, 30.0 - 1.0, 30.0 + 1.0, "RTT median (ms)")
    assert min(rtts) >= 30.0 - 0.05  # never early
    # The model recorded the one-way delay each probe got.
    hist = link.a_to_b.counters()["delay"]
    assert hist["count"] == 150 and hist["min_ms"] == pytest.approx(15, abs=1e-6)


@pytest.mark.link_measurement
async def test_jitter_std_matches_the_model_and_nothing_reorders(echo_port: int) -> None:
    link = Link(seed=9, delay_ms=15, jitter_ms=5, jitter_dist="normal")
    async with WanProxy((LOOP, 0), (LOOP, echo_port), link) as proxy:
        rtts = await probe_rtts(proxy.port, 220)  # probe_rtts checks each echo's bytes
    # RTT = two independent one-way jitters: sqrt(2) x the model's per-direction std.
    implied = math.sqrt(2) * implied_jitter_std_ms(5, "normal")
    std = statistics.pstdev(rtts)
    print(f"RTT std {std:.3f} ms vs model {implied:.3f} ms; median {statistics.median(rtts):.2f}")
    assert_measured(std, 0.80 * implied, 1.20 * implied, "RTT std (ms)")
    assert_measured(statistics.median(rtts), 30.0 - 2.5, 30.0 + 2.5, "RTT median (ms)")


async def test_a_stream_under_jitter_arrives_byte_exact() -> None:
    # Thousands of small chunks in flight with 5 ms jitter: any reordering would corrupt it.
    data = hashlib.sha256(b"seed").digest() * (3 * (1 << 20) // 32)
    link = Link(seed=3, delay_ms=10, jitter_ms=5, rate_mbit=400)
    digests = await through_the_proxy(link, data, 4, chunk_bytes=4096)
    assert digests == [hashlib.sha256(data).hexdigest()]
    held = link.a_to_b.counters()
    assert held["packets_in"] >= len(data) // 4096 and held["drops"]["queue_full"] == 0


@pytest.mark.link_measurement
async def test_bulk_transfer_reaches_the_configured_rate() -> None:
    link = Link(delay_ms=5, rate_mbit=200)
    (marks,) = await bulk_flows(link, 1)
    got = goodput_mbit(marks, marks[0][0])
    print(f"bulk goodput {got:.1f} Mbit/s of 200 ({got / 2:.1f}%)")
    assert_measured(got, 0.90 * 200, 1.02 * 200, "bulk goodput (Mbit/s)")
    c = link.a_to_b.counters()
    assert c["drops"]["queue_full"] == 0  # backpressure, not drops: a proxy cannot drop bytes
    # The bottleneck queue filled (the sender outran the link) ...
    assert_measured(c["queue"]["max_bytes"], 0.5 * (1 << 20), math.inf, "queue peak (bytes)")
    # ... and that showed up as queueing delay.
    assert_measured(c["delay"]["max_ms"], 5 + 30, math.inf, "largest delay (ms)")


@pytest.mark.link_measurement
async def test_two_flows_share_the_bottleneck() -> None:
    flows = await bulk_flows(Link(delay_ms=5, rate_mbit=200), 2)
    assert len(flows) == 2
    t0 = max(m[0][0] for m in flows)
    rates = [goodput_mbit(m, t0) for m in flows]
    print(f"two flows: {rates[0]:.1f} + {rates[1]:.1f} Mbit/s")
    assert_measured(sum(rates), 0.90 * 200, 1.02 * 200, "two flows' goodput (Mbit/s)")
    assert_measured(min(rates) / sum(rates), 0.35, 1.0, "the smaller flow's share")


@pytest.mark.link_measurement
async def test_partition_holds_traffic_then_the_same_connection_recovers(echo_port: int) -> None:
    link = Link(delay_ms=5)
    async with WanProxy((LOOP, 0), (LOOP, echo_port), link) as proxy:
        reader, writer = await asyncio.open_connection(LOOP, proxy.port)
        replies: list[tuple[float, int]] = []

        async def read_replies() -> None:
            while len(replies) < 60:
                data = await reader.readexactly(4)
                replies.append((time.monotonic(), int.from_bytes(data, "big")))

        reading = asyncio.create_task(read_replies())
        start = None
        for i in range(60):  # a probe every 50 ms for 3 s; the partition covers 0.5..2.5 s
            if i == 10:
                start = time.monotonic()
                link.partition(start, duration=2.0)
            writer.write(i.to_bytes(4, "big"))
            await asyncio.sleep(0.05)  # paces the probes: the test's clock
        await asyncio.wait_for(reading, 5)
        writer.close()
    heal = start + 2.0
    during = [n for t, n in replies if start + 0.03 < t < heal]
    # Traffic stopped (after what was already in flight, 30 ms of it).
    assert_measured(len(during), 0, 0, "replies inside the partition")
    assert [n for _, n in replies] == list(range(60))  # held, not lost; same connection
    after = [t for t, n in replies if n >= 10]
    assert heal <= after[0]  # nothing before the heal
    assert_measured(after[0] - heal, 0, 0.1, "first reply after the heal (s)")  # right at heal


async def test_reset_connections_sends_rst_and_new_connections_work(echo_port: int) -> None:
    link = Link(delay_ms=2)
    async with WanProxy((LOOP, 0), (LOOP, echo_port), link) as proxy:
        conns = [await asyncio.open_connection(LOOP, proxy.port) for _ in range(2)]
        for reader, writer in conns:
            writer.write(b"ping")
            assert await asyncio.wait_for(reader.readexactly(4), 2) == b"ping"
        assert proxy.reset_connections() == 2
        for reader, _ in conns:
            with pytest.raises(ConnectionResetError):
                await asyncio.wait_for(reader.read(10), 2)
        assert proxy.connections == 0
        for _, writer in conns:
            writer.close()
        assert (await probe_rtts(proxy.port, 3))[0] >= 4.0


async def test_close_is_slow_fin_follows_the_data(echo_port: int) -> None:
    echo = Echo()
    async with echo as port:
        link = Link(delay_ms=40)
        async with WanProxy((LOOP, 0), (LOOP, port), link) as proxy:
            reader, writer = await asyncio.open_connection(LOOP, proxy.port)
            writer.write(b"last words")
            writer.write_eof()
            closed_at = time.monotonic()
            assert await asyncio.wait_for(reader.read(100), 2) == b"last words"
            assert await asyncio.wait_for(reader.read(100), 2) == b""  # echo's FIN, delayed too
            done_at = time.monotonic()
            writer.close()
    assert echo.eof_at and echo.eof_at[0] - closed_at >= 0.040 - 0.001
    assert done_at - closed_at >= 0.080 - 0.002


@pytest.mark.link_measurement
async def test_schedule_rate_collapse_takes_effect_within_50ms() -> None:
    sink = Sink()
    async with sink as port:
        link = Link(delay_ms=5, rate_mbit=200)
        async with WanProxy((LOOP, 0), (LOOP, port), link) as proxy:
            sending = asyncio.create_task(send_for(proxy.port, 2.6))
            await asyncio.sleep(0.2)  # the flow under way before the schedule is loaded
            loaded = time.monotonic()
            link.load_schedule(loaded, [{"at": 1.0, "rate_mbit": 10, "duration": 1.0}])
            await sending
            await wait_for(lambda: sink.digests, 5, "the queued tail to reach the sink")
    (marks,) = sink.flows
    # Delivery at the receiver changes rate one link delay after the step.
    change = loaded + 1.0 + 0.005
    margin = 0.050
    high = bytes_between(marks, change - 0.45, change - margin) * 8 / 0.4 / 1e6
    low = bytes_between(marks, change + margin, change + 0.45) * 8 / 0.4 / 1e6
    print(f"before the step {high:.1f} Mbit/s, after {low:.1f} Mbit/s")
    assert_measured(high, 0.9 * 200, math.inf, "rate before the step (Mbit/s)")
    # +0.4: one 32 KiB chunk of granularity in the 0.4 s window
    assert_measured(low, 0, 1.02 * 10 + 0.4, "rate after the step (Mbit/s)")
    back = loaded + 2.0 + 0.005
    again = bytes_between(marks, back + margin, back + 0.25) * 8 / 0.2 / 1e6
    assert_measured(again, 0.85 * 200, math.inf, "rate after the step ends (Mbit/s)")


async def test_lossy_effects_are_refused_by_the_proxy_shell(echo_port: int) -> None:
    with pytest.raises(ValueError, match="loss_pct=2.0 on a_to_b: the proxy shell"):
        WanProxy((LOOP, 0), (LOOP, echo_port), Link(loss_pct=2))
    link = Link(delay_ms=1)
    async with WanProxy((LOOP, 0), (LOOP, echo_port), link) as proxy:
        for effects in ({"loss_pct": 1}, {"duplicate_pct": 1}, {"reorder_pct": 5}, {"ge_p_pct": 1}):
            with pytest.raises(ValueError, match="cannot lose, duplicate or reorder"):
                link.set(time.monotonic(), **effects)
        with pytest.raises(ValueError, match="not supported"):
            link.chaos(time.monotonic(), "loss-burst", 1.0)
        assert len(await probe_rtts(proxy.port, 3)) == 3


async def test_small_queue_applies_backpressure_without_drops() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB
    link = Link(rate_mbit=50, queue_bytes=20_000)  # smaller than a chunk
    digests = await through_the_proxy(link, data, 6)
    assert digests == [hashlib.sha256(data).hexdigest()]
    c = link.a_to_b.counters()
    assert c["drops"]["queue_full"] == 0 and c["queue"]["max_bytes"] <= 20_000


async def test_unreachable_upstream_closes_the_client() -> None:
    probe = await asyncio.start_server(lambda r, w: None, LOOP, 0)
    dead_port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    async with WanProxy((LOOP, 0), (LOOP, dead_port), Link()) as proxy:
        reader, writer = await asyncio.open_connection(LOOP, proxy.port)
        try:
            assert await asyncio.wait_for(reader.read(10), 2) == b""
        except ConnectionResetError:
            pass
        writer.close()
        assert proxy.upstream_failures == 1


class EchoSmall(LoopbackServer):
    """Echoes every connection except those that open with b"B" (bulk): those it drains."""

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await reader.read(1 << 16)
            if first[:1] == b"B":
                while await reader.read(1 << 16):
                    pass
                return
            data = first
            while data:
                writer.write(data)
                await writer.drain()
                data = await reader.read(1 << 16)
        except ConnectionError:
            pass
        finally:
            writer.close()


@pytest.mark.link_measurement
async def test_a_small_message_waits_behind_the_queue_not_behind_every_bulk_flow() -> None:
    # A router's queue takes a packet in arrival order: a small message (a heartbeat, a
    # HANDOFF) behind bulk flows waits for what is queued ahead of it (at most the buffer),
    # not until it wins a race against each bulk reader for every freed slot.
    rate, queue, delay, flows = 8, 20_000, 5, 3  # Mbit/s, bytes (20 ms at 8 Mbit/s), ms one way
    link = Link(delay_ms=delay, rate_mbit=rate, queue_bytes=queue)
    async with EchoSmall() as port, WanProxy((LOOP, 0), (LOOP, port), link) as proxy:
        bulk = [
            asyncio.create_task(send_for(proxy.port, 3.0, b"B" * (1 << 16))) for _ in range(flows)
        ]
        await asyncio.sleep(0.5)  # the queue is full by now
        rtts = await probe_rtts(proxy.port, 20)
        await asyncio.gather(*bulk)
    packet_ms = 1500 * 8 / (rate * 1e3)
    bound = 2 * delay + queue * 8 / (rate * 1e3) + (flows + 1) * packet_ms + 10  # timers
    print(
        f"probe RTTs behind {flows} bulk flows: median {statistics.median(rtts):.1f}, max {max(rtts):.1f} ms (bound {bound:.1f})"
    )
    assert_measured(max(rtts), 2 * delay, bound, "a small message's RTT behind bulk (ms)")


@pytest.mark.link_measurement
async def test_a_marked_message_in_the_priority_class_does_not_wait_for_the_queue() -> None:
    # The same three bulk flows and 20 ms queue, with the probe's connection marked Expedited
    # Forwarding and the link serving that DSCP first: the probe waits for at most the packet
    # the bucket is paying for, not for the queue (which it waits for unmarked, above).
    rate, queue, delay, flows = 8, 20_000, 5, 3
    link = Link(delay_ms=delay, rate_mbit=rate, queue_bytes=queue, priority_dscp=46)
    async with EchoSmall() as port, WanProxy((LOOP, 0), (LOOP, port), link) as proxy:
        bulk = [
            asyncio.create_task(send_for(proxy.port, 3.0, b"B" * (1 << 16))) for _ in range(flows)
        ]
        await asyncio.sleep(0.5)
        rtts = await probe_rtts(proxy.port, 20, dscp=46)
        await asyncio.gather(*bulk)
    c = link.a_to_b.counters()
    assert c["priority"]["packets"] >= 20 and c["priority"]["bytes"] >= 20 * 64  # classified
    assert c["queue"]["max_bytes"] > queue - 1500  # the bulk flows did fill their queue
    packet_ms = 1500 * 8 / (rate * 1e3)
    bound = 2 * delay + 2 * packet_ms + 8  # timers
    print(f"marked probe RTTs: median {statistics.median(rtts):.1f}, max {max(rtts):.1f} ms")
    assert_measured(max(rtts), 2 * delay, bound, "a marked message's RTT behind bulk (ms)")


async def test_a_connection_takes_the_class_its_client_marked(echo_port: int) -> None:
    link = Link(priority_dscp=46, rate_mbit=100)
    async with WanProxy((LOOP, 0), (LOOP, echo_port), link) as proxy:
        await probe_rtts(proxy.port, 3, dscp=46)
        await probe_rtts(proxy.port, 3, dscp=10)  # another class: best effort here
        await probe_rtts(proxy.port, 3)
    # (bytes, not packets: a connection's FIN crosses in its class too, as a 0-byte item)
    assert link.a_to_b.counters()["priority"]["bytes"] == 3 * 64
    assert link.a_to_b.counters()["bytes_in"] == 9 * 64
    # the echo came back in the class its connection was marked with
    assert link.b_to_a.counters()["priority"]["bytes"] == 3 * 64


async def test_many_flows_through_a_small_queue_lose_no_byte() -> None:
    # Turns in arrival order must never grant room that another reader takes first: the model
    # drops what overflows its queue, and in a byte stream a dropped piece corrupts the stream.
    link = Link(rate_mbit=40, queue_bytes=6_000)
    blobs = [bytes([i]) * 1000 + bytes(range(256)) * (900 + 50 * i) for i in range(6)]
    sink = Sink()
    async with sink as port, WanProxy((LOOP, 0), (LOOP, port), link) as proxy:

        async def send(blob: bytes) -> None:
            _, writer = await asyncio.open_connection(LOOP, proxy.port)
            for i in range(0, len(blob), 7_000):
                writer.write(blob[i : i + 7_000])
                await writer.drain()
            writer.close()

        await asyncio.gather(*(send(b) for b in blobs))
        await wait_for(lambda: len(sink.digests) == len(blobs), 20, "every flow's end")
    assert sorted(sink.digests) == sorted(hashlib.sha256(b).hexdigest() for b in blobs)
    c = link.a_to_b.counters()
    assert c["drops"]["queue_full"] == 0 and c["queue"]["max_bytes"] <= 6_000
