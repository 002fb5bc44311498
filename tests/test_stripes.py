"""KV chunks striped over bulk lanes: the lane choice (pure) and real lanes over loopback."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from pddnet.protocol import KvChunk, payload_from_array
from pddnet.transport import Server, dial
from pddnet.transport.stripes import LaneFailed, StripedSender, choose_lane
from tests.polling import wait_for

SECRET = b"stripes-secret"
HOST = "127.0.0.1"


def chunk(i: int, tokens: int = 64) -> KvChunk:
    arr = np.full((2, 2, tokens, 2, 16), float(i), dtype=np.float32)
    payload, dtype, shape = payload_from_array(arr)
    return KvChunk(
        request_id=f"r-{i % 3}",
        chunk_index=i,
        token_start=i * tokens,
        token_end=(i + 1) * tokens,
        layer_start=0,
        layer_end=2,
        dtype=dtype,
        shape=shape,
        payload=payload,
    )


def test_choose_lane_prefers_least_backlog_then_round_robin():
    assert choose_lane([0, 0, 0], 0) == 0
    assert choose_lane([0, 0, 0], 1) == 1
    assert choose_lane([0, 0, 0], 5) == 2
    assert choose_lane([500, 0, 100], 0) == 1
    assert choose_lane([500, 100, 100], 2) == 2
    assert choose_lane([500, 100, 100], 0) == 1
    picks, nxt = [], 0
    for _ in range(6):
        i = choose_lane([0, 0, 0], nxt)
        picks.append(i)
        nxt = i + 1
    assert picks == [0, 1, 2, 0, 1, 2]
    with pytest.raises(ValueError):
        choose_lane([], 0)


class Receiver:
    def __init__(self, close_lane_after: int | None = None) -> None:
        self.by_conn: dict[int, list[KvChunk]] = {}
        self.close_lane_after = close_lane_after
        self.server = Server(
            HOST, 0, role="main_decode", instance_id="md", secret=SECRET, on_connection=self.handle
        )

    async def handle(self, conn) -> None:
        accepted_index = len(self.by_conn)  # lanes are dialled one after another
        got = self.by_conn.setdefault(id(conn), [])
        async for msg in conn:
            got.append(msg)
            if (
                accepted_index == 1
                and self.close_lane_after is not None
                and len(got) >= self.close_lane_after
            ):
                await conn.close("test kills bulk lane 1")
                return

    def received(self) -> list[KvChunk]:
        return [m for msgs in self.by_conn.values() for m in msgs]


async def open_lanes(port: int, n: int):
    return [
        await dial(HOST, port, role="prefill", instance_id="p", lane="bulk", secret=SECRET)
        for _ in range(n)
    ]


async def test_striping_spreads_chunks_across_lanes_and_all_arrive():
    rx = Receiver()
    port = await rx.server.start()
    lanes = await open_lanes(port, 3)
    sender = StripedSender(lanes)
    sent = [chunk(i) for i in range(30)]
    used = [await sender.send(c) for c in sent]
    assert set(used) == {0, 1, 2}
    assert sum(sender.chunks_sent) == 30 and min(sender.chunks_sent) >= 5
    await wait_for(lambda: len(rx.received()) == 30, 3, "the last frames to be read", step=0.01)
    got = sorted(rx.received(), key=lambda m: m.chunk_index)
    assert got == sent  # every chunk arrived intact (payload bytes compared)
    assert len(rx.by_conn) == 3 and all(rx.by_conn.values())
    assert sender.bytes_sent == [n * sent[0].payload.nbytes for n in sender.chunks_sent]
    await sender.close()
    await rx.server.close()


async def test_concurrent_senders_share_lanes():
    rx = Receiver()
    port = await rx.server.start()
    sender = StripedSender(await open_lanes(port, 2))
    sent = [chunk(i, tokens=512) for i in range(20)]
    await asyncio.gather(*(sender.send(c) for c in sent))
    await wait_for(lambda: len(rx.received()) == 20, 3, "the last frames to be read", step=0.01)
    assert sorted(m.chunk_index for m in rx.received()) == list(range(20))
    assert all(n > 0 for n in sender.chunks_sent)
    await sender.close()
    await rx.server.close()


async def test_a_dead_lane_fails_the_transfer():
    rx = Receiver(close_lane_after=1)
    port = await rx.server.start()
    sender = StripedSender(await open_lanes(port, 2))
    with pytest.raises(LaneFailed, match="bulk lane 1") as exc:
        for i in range(500):  # bounded: the peer's close is noticed within a few sends
            await sender.send(chunk(i))
            await asyncio.sleep(0.005)  # paces the sends: the lane's reader runs in between
    assert exc.value.lane_index == 1
    await sender.close()
    await rx.server.close()


async def test_only_bulk_lanes_and_only_kv_chunks():
    rx = Receiver()
    port = await rx.server.start()
    control = await dial(HOST, port, role="prefill", instance_id="p", lane="control", secret=SECRET)
    with pytest.raises(ValueError, match="not a bulk lane"):
        StripedSender([control])
    with pytest.raises(ValueError):
        StripedSender([])
    bulk = await open_lanes(port, 1)
    with pytest.raises(TypeError, match="KV_CHUNK only"):
        await StripedSender(bulk).send("not a chunk")  # type: ignore[arg-type]
    await control.close()
    await bulk[0].close()
    await rx.server.close()
