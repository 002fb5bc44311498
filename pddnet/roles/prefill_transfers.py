"""P's KV transport: one writer per decode target's region, the export thread, and each
request's transfers.

A target's KV goes through the KV backend of its path ([transport] intra_dc for RLD: shm |
mooncake; wan for MD: tcp | mooncake; pddnet.transport.kv_backend): a range is exported (copied
out of P's pool on the export thread, beside the engine: see `export`), then written by the
backend off the engine thread -- one-sided into the target's blocks (shm, mooncake) or as
KV_CHUNK frames on the bulk stripes (tcp). Before any KV_ABORT goes to a target the request's
transfer to it is aborted and quiesced, so no write lands after the receiver may reuse the
blocks (`abort_then`). MD's bulk stripes (the tcp backend's lanes) come and go with its
control lane (`new_stripes`, `drop_stripes`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pddnet.engine.engine import Engine
from pddnet.kv.transfer import ExportedKV, export_kv
from pddnet.lifecycle.actions import PrefillAction, Timeline, Transfer
from pddnet.lifecycle.prefill_request import PrefillRequest, TargetState
from pddnet.protocol import KvAllocResponse
from pddnet.transport import Connection
from pddnet.transport.backends.call_thread import CallThread
from pddnet.transport.kv_backend import (
    BadRegion,
    Completion,
    KVTransfer,
    KVWriter,
    PeerUnreachable,
    TransferError,
    TransferTimeout,
    WriteTarget,
    check_descriptor_for,
)
from pddnet.transport.kv_paths import KVPaths
from pddnet.transport.stripes import StripedSender

from .common import log
from .readiness import Link

LIVE = (TargetState.SHIPPING, TargetState.DONE_QUEUED)  # the targets P still writes to

PATH_OF = {"relay": "intra_dc", "main_decode": "wan"}  # a target's KV path ([transport] key)

Spawn = Callable[[Awaitable[Any], str], Any]


@dataclass
class RequestKV:
    """One request's KV on its way out: where it goes in each target, the transfers."""

    request_id: str
    regions: dict[str, tuple[str, WriteTarget]] = field(default_factory=dict)
    xfers: dict[str, KVTransfer] = field(default_factory=dict)  # per target, once writing
    exporting: int = 0  # exports reading this sequence's blocks right now
    exports_idle: asyncio.Event = field(default_factory=asyncio.Event)

    def completion(self, target: str) -> Completion | None:
        """What went to ``target`` (None: nothing did, all of it was cached there)."""
        xfer = self.xfers.get(target)
        return xfer.completion() if xfer is not None else None

    async def idle(self) -> None:
        """Until no export reads the request's blocks (they may then be freed)."""
        if self.exporting:
            await self.exports_idle.wait()


class PrefillTransfers:
    def __init__(
        self, instance_id: str, targets: tuple[str, ...], spawn: Spawn, counters: Counter[str]
    ) -> None:
        self.instance_id = instance_id
        self.kv_paths: KVPaths | None = None  # set by the daemon's start
        # per target: the receiver's region descriptor and our writer to it (one at a time)
        self.writers: dict[str, tuple[str, KVWriter]] = {}
        self.stripes: StripedSender | None = None  # the WAN lanes that carry KV_CHUNK to MD
        self._locks = {t: asyncio.Lock() for t in targets}
        self._spawn = spawn
        self._counters = counters
        # KV exports run here, not in the engine thread, so a finished prefill's copy to RLD
        # does not wait behind the next request's prefill step (see export)
        self._exporter = CallThread(f"{instance_id}-export")

    def new_stripes(self, lanes: list[Connection]) -> None:
        """MD's bulk lanes were (re)dialled: the tcp backend's writers carry KV on them."""
        old, self.stripes = self.stripes, StripedSender(lanes)
        wan = self.kv_paths.backend("wan") if self.kv_paths is not None else None
        if wan is not None and wan.name == "tcp":
            wan.stripes = self.stripes
            self.forget_writer("main_decode")
        if old is not None:
            self._spawn(old.close(), "close old stripes")

    def bulk_link(self, md: Link) -> Link:
        """MD's bulk stripes: up while its control lane is and they are alive."""
        up = md.up and self.stripes is not None and self.stripes.alive
        return Link(up, md.since, "" if up else md.detail or "not dialled yet")

    def drop_stripes(self) -> None:
        """MD's control lane is gone: its bulk lanes go with it."""
        if self.stripes is not None:
            stripes, self.stripes = self.stripes, None
            self._spawn(stripes.close(), "close stripes")

    def accept(self, kv: RequestKV, target: str, msg: KvAllocResponse, num_tokens: int) -> str:
        """Record ``target``'s allocation; a reason when P cannot write into it."""
        if len(msg.block_ids) * msg.block_size < num_tokens:
            return f"{len(msg.block_ids)} blocks of {msg.block_size} cannot hold {num_tokens} positions"
        try:
            assert self.kv_paths is not None
            check_descriptor_for(self.kv_paths.name(PATH_OF[target]), msg.region)
            kv.regions[target] = (msg.region, WriteTarget.from_alloc(msg))
        except (BadRegion, ValueError) as exc:
            return str(exc)
        return ""

    async def ship(
        self, kv: RequestKV, m: PrefillRequest, a: Transfer, engine: Engine
    ) -> list[PrefillAction]:
        """Run the machine's Transfer: positions [a.start, a.end) to ``a.target``, unless the
        request is over or the target was left out meanwhile (it was told KV_ABORT). Gives the
        actions to run next (the timeline of the transport used; a failure's fallback)."""

        def wanted() -> bool:
            return not m.over and m.state(a.target) in LIVE

        out: list[PrefillAction] = []
        try:
            xfer = kv.xfers.get(a.target)
            if xfer is None:
                region = kv.regions.get(a.target)
                if region is None or not wanted():
                    return out
                writer = await self._writer(a.target, region[0])
                if not wanted():
                    return out
                xfer = kv.xfers[a.target] = writer.begin(kv.request_id, region[1])
                out.append(Timeline("kv_transport", None, f"{a.target}={writer.backend}"))
            exported = await self.export(kv, engine, a.start, a.end)
            if wanted():
                written = await xfer.write(exported)
                self._counters[f"kv_bytes_{PATH_OF[a.target]}"] += written
                m.kv_written(a.target, written)
        except TransferError as exc:  # the receiver is dead, hung, or refused it
            self._counters[f"transfer_errors_{PATH_OF[a.target]}"] += 1
            xfer = kv.xfers.get(a.target)
            if isinstance(exc, (PeerUnreachable, TransferTimeout)) and xfer is not None:
                self.forget_writer(a.target, xfer.writer)  # the peer is gone: do not reuse it
            why = f"KV transfer to {a.target} failed ({type(exc).__name__}): {exc}"
            out.append(Timeline("kv_transfer_failed", None, why[:256]))
            out += m.transfer_failed(a.target, why)
        return out

    def stop(self, kv: RequestKV, target: str, reason: str) -> None:
        """Stop the request's writes to ``target`` (its peer is gone: nothing to tell it)."""
        xfer = kv.xfers.get(target)
        if xfer is not None:
            self._spawn(xfer.abort(reason), f"abort {kv.request_id} -> {target}")

    def abort_then(self, kv: RequestKV, target: str, reason: str, post: Callable[[], None]) -> None:
        """``post`` (the KV_ABORT) once the request's writes to ``target`` have stopped."""
        xfer = kv.xfers.get(target)
        if xfer is None:
            post()
            return

        async def abort() -> None:
            if not await xfer.abort(reason):
                self._counters["abort_not_quiescent"] += 1
                log.warning(
                    "%s: %s: a write to %s is still stuck in the engine after the abort grace",
                    self.instance_id,
                    kv.request_id,
                    target,
                )
            post()

        self._spawn(abort(), f"abort {kv.request_id} -> {target}")

    async def export(self, kv: RequestKV, engine: Engine, start: int, end: int) -> ExportedKV:
        """The KV of positions [start, end) of P's sequence (a copy the backend then writes).

        Not in the engine thread: there it would wait for the step running at that moment --
        typically the next request's whole prefill, seconds on a CPU -- before RLD could have
        its copy and emit the first token. Reading the pool beside a step is safe because the
        positions are computed (the engine never writes them again), a live sequence's block
        table only grows, and its blocks stay referenced until P releases them, which waits
        for the request's exports to end (`RequestKV.idle`)."""
        seq = engine.get_sequence(kv.request_id)
        table = list(seq.block_table)  # append-only while the sequence lives: a safe snapshot
        kv.exporting += 1
        kv.exports_idle.clear()
        try:
            return await asyncio.wrap_future(
                self._exporter.submit(export_kv, engine.pool, table, start, end)
            )
        finally:
            kv.exporting -= 1
            if not kv.exporting:
                kv.exports_idle.set()

    async def _writer(self, target: str, descriptor: str) -> KVWriter:
        """The writer to a target's region, opened once per descriptor (a receiver that
        restarted describes a new region: the old writer is closed)."""
        async with self._locks[target]:
            cached = self.writers.get(target)
            if cached is not None and cached[0] == descriptor and not cached[1].closed:
                return cached[1]
            self.forget_writer(target)
            assert self.kv_paths is not None
            writer = await self.kv_paths.open(PATH_OF[target], descriptor)
            self.writers[target] = (descriptor, writer)
            return writer

    def forget_writer(self, target: str, writer: KVWriter | None = None) -> None:
        cached = self.writers.get(target)
        if cached is not None and (writer is None or cached[1] is writer):
            del self.writers[target]
            self._spawn(cached[1].close(), f"close {target} writer")

    def stats(self, out: dict[str, Any], wire_scale: float | None) -> None:
        """The daemon's stats gain the WAN bytes, the backends' and the bulk stripes' figures;
        with ``wire_scale`` (an emulated device) also what the target model's KV bytes would
        have been."""
        sent = {
            lane: out["lanes"].get(lane, {}).get("bytes_out", 0) for lane in ("bulk", "control")
        }
        out["wan_bytes"] = {"out": {"kv": sent["bulk"], "control": sent["control"]}}
        if self.kv_paths is not None:
            out["transport"] = {
                path: {**st, "target": target, "writer_open": target in self.writers}
                for target, path in PATH_OF.items()
                if (st := self.kv_paths.stats().get(path)) is not None
            }
        if self.stripes is not None:
            out["lanes"]["bulk"] = {
                "bytes_out": sum(sum(c.stats["bytes_out"].values()) for c in self.stripes.lanes),
                "chunks": sum(self.stripes.chunks_sent),
            }
        if wire_scale is not None:
            kv = out["lanes"].get("bulk", {}).get("bytes_out", 0)
            out["wan_bytes"]["out"]["kv_target"] = round(kv / wire_scale)

    async def close(self) -> None:
        self._exporter.stop()  # after the exports already queued (each a bounded copy)
        await asyncio.to_thread(self._exporter.join, 5.0)
        self.writers.clear()
        if self.kv_paths is not None:
            await self.kv_paths.close()  # its writers first (bounded), then the engines
        if self.stripes is not None:
            await self.stripes.close()
