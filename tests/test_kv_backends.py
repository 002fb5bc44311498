"""The KV transport interface: the sans-IO write plan, and the shm and tcp backends for real.

The oracle everywhere is pddnet.kv.transfer.import_kv: whatever a backend does, the receiver's
pool must end up exactly as if the export had been imported into it directly.
"""

from __future__ import annotations

import math
import os
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.shm import unique_segment_name
from pddnet.kv.transfer import export_kv, import_kv
from pddnet.transport import Server, dial
from pddnet.transport.backends import CallThread, CallTimedOut, create_backend
from pddnet.transport.kv_backend import (
    BadRegion,
    PeerUnreachable,
    RegionLayout,
    TransferAborted,
    TransferError,
    WriteRefused,
    WriteTarget,
    backend_of_descriptor,
    check_descriptor_for,
    plan_write,
)
from pddnet.transport.stripes import StripedSender
from tests.polling import wait_for

SECRET = b"kv-backend-secret"


def filled_pool(spec: KVSpec, blocks: int, seed: int, shm_name: str | None = None) -> KVPool:
    pool = KVPool(spec, blocks, shm_name=shm_name)
    g = torch.Generator().manual_seed(seed)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g, dtype=torch.float64))
    return pool


def apply_plan(pool: KVPool, exported, target: WriteTarget) -> None:
    """What a raw-byte engine does with the plan: copy each segment, nothing else."""
    spec = pool.spec
    src = exported.kv.to(spec.torch_dtype).contiguous().view(-1).view(torch.uint8)
    raw = pool.raw_bytes()
    meta = exported.meta
    for seg in plan_write(
        RegionLayout.of_pool(pool),
        target,
        meta.token_start,
        meta.num_tokens,
        meta.layer_start,
        meta.shape[0],
    ):
        raw[seg.dst : seg.dst + seg.length].copy_(src[seg.src : seg.src + seg.length])


# -- the plan (sans-IO) --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_plan_write_moves_exactly_what_import_kv_moves(data):
    layers = data.draw(st.integers(1, 3))
    heads, dim = data.draw(st.integers(1, 2)), data.draw(st.sampled_from([2, 4]))
    src_bs, dst_bs = data.draw(st.sampled_from([1, 2, 4])), data.draw(st.sampled_from([1, 3, 4]))
    dtype = data.draw(st.sampled_from(["float32", "float64", "bfloat16"]))
    n_pos = data.draw(st.integers(1, 24))
    src = filled_pool(
        KVSpec(layers, heads, dim, src_bs, "float64"),
        math.ceil(n_pos / src_bs) + 2,
        seed=data.draw(st.integers(0, 99)),
    )
    dst_spec = KVSpec(layers, heads, dim, dst_bs, dtype)
    dst_blocks = math.ceil(n_pos / dst_bs) + 3
    dst, ref = KVPool(dst_spec, dst_blocks), KVPool(dst_spec, dst_blocks)
    src_table = list(range(src.num_blocks))[: math.ceil(n_pos / src_bs)]
    dst_table = tuple(data.draw(st.permutations(range(dst_blocks))))[: math.ceil(n_pos / dst_bs)]
    hit = data.draw(st.integers(0, n_pos - 1))
    start = data.draw(st.integers(hit, n_pos - 1))
    end = data.draw(st.integers(start + 1, n_pos))
    l0 = data.draw(st.integers(0, layers - 1))
    l1 = data.draw(st.integers(l0 + 1, layers))
    exported = export_kv(src, src_table, start, end, l0, l1)
    target = WriteTarget(dst_table, dst_bs, hit)
    apply_plan(dst, exported, target)
    import_kv(ref, exported, dst_table)
    assert torch.equal(dst.data.view(torch.uint8), ref.data.view(torch.uint8))


def test_plan_write_merges_consecutive_blocks_into_one_run():
    spec = KVSpec(1, 1, 4, 4, "float32")
    layout = RegionLayout(spec, 16)
    segs = plan_write(layout, WriteTarget((5, 6, 7, 2), 4), 0, 16)
    # Per (layer, K/V): blocks 5-7 are one run, block 2 another.
    assert [s.length for s in segs] == [3 * 64, 64, 3 * 64, 64]
    assert segs[0].dst == layout.offset(0, 0, 5) and segs[2].dst == layout.offset(0, 1, 5)


def test_plan_write_refuses_with_precise_reasons_and_one_error_family():
    layout = RegionLayout(KVSpec(2, 1, 4, 4, "float32"), 8)
    target = WriteTarget((1, 2, 9), 4, writable_from=4)
    cases = [
        ((0, 8), "cached prefix"),
        ((4, 20), "hold positions"),
        ((8, 4), "block\\(s\\) \\[9\\]"),
    ]
    for (start, n), why in cases:
        with pytest.raises(WriteRefused, match=why):
            plan_write(layout, target, start, n)
    with pytest.raises(WriteRefused, match="layers"):
        plan_write(layout, WriteTarget((1, 2), 4), 0, 4, layer_start=1, num_layers=2)
    with pytest.raises(BadRegion, match="block size"):
        plan_write(layout, WriteTarget((1, 2), 8), 0, 4)
    for cls in (WriteRefused, BadRegion, PeerUnreachable, TransferAborted):
        assert issubclass(cls, TransferError)
    with pytest.raises(ValueError, match="writable_from"):
        WriteTarget((1,), 4, writable_from=5)


def test_layout_and_descriptor_routing():
    layout = RegionLayout(KVSpec(4, 2, 64, 16, "bfloat16"), 512)
    assert RegionLayout.decode(layout.encode()) == layout
    for bad in ("4.2.64.16.bfloat16", "4.2.64.16.int3.5", "a.b.c.d.float32.1"):
        with pytest.raises(ValueError):
            RegionLayout.decode(bad)
    assert backend_of_descriptor("") == "tcp"
    assert backend_of_descriptor("pdd-relay-kv") == "shm"
    assert backend_of_descriptor("mooncake:h:1:10:1.1.1.1.float32.1") == "mooncake"
    with pytest.raises(BadRegion, match="configured for mooncake"):
        check_descriptor_for("mooncake", "pdd-relay-kv")
    with pytest.raises(ValueError, match="unknown KV backend"):
        check_descriptor_for("rdma", "")


# -- the call thread -----------------------------------------------------------------------------


async def test_call_thread_deadline_cancels_queued_calls_and_reports_running_ones():
    thread = CallThread("test-calls")
    release = threading.Event()
    ran: list[str] = []
    try:
        with pytest.raises(CallTimedOut, match="still running") as stuck:
            await thread.call(release.wait, 10.0, timeout=0.1, what="stuck call")
        with pytest.raises(CallTimedOut, match="never started") as queued:
            await thread.call(ran.append, "queued", timeout=0.1, what="queued call")
        assert thread.busy and queued.value.future.cancelled()
        release.set()
        assert stuck.value.future.result(timeout=5) is True
        assert await thread.call(ran.append, "after", timeout=5) is None
        assert ran == ["after"]  # the cancelled call never ran
        with pytest.raises(ZeroDivisionError):
            await thread.call(lambda: 1 / 0, timeout=5)
    finally:
        release.set()
        thread.stop()
    assert thread.join(5)


# -- shm -----------------------------------------------------------------------------------------


async def test_shm_backend_writes_into_the_receivers_shared_blocks():
    spec = KVSpec(2, 2, 4, 4, "float32")
    src = filled_pool(KVSpec(2, 2, 4, 2, "float64"), 20, seed=5)
    name = unique_segment_name("test-kvb")
    dst = KVPool(spec, 12, shm_name=name)
    ref = KVPool(spec, 12)
    backend = await create_backend("shm")
    try:
        sink = await backend.register(dst)
        assert sink.descriptor == dst.shm_name and sink.one_sided
        writer = await backend.open(sink.descriptor)
        table = (3, 8, 1, 0, 11)
        xfer = writer.begin("r-shm", WriteTarget(table, 4, writable_from=6))
        exported = export_kv(src, list(range(10)), 6, 19)
        import_kv(ref, exported, table)
        n = await xfer.write(exported)
        assert n == 13 * spec.bytes_per_token == xfer.completion().num_bytes
        assert torch.equal(dst.data, ref.data)
        before = dst.data.clone()
        with pytest.raises(WriteRefused):
            await xfer.write(export_kv(src, list(range(10)), 2, 8))
        with pytest.raises(WriteRefused, match="hold positions"):
            await xfer.write(export_kv(src, list(range(12)), 6, 24))
        assert torch.equal(dst.data, before)
        assert await xfer.abort("cancelled") is True
        with pytest.raises(TransferAborted, match="cancelled"):
            await xfer.write(exported)
        with pytest.raises(BadRegion, match="shared memory"):
            await backend.register(KVPool(spec, 2))
    finally:
        await backend.close()
        dst.close()
    assert not os.path.exists(f"/dev/shm/{name}")
    with pytest.raises(PeerUnreachable, match="cannot map"):
        await (await create_backend("shm")).open(name)


# -- tcp -----------------------------------------------------------------------------------------


class ChunkReceiver:
    """MD's side in miniature: every KV_CHUNK goes through the sink into the pool."""

    def __init__(self, sink, target: WriteTarget) -> None:
        self.sink, self.target = sink, target
        self.chunks: list[int] = []
        self.errors: list[str] = []
        self.server = Server(
            "127.0.0.1",
            0,
            role="main_decode",
            instance_id="md",
            secret=SECRET,
            on_connection=self.handle,
        )

    async def handle(self, conn) -> None:
        async for msg in conn:
            try:
                self.chunks.append(self.sink.receive(msg, self.target))
            except TransferError as exc:
                self.errors.append(str(exc))


async def test_tcp_backend_stripes_chunks_that_the_sink_imports():
    spec = KVSpec(2, 1, 8, 4, "float32")
    src = filled_pool(KVSpec(2, 1, 8, 4, "float64"), 16, seed=7)
    dst, ref = KVPool(spec, 16), KVPool(spec, 16)
    table = (9, 4, 5, 6, 15, 0, 1, 2)
    target = WriteTarget(table, 4, writable_from=5)
    rx_backend = await create_backend("tcp")
    sink = await rx_backend.register(dst)
    assert sink.descriptor == "" and not sink.one_sided
    rx = ChunkReceiver(sink, target)
    port = await rx.server.start()
    lanes = [
        await dial("127.0.0.1", port, role="prefill", instance_id="p", lane="bulk", secret=SECRET)
        for _ in range(3)
    ]
    stripes = StripedSender(lanes)
    tx_backend = await create_backend("tcp", stripes=stripes, chunk_tokens=5)
    try:
        writer = await tx_backend.open("")
        xfer = writer.begin("r-tcp", target)
        total = 0
        for s, e in ((5, 17), (17, 30)):
            exported = export_kv(src, list(range(8)), s, e)
            import_kv(ref, exported, table)
            total += await xfer.write(exported)
        done = xfer.completion()
        assert done.num_chunks == 3 + 3 == len(set(range(done.num_chunks)))
        await wait_for(lambda: len(rx.chunks) == done.num_chunks, 4, "the last frames", step=0.02)
        assert rx.errors == [] and sum(rx.chunks) == done.num_bytes == total
        assert torch.equal(dst.data, ref.data)
        with pytest.raises(BadRegion, match="configured for tcp"):
            await tx_backend.open("pdd-some-shm")
        # The receiver's checks: a chunk naming foreign blocks is refused, the pool unchanged.
        before = dst.data.clone()
        bad = WriteTarget((3, 3, 3, 3, 3, 3, 3, 3), 4, writable_from=5)
        rogue = writer.begin("r-rogue", bad)
        await rogue.write(export_kv(src, list(range(8)), 8, 12))
        await wait_for(lambda: rx.errors, 4, "the receiver to refuse the chunk", step=0.02)
        assert rx.errors and "names blocks" in rx.errors[0]
        assert torch.equal(dst.data, before)
        # A dead lane is the same error family as any backend's dead peer.
        await rx.server.close()
        await wait_for(
            lambda: any(lane.peer_closed for lane in lanes), 4, "a lane to see the close", step=0.02
        )
        with pytest.raises(PeerUnreachable):
            await xfer.write(export_kv(src, list(range(8)), 5, 9))
    finally:
        await stripes.close()
        await tx_backend.close()
        await rx_backend.close()
        await rx.server.close()


async def test_tcp_sender_without_lanes_says_how_to_build_one():
    backend = await create_backend("tcp")
    with pytest.raises(TransferError, match="StripedSender"):
        await backend.open("")
    with pytest.raises(ValueError, match="unknown KV backend"):
        await create_backend("carrier-pigeon")
