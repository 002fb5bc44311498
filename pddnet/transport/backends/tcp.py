"""The `tcp` backend: pddnet's own striped bulk lanes carrying KV_CHUNK frames (the WAN default).

How it maps onto the interface: TCP has no one-sided write, so "write positions [s, e) into
these blocks" becomes KV_CHUNK frames (wan.chunk_tokens positions each, all of the export's
layers) queued on the StripedSender's bulk lanes, each naming the receiver blocks it touches; the
receiver's `TcpSink.receive` checks and imports each frame into its pool (converting dtype and
block size). The descriptor is '' (MD has always answered KV_ALLOC with no region), the sink is
not one-sided, and the completion carries the chunk count so the receiver knows when all are in.
"""

from __future__ import annotations

import asyncio
import math

from pddnet.kv.transfer import ExportedKV, KVExportMeta, import_kv
from pddnet.protocol import KvChunk, payload_from_tensor
from pddnet.transport.kv_backend import (
    KVSink,
    KVTransfer,
    KVWriter,
    PeerUnreachable,
    TrackingBackend,
    TransferAborted,
    TransferError,
    TransferTimeout,
    WriteRefused,
    WriteTarget,
    check_descriptor_for,
)
from pddnet.transport.stripes import LaneFailed, StripedSender

NAME = "tcp"
# A chunk slice bigger than this is made contiguous in a worker thread, not on the event loop.
OFFLOAD_COPY_BYTES = 1 << 20


class TcpSink(KVSink):
    """The receiver's side: KV_CHUNK frames in, checked, imported into the pool."""

    backend = NAME
    one_sided = False

    @property
    def descriptor(self) -> str:
        return ""

    def receive(self, msg: KvChunk, target: WriteTarget) -> int:
        """Check `msg` against the request's target and import it (run it where the pool may be
        written, e.g. the engine thread). Returns the payload bytes; raises WriteRefused."""
        if self.closed:
            raise TransferAborted("tcp sink is closed", backend=NAME)
        spec = self.layout.spec
        target.check(
            msg.token_start, msg.token_end, num_blocks=self.layout.num_blocks, backend=NAME
        )
        bs = target.block_size
        touched = target.block_table[msg.token_start // bs : (msg.token_end - 1) // bs + 1]
        if msg.block_ids and tuple(msg.block_ids) != touched:
            raise WriteRefused(
                f"KV_CHUNK {msg.chunk_index} names blocks {list(msg.block_ids)[:8]}"
                f" but positions [{msg.token_start}, {msg.token_end}) lie in "
                f"{list(touched)[:8]}",
                backend=NAME,
            )
        if msg.layer_end > spec.num_layers or tuple(msg.shape[3:]) != (
            spec.num_kv_heads,
            spec.head_dim,
        ):
            raise WriteRefused(
                f"KV_CHUNK shape {list(msg.shape)} from layer {msg.layer_start} "
                f"does not fit the pool ({spec.num_layers} layers, "
                f"{spec.num_kv_heads} kv heads x {spec.head_dim})",
                backend=NAME,
            )
        meta = KVExportMeta(
            dtype=msg.dtype,
            shape=tuple(msg.shape),
            token_start=msg.token_start,
            token_end=msg.token_end,
            block_size=bs,
            layer_start=msg.layer_start,
        )
        try:
            exported = ExportedKV.from_payload(meta, msg.payload)
            import_kv(self.pool, exported, target.block_table)
        except ValueError as exc:
            raise WriteRefused(f"KV_CHUNK {msg.chunk_index}: {exc}", backend=NAME) from None
        return msg.payload.nbytes

    async def close(self) -> None:
        self.closed = True


class TcpWriter(KVWriter):
    """The sender's side: exports cut into KV_CHUNK frames on the bulk stripes."""

    backend = NAME

    def __init__(
        self, stripes: StripedSender, chunk_tokens: int, deadline_s: float, abort_grace_s: float
    ) -> None:
        peer = stripes.lanes[0].peer_instance
        super().__init__(peer, deadline_s, abort_grace_s)
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.stripes = stripes
        self.chunk_tokens = chunk_tokens

    async def _write(self, transfer: KVTransfer, exported: ExportedKV, deadline_s: float) -> int:
        meta = exported.meta
        bs = transfer.target.block_size
        table = transfer.target.block_table
        layers = meta.shape[0]
        sent = 0
        for s in range(meta.token_start, meta.token_end, self.chunk_tokens):
            if transfer.aborted is not None or self.closed:
                raise self._error(
                    TransferAborted,
                    f"transfer of {transfer.request_id} aborted "
                    f"after {sent} bytes: {transfer.aborted or 'writer closed'}",
                )
            e = min(meta.token_end, s + self.chunk_tokens)
            piece = exported.kv[:, :, s - meta.token_start : e - meta.token_start]
            if piece.numel() * piece.element_size() > OFFLOAD_COPY_BYTES:
                piece = await asyncio.to_thread(piece.contiguous)
            payload, dtype, shape = payload_from_tensor(piece)
            chunk = KvChunk(
                request_id=transfer.request_id,
                chunk_index=transfer.chunks,
                token_start=s,
                token_end=e,
                layer_start=meta.layer_start,
                layer_end=meta.layer_start + layers,
                block_ids=table[s // bs : math.ceil(e / bs)],
                dtype=dtype,
                shape=shape,
                payload=payload,
            )
            try:
                # The deadline is per frame: a lane that takes nothing for that long is hung.
                await asyncio.wait_for(self.stripes.send(chunk), deadline_s)
            except LaneFailed as exc:
                raise self._error(PeerUnreachable, str(exc)) from None
            except asyncio.TimeoutError:
                raise self._error(
                    TransferTimeout,
                    f"KV_CHUNK {chunk.chunk_index} of "
                    f"{transfer.request_id} not taken by the bulk lanes within "
                    f"{deadline_s:g} s",
                ) from None
            transfer.chunks += 1
            sent += payload.nbytes
        return sent

    async def close(self) -> None:
        # The lanes belong to the daemon (they also carry its other requests' chunks).
        self.closed = True


class TcpBackend(TrackingBackend):
    """Receivers need nothing; senders give it their bulk lanes (`stripes`)."""

    name = NAME
    sink_class = TcpSink

    def __init__(
        self,
        stripes: StripedSender | None = None,
        *,
        chunk_tokens: int = 64,
        deadline_s: float = 10.0,
        abort_grace_s: float = 2.0,
    ) -> None:
        super().__init__(deadline_s=deadline_s, abort_grace_s=abort_grace_s)
        self.stripes = stripes
        self.chunk_tokens = chunk_tokens

    async def open(self, descriptor: str) -> TcpWriter:
        check_descriptor_for(NAME, descriptor)
        if self.stripes is None:
            raise TransferError(
                "this tcp backend has no bulk lanes: a sender constructs "
                "TcpBackend(stripes=StripedSender(lanes))",
                backend=NAME,
            )
        return self.track(
            TcpWriter(self.stripes, self.chunk_tokens, self.deadline_s, self.abort_grace_s)
        )
