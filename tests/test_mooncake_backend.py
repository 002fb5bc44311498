"""The mooncake KV backend on the real Mooncake Transfer Engine (protocol tcp over loopback).

In-process: sender and receiver engines in this process, KV written into the receiver's pool
and compared with import_kv's result. Faults: the receiver is a child process that is SIGKILLed
or SIGSTOPped while the sender writes; the write must end in a TransferError within pddnet's
deadline (not the engine's 30 s default) and nothing may stay registered afterwards.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.transfer import ExportedKV, export_kv, import_kv
from pddnet.transport.backends import MooncakeBackend, MooncakeSettings, mooncake_import_error
from pddnet.transport.backends.mooncake import MooncakeRegion
from pddnet.transport.kv_backend import (
    BadRegion,
    PeerUnreachable,
    TransferAborted,
    TransferError,
    TransferTimeout,
    WriteRefused,
    WriteTarget,
)

REASON = mooncake_import_error()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

REPO = Path(__file__).resolve().parents[1]
DEADLINE_S = 3.0
WARMUP_DEADLINE_S = 30.0  # the write before a fault, which sets the session up
# Margin over the deadline for a loaded 2-core machine; the engine default (30 s) is far beyond.
MARGIN_S = 2.5


def settings(**kw) -> MooncakeSettings:
    base = dict(deadline_s=DEADLINE_S, progress_timeout_s=1, abort_grace_s=4.0)
    base.update(kw)
    return MooncakeSettings(**base)


def filled_pool(spec: KVSpec, blocks: int, seed: int) -> KVPool:
    pool = KVPool(spec, blocks)
    g = torch.Generator().manual_seed(seed)
    pool.data.copy_(torch.randn(pool.data.shape, generator=g, dtype=torch.float64))
    return pool


async def test_write_lands_in_the_receivers_blocks_converted_and_reblocked():
    src_spec = KVSpec(3, 2, 8, 4, "float64")
    dst_spec = KVSpec(3, 2, 8, 8, "float32")
    src = filled_pool(src_spec, 40, seed=1)
    dst, ref = KVPool(dst_spec, 20), KVPool(dst_spec, 20)
    rx = await MooncakeBackend.create(settings())
    # A tiny staging buffer and batch limit force the write into several engine calls.
    tx = await MooncakeBackend.create(settings(staging_bytes=8192, max_batch_segments=3))
    try:
        sink = await rx.register(dst)
        assert sink.one_sided and sink.descriptor.startswith("mooncake:127.0.0.1:")
        assert rx.stats()["registered_buffers"] == 1
        writer = await tx.open(sink.descriptor)
        assert tx.stats()["registered_buffers"] == 1  # the staging buffer
        src_table = list(range(30, 40)) + list(range(0, 5))
        dst_table = (7, 3, 11, 12, 0, 19, 5)
        hit = 12  # the receiver holds positions [0, 12): P writes from there on
        xfer = writer.begin("req-1", WriteTarget(dst_table, 8, hit))
        total = 0
        for s, e in ((12, 30), (30, 31), (31, 50)):
            exported = export_kv(src, src_table, s, e)
            import_kv(ref, exported, dst_table)
            total += await xfer.write(exported)
        assert torch.equal(dst.data, ref.data)
        assert xfer.completion().num_chunks == 0
        assert xfer.completion().num_bytes == total == 38 * dst_spec.bytes_per_token
        # The prefix positions below the hit were never written.
        assert torch.count_nonzero(dst.read_tokens(dst_table, 0, hit)) == 0
    finally:
        await tx.close()
        await rx.close()
    assert tx.stats()["registered_buffers"] == 0 and rx.stats()["registered_buffers"] == 0
    assert all(not w._thread.alive for w in tx.writers if w._thread.join(2.0))


async def test_refused_and_aborted_writes_move_nothing():
    spec = KVSpec(2, 1, 4, 4, "float32")
    src = filled_pool(spec, 8, seed=2)
    dst = KVPool(spec, 8)
    rx = await MooncakeBackend.create(settings())
    tx = await MooncakeBackend.create(settings())
    try:
        sink = await rx.register(dst)
        writer = await tx.open(sink.descriptor)
        xfer = writer.begin("req-2", WriteTarget((1, 2, 3), 4, 4))
        with pytest.raises(WriteRefused, match="cached prefix"):
            await xfer.write(export_kv(src, [0, 1, 2], 0, 8))
        with pytest.raises(WriteRefused, match="hold positions"):
            await xfer.write(export_kv(src, [0, 1, 2, 3], 4, 16))
        wrong = KVPool(KVSpec(2, 2, 4, 4, "float32"), 4)
        with pytest.raises(WriteRefused, match="kv heads"):
            await xfer.write(export_kv(wrong, [0, 1, 2], 4, 8))
        assert torch.count_nonzero(dst.data) == 0
        assert await xfer.abort("test") is True
        with pytest.raises(TransferAborted):
            await xfer.write(export_kv(src, [0, 1, 2], 4, 8))
        assert torch.count_nonzero(dst.data) == 0
    finally:
        await tx.close()
        await rx.close()


def test_descriptor_round_trip_and_rejections():
    spec = KVSpec(2, 2, 8, 16, "bfloat16")
    from pddnet.transport.kv_backend import RegionLayout

    region = MooncakeRegion("10.1.2.3", 15123, 0x7F00DEADB000, RegionLayout(spec, 1024))
    text = region.encode()
    assert len(text) <= 128 and MooncakeRegion.parse(text) == region
    for bad in (
        "mooncake:",
        "mooncake:h:0:10:2.2.8.16.bfloat16.4",
        "mooncake:h:1:0:2.2.8.16.bfloat16.4",
        "mooncake:h:1:10:2.2.8.16.float8.4",
        "mooncake:h o:1:10:2.2.8.16.float32.4",
        "shm-name",
    ):
        with pytest.raises(BadRegion):
            MooncakeRegion.parse(bad)


def test_settings_reject_bad_values():
    for kw in (
        {"protocol": "udp"},
        {"local_host": "0.0.0.0"},
        {"progress_timeout_s": 0},
        {"deadline_s": 0},
        {"staging_bytes": 16},
        {"max_batch_segments": 0},
        {"rpc_port_min": 10, "rpc_port_max": 5},
    ):
        with pytest.raises(ValueError):
            MooncakeSettings(**kw)
    env = MooncakeSettings(progress_timeout_s=2, deadline_s=4.5).engine_environment()
    assert env["MC_TCP_PROGRESS_TIMEOUT_SEC"] == "2" and env["MC_TRANSFER_TIMEOUT"] == "5"


async def test_rdma_without_nics_fails_at_start_with_the_reason():
    if any(Path("/sys/class/infiniband").glob("*")):
        pytest.skip("this machine has RDMA devices")
    with pytest.raises(TransferError, match="rdma|initialize"):
        await MooncakeBackend.create(settings(protocol="rdma"))


# -- faults: a receiver in another process ------------------------------------------------------

FAULT_SPEC = KVSpec(4, 4, 64, 16, "float32")  # 8 KiB per position
FAULT_BLOCKS = 256

RECEIVER = f"""
import asyncio, json, sys
import torch
torch.set_num_threads(1)
from pddnet.kv.pool import KVPool, KVSpec
from pddnet.transport.backends import MooncakeBackend, MooncakeSettings

async def main():
    pool = KVPool(KVSpec(**{FAULT_SPEC.to_dict()!r}), {FAULT_BLOCKS})
    backend = await MooncakeBackend.create(MooncakeSettings(progress_timeout_s=1))
    sink = await backend.register(pool)
    print(json.dumps({{"descriptor": sink.descriptor}}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await backend.close()

asyncio.run(main())
"""


class Receiver:
    """A receiving process; ended by the test whatever happens (by its own PID)."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", RECEIVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            text=True,
        )
        line = self.proc.stdout.readline()
        if not line:
            self.end()
            raise RuntimeError("receiver process died before describing its pool")
        self.descriptor = json.loads(line)["descriptor"]

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def end(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(10)


def fault_export():
    src = filled_pool(FAULT_SPEC, 160, seed=3)
    return export_kv(src, list(range(128)), 0, 2048)  # 16 MiB per write


def target() -> WriteTarget:
    return WriteTarget(tuple(range(128, 256)), FAULT_SPEC.block_size, 0)


@contextlib.asynccontextmanager
async def working_session(request_id: str, exported: ExportedKV):
    """A receiver, a sender and one transfer to it whose first write went through, so the
    session works before the fault (that write also sets the session up: on a busy machine
    that alone can outlast the 3 s deadline the faults are measured with)."""
    rx = Receiver()
    tx = await MooncakeBackend.create(settings())
    try:
        writer = await tx.open(rx.descriptor)
        xfer = writer.begin(request_id, target())
        await xfer.write(exported, deadline_s=WARMUP_DEADLINE_S)
        yield rx, tx, writer, xfer
    finally:
        rx.end()
        await tx.close()


async def test_sigkill_of_the_receiver_mid_transfer_is_a_clean_error_within_the_deadline():
    exported = fault_export()
    async with working_session("req-k", exported) as (rx, tx, writer, xfer):
        loop = asyncio.get_running_loop()
        loop.call_later(0.2, rx.signal, signal.SIGKILL)
        started, failed_after = time.monotonic(), None
        for _ in range(400):  # bounded: the kill lands within a few of these writes
            t0 = time.monotonic()
            try:
                await xfer.write(exported)
            except TransferError as exc:
                failed_after = time.monotonic() - t0
                assert isinstance(exc, (PeerUnreachable, TransferTimeout)), exc
                assert exc.backend == "mooncake" and exc.peer == writer.peer
                break
            if time.monotonic() - started > 20:
                break
        assert failed_after is not None, "writes to a killed receiver kept succeeding"
        assert failed_after < DEADLINE_S + MARGIN_S
        assert await xfer.abort("receiver died") is True
    assert tx.stats()["registered_buffers"] == 0 and tx.stats()["stuck_writers"] == 0


async def test_sigstop_of_the_receiver_times_out_then_nothing_stays_registered():
    exported = fault_export()
    async with working_session("req-s", exported) as (rx, tx, writer, xfer):
        rx.signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            await xfer.write(exported)
        assert time.monotonic() - t0 < DEADLINE_S + MARGIN_S
        assert isinstance(info.value, (PeerUnreachable, TransferTimeout))
        rx.signal(signal.SIGCONT)
        rx.end()
        # Once the peer is gone every engine call returns: abort can vouch for the blocks.
        assert await xfer.abort("receiver hung", grace_s=DEADLINE_S + MARGIN_S) is True
    assert writer.released is not None
    writer.released.result(timeout=DEADLINE_S + MARGIN_S)
    assert tx.stats()["registered_buffers"] == 0
    assert writer._thread.join(DEADLINE_S)


async def test_receiver_stopped_before_the_first_write_hangs_the_handshake_not_the_loop():
    exported = fault_export()
    rx = Receiver()
    rx.signal(signal.SIGSTOP)
    tx = await MooncakeBackend.create(settings())
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.05)  # the loop's heartbeat: what the test counts
            ticks += 1

    tick_task = asyncio.create_task(ticker())
    try:
        writer = await tx.open(rx.descriptor)
        xfer = writer.begin("req-h", target())
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            await xfer.write(exported)
        elapsed = time.monotonic() - t0
        assert elapsed < DEADLINE_S + MARGIN_S
        assert ticks >= 5, "the event loop was blocked by the engine call"
        if isinstance(info.value, TransferTimeout):
            # The call is still inside the engine: the next write fails at once, not later.
            t1 = time.monotonic()
            with pytest.raises(PeerUnreachable, match="still stuck"):
                await xfer.write(exported)
            assert time.monotonic() - t1 < 1.0
    finally:
        tick_task.cancel()
        rx.end()
        await tx.close()
    writer.released.result(timeout=30)  # returns once the dead peer's socket is gone
    assert tx.stats()["registered_buffers"] == 0
