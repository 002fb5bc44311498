"""A lane is alive while its peer is heard from, not only while PONGs come back in time.

Sessions 13-14: on a slow emulated WAN (~2 Mbit/s), P's bulk KV to MD fills the line's bottleneck
queue, and every PING toward MD (P's, RLD's, the router's: they share that direction) waits
behind it for longer than the heartbeat deadline. The dialler then saw no PONG in time and
dropped a lane whose peer was alive and receiving. The rule now (pddnet/roles/peer.py): a
lane is lost only when nothing at all arrived from the peer for the deadline, and the accepting
side beats (PINGs of its own, `beat`, while bytes reach it), so the dialler hears it while its
own PINGs queue.

Here the two ends of such a lane run over the WAN proxy's link model, MD's side as a daemon runs
it (`read_in_order` answers PINGs at once, `beat` beats), with a bulk transfer that keeps the
queue full for several deadlines. The lane must be kept through it, and still be declared lost
within the deadline when MD hangs or the line is cut mid-transfer (within two when only the
direction toward MD is cut); then the same over the daemons themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import aiohttp
import numpy as np
import pytest

from emulation.link import Link
from emulation.proxy import WanProxy
from pddnet.cluster.wan_setup import free_port
from pddnet.protocol import messages as m
from pddnet.protocol.messages import payload_from_array
from pddnet.roles.inbox import read_in_order
from pddnet.roles.peer import Peer, beat
from pddnet.transport import Connection, Server, dial
from tests.polling import wait_for
from tests.test_peer import SECRET, Host

LOOP = "127.0.0.1"
HEARTBEAT_S, DEADLINE_S = 0.1, 0.4
RATE_MBIT, QUEUE_BYTES = 4.0, 512 << 10  # a full queue holds a PING ~1 s: 2.6x the deadline
CHUNK_BYTES, CHUNKS = 64 << 10, 24  # 1.5 MiB of KV: ~3 s on the line, 7 deadlines


class MainDecode:
    """The accepting side of the lanes, as a daemon runs it (roles/common.py): a control lane is
    read by `read_in_order` (PINGs answered at once) and beaten by `beat`; a bulk lane is read to
    its end. `hang()` stops all of it with the sockets left open, as SIGSTOP would."""

    def __init__(self) -> None:
        self.kv_bytes = 0
        self.hung = asyncio.Event()
        self.server: Server | None = None

    def hang(self) -> None:
        self.hung.set()

    async def on_connection(self, conn: Connection) -> None:
        async def nothing(msg: m.Message) -> None:
            pass

        if conn.lane == "bulk":
            work = self._read_kv(conn)
        else:
            work = read_in_order(conn, nothing, lambda msg: None, "md control")
        tasks = [asyncio.ensure_future(work)]
        if conn.lane != "bulk":
            heard = lambda: self.server.last_received  # noqa: E731 - as Daemon._on_connection
            tasks.append(asyncio.ensure_future(beat(conn, HEARTBEAT_S, DEADLINE_S, heard)))
        hung = asyncio.ensure_future(self.hung.wait())
        try:
            await asyncio.wait([tasks[0], hung], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [*tasks, hung]:
                task.cancel()
            await asyncio.gather(*tasks, hung, return_exceptions=True)
        if self.hung.is_set():
            await asyncio.Event().wait()  # hung: nothing read, nothing sent, until closed

    async def _read_kv(self, conn: Connection) -> None:
        async for msg in conn:
            if isinstance(msg, m.KvChunk):
                self.kv_bytes += len(msg.payload)


class PrefillHost(Host):
    """P's side: reads its lane as a daemon does (`read_in_order`: MD's PINGs answered),
    recording each PONG's round trip."""

    def __init__(self) -> None:
        super().__init__()
        self.rtts: list[float] = []

    async def serve(self, conn: Connection) -> None:
        async def nothing(msg: m.Message) -> None:
            pass

        await read_in_order(
            conn, nothing, lambda msg: self.rtts.append(self.peer.pong(msg)), "p control"
        )


def kv_chunk(index: int) -> m.KvChunk:
    arr = np.full((2, 2, CHUNK_BYTES // 256, 2, 8), float(index), dtype=np.float32)  # 256 B/token
    payload, dtype, shape = payload_from_array(arr)
    return m.KvChunk(
        request_id="r-1",
        chunk_index=index,
        token_start=0,
        token_end=arr.shape[2],
        layer_start=0,
        layer_end=2,
        dtype=dtype,
        shape=shape,
        payload=payload,
    )


async def send_kv(port: int) -> None:
    """P's bulk lane to MD: CHUNKS chunks, written as fast as the line takes them."""
    conn = await dial(LOOP, port, role="prefill", instance_id="p", lane="bulk", secret=SECRET)
    try:
        for i in range(CHUNKS):
            await conn.send(kv_chunk(i))
    finally:
        await conn.close()


@contextlib.asynccontextmanager
async def lane_over_a_slow_line():
    """MD behind the WAN proxy's slow link, and P's control lane to it, up: yields (md, the
    proxy's port, the link, P's host, P's peer)."""
    md = MainDecode()
    port = free_port()
    server = Server(
        LOOP,
        port,
        role="main_decode",
        instance_id="md",
        secret=SECRET,
        on_connection=md.on_connection,
    )
    md.server = server
    await server.start()
    link = Link(delay_ms=5.0, rate_mbit=RATE_MBIT, queue_bytes=QUEUE_BYTES)
    host = PrefillHost()
    try:
        async with WanProxy((LOOP, 0), (LOOP, port), link) as proxy:
            host.peer = peer = Peer(
                host.peer_host(),
                (LOOP, proxy.port),
                "main-decode control",
                heartbeat_s=HEARTBEAT_S,
                deadline_s=DEADLINE_S,
                lane="control",
                backoff=(0.05, 0.2),
            )
            peer.start()
            await asyncio.wait_for(peer.up.wait(), 5)
            try:
                yield md, proxy.port, link, host, peer
            finally:
                host.closing = True
                await asyncio.wait_for(peer.close(), 5)
    finally:
        await server.close(grace=1.0)


async def test_a_lane_whose_pings_queue_behind_bulk_kv_is_kept():
    async with lane_over_a_slow_line() as (md, port, _, host, peer):
        started = time.monotonic()
        await asyncio.wait_for(send_kv(port), 30)
        await wait_for(lambda: md.kv_bytes == CHUNKS * CHUNK_BYTES, 30, "all the KV to arrive")
        took = time.monotonic() - started
        assert peer.losses == 0 and peer.alive, peer.last_loss
        assert host.counters["heartbeat_deadlines"] == 0 and host.changes == [True]
        # the transfer kept the queue full for several deadlines, and PINGs did wait in it for
        # longer than the deadline: a PONG-only rule would have dropped the lane
        assert took > 3 * DEADLINE_S, took
        assert max(host.rtts) > DEADLINE_S, host.rtts


async def test_a_peer_that_hangs_mid_transfer_is_still_lost_within_the_deadline():
    async with lane_over_a_slow_line() as (md, port, _, host, peer):
        sending = asyncio.ensure_future(send_kv(port))
        try:
            await wait_for(lambda: md.kv_bytes >= 4 * CHUNK_BYTES, 30, "the transfer to flow")
            md.hang()
            hung_at = time.monotonic()
            # P's own KV still drains into the buffers toward MD meanwhile: no sign of MD
            await wait_for(lambda: peer.losses >= 1, 10, "the hung MD to be declared lost")
            assert time.monotonic() - hung_at < DEADLINE_S + 3 * HEARTBEAT_S + 0.5
            assert peer.last_loss.startswith("heartbeat deadline"), peer.last_loss
            assert host.counters["heartbeat_deadlines"] >= 1
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)


async def test_a_line_cut_mid_transfer_is_still_lost_within_the_deadline():
    async with lane_over_a_slow_line() as (md, port, link, host, peer):
        sending = asyncio.ensure_future(send_kv(port))
        try:
            await wait_for(lambda: md.kv_bytes >= 4 * CHUNK_BYTES, 30, "the transfer to flow")
            link.partition(time.monotonic())  # the proxy's clock: both directions held
            cut_at = time.monotonic()
            await wait_for(lambda: peer.losses >= 1, 10, "the cut lane to be declared lost")
            assert time.monotonic() - cut_at < DEADLINE_S + 3 * HEARTBEAT_S + 0.5
            assert peer.last_loss.startswith("heartbeat deadline"), peer.last_loss
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)


async def test_a_cut_of_the_direction_toward_md_alone_is_still_lost():
    """MD's beats still cross back, but they stop once nothing reaches MD any more: a cut of
    one direction is a loss too, after MD's deadline and then P's."""
    async with lane_over_a_slow_line() as (md, port, link, host, peer):
        sending = asyncio.ensure_future(send_kv(port))
        try:
            await wait_for(lambda: md.kv_bytes >= 4 * CHUNK_BYTES, 30, "the transfer to flow")
            link.blackhole(time.monotonic(), "a_to_b")
            cut_at = time.monotonic()
            await wait_for(lambda: peer.losses >= 1, 10, "the one-way cut to be declared lost")
            assert time.monotonic() - cut_at < 2 * DEADLINE_S + 4 * HEARTBEAT_S + 0.5
            assert peer.last_loss.startswith("heartbeat deadline"), peer.last_loss
        finally:
            sending.cancel()
            await asyncio.gather(sending, return_exceptions=True)


# -- the daemons: P's KV to MD fills the line for longer than the deadline ---------------------

# 4 Mbit/s: a 1000-token prompt's KV (1 KiB a token) needs ~2 s to cross, and every PING toward
# MD waits behind it that long: twice the 1 s deadline. The output outlasts the crossing.
CLUSTER_WAN = {"rtt_ms": 10.0, "jitter_ms": 0.0, "bw_mbit": 4.0}
CLUSTER_OVERRIDES = {
    "policy.pipeline": "p_rld_md",
    "policy.handoff": "one-shot",
    "wan.heartbeat_s": 0.25,
    "wan.heartbeat_deadline_s": 1.0,
}


@pytest.mark.timeout(240)
async def test_a_request_is_handed_off_to_md_across_a_line_its_kv_fills():
    from pddnet.cluster.local import LocalCluster

    rng = random.Random(26)
    body = {
        "model": "tiny",
        "prompt": [256] + [rng.randrange(256) for _ in range(1000)],
        "max_tokens": 3000,
        "ignore_eos": True,
        "temperature": 0.0,
    }
    async with LocalCluster(
        mode="pdd", wan="proxy", **CLUSTER_WAN, overrides=CLUSTER_OVERRIDES
    ) as cluster:
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(cluster.url + "/v1/completions", json=body) as r:
                res = await r.json()
        assert r.status == 200, res
        pdd = res["pdd"]
        brief = {k: pdd.get(k) for k in ("pipeline", "relay_tokens", "main_tokens", "replays")}
        stats = {role: await cluster.stats(role) for role in ("prefill", "relay", "router")}
        losses = {  # every lane each dials (the router's stats count connects instead)
            role: {
                n: p["losses"] if "losses" in p else p["connects"] - 1
                for n, p in s["peers"].items()
            }
            for role, s in stats.items()
        }
        deadlines = {
            role: s.get("counters", s).get("heartbeat_deadlines", 0) for role, s in stats.items()
        }
        # handed off to MD (RLD did not finish alone), and no lane to MD was ever dropped
        assert pdd["relay_tokens"] > 0 and pdd["main_tokens"] > 0, (brief, losses, deadlines)
        assert not pdd.get("replays"), brief
        assert deadlines == dict.fromkeys(stats, 0), deadlines
        assert all(n == 0 for lanes in losses.values() for n in lanes.values()), losses
        assert pdd["wan_kv_bytes"] >= 1000 * 1024, pdd
