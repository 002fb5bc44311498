"""One interface for moving a request's KV into a receiver's pool, whatever carries the bytes.

Both KV paths (P -> RLD inside a datacenter, P -> MD over the WAN) go through it:

    # receiver (RLD, MD), once its engine's pool exists
    sink = await backend.register(engine.pool)            # the destination region
    KvAllocResponse(..., region=sink.descriptor)           # tells the sender where to write

    # sender (P), per destination, then per request
    writer = await backend.open(alloc_response.region)     # cached by the daemon
    xfer = writer.begin(request_id, WriteTarget.from_alloc(alloc_response))
    await xfer.write(export_kv(pool, table, start, end))   # one-sided write of positions
    c = xfer.completion()                                   # -> KvDone(num_chunks=c.num_chunks,
                                                            #           num_bytes=c.num_bytes)
    await xfer.abort(reason)                                # before KV_ABORT: no write lands later

The completion notice (KV_DONE) and the abort (KV_ABORT) stay on pddnet's control lane; a
backend only moves bytes. Every failure is a `TransferError` (subclasses say which kind), so the
daemons handle one exception family whichever backend is underneath.

What the sender needs to address the receiver's blocks is sans-IO and lives here: the pool's
`RegionLayout` (pool.py explains why a block range is a handful of contiguous byte runs), the
request's `WriteTarget` (its block table and the cached prefix that is not writable) and
`plan_write`, which turns "positions [s, e) of these layers" into (source, destination, length)
byte segments. Backends that write raw bytes (mooncake) send exactly those segments.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from pddnet.kv.pool import KVSpec, dtype_name

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.device.line import ModelledLine
    from pddnet.kv.pool import KVPool
    from pddnet.kv.transfer import ExportedKV
    from pddnet.protocol import KvAllocResponse

BACKEND_NAMES = ("shm", "tcp", "mooncake")
MOONCAKE_SCHEME = "mooncake:"


# -- errors --------------------------------------------------------------------------------------


class TransferError(RuntimeError):
    """A KV transfer failed; `backend` and `peer` say where. The daemons catch this family only."""

    def __init__(self, message: str, *, backend: str = "", peer: str = "") -> None:
        super().__init__(message)
        self.backend = backend
        self.peer = peer


class BackendUnavailable(TransferError):
    """The backend cannot run here (e.g. the mooncake package or libibverbs1 is missing)."""


class BadRegion(TransferError):
    """A region descriptor is malformed, names nothing, or does not fit the data sent."""


class WriteRefused(TransferError):
    """A write outside the request's own blocks, below its cached prefix or past its table."""


class PeerUnreachable(TransferError):
    """The receiver is dead, refused us, or its link broke."""


class TransferTimeout(TransferError):
    """A write did not finish within pddnet's deadline (a hung peer)."""


class TransferAborted(TransferError):
    """The transfer (or its writer) was aborted or closed before this write."""


# -- addressing (sans-IO) ------------------------------------------------------------------------


_LAYOUT_RE = re.compile(
    r"^(\d{1,5})\.(\d{1,5})\.(\d{1,6})\.(\d{1,6})\.([a-z0-9]{1,10})\.(\d{1,10})$"
)


@dataclass(frozen=True)
class RegionLayout:
    """Where each (layer, K/V, block, offset) of a receiver's pool lies in its bytes."""

    spec: KVSpec
    num_blocks: int

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks <= 0:
            raise ValueError(f"a region needs a positive block count, got {self.num_blocks!r}")

    @classmethod
    def of_pool(cls, pool: KVPool) -> RegionLayout:
        return cls(pool.spec, pool.num_blocks)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.spec.bytes_per_block

    def offset(self, layer: int, kv: int, block: int, position_in_block: int = 0) -> int:
        """Byte offset of one token row, relative to the pool's data (see KVPool's layout)."""
        s = self.spec
        return (
            ((layer * 2 + kv) * self.num_blocks + block) * s.block_size + position_in_block
        ) * s.token_bytes_per_layer_kv

    def encode(self) -> str:
        """Compact text form for a region descriptor: layers.heads.dim.block_size.dtype.blocks."""
        s = self.spec
        return (
            f"{s.num_layers}.{s.num_kv_heads}.{s.head_dim}.{s.block_size}.{s.dtype}."
            f"{self.num_blocks}"
        )

    @classmethod
    def decode(cls, text: str) -> RegionLayout:
        m = _LAYOUT_RE.match(text)
        if not m:
            raise ValueError(
                f"bad region layout {text!r}: expected layers.heads.dim.block_size.dtype.blocks"
            )
        layers, heads, dim, bs, dtype, blocks = m.groups()
        spec = KVSpec(
            num_layers=int(layers),
            num_kv_heads=int(heads),
            head_dim=int(dim),
            block_size=int(bs),
            dtype=dtype_name(dtype),
        )
        return cls(spec, int(blocks))


@dataclass(frozen=True)
class WriteTarget:
    """Where one request's KV goes in the receiver's pool (from its KV_ALLOC_RESPONSE).

    `block_table[i]` holds positions [i*block_size, (i+1)*block_size) at the receiver's block
    size; positions below `writable_from` (the receiver's prefix-cache hit) may sit in shared
    blocks and are never written, so only the blocks from `writable_from // block_size` on are
    this request's to write -- like an RDMA memory key scoped to one request.
    """

    block_table: tuple[int, ...]
    block_size: int
    writable_from: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_table", tuple(int(b) for b in self.block_table))
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if not 0 <= self.writable_from <= self.capacity:
            raise ValueError(
                f"writable_from {self.writable_from} outside the table's "
                f"positions [0, {self.capacity}]"
            )

    @classmethod
    def from_alloc(cls, msg: KvAllocResponse) -> WriteTarget:
        return cls(tuple(msg.block_ids), msg.block_size, msg.hit_tokens)

    @property
    def capacity(self) -> int:
        return len(self.block_table) * self.block_size

    @property
    def own_blocks(self) -> tuple[int, ...]:
        return self.block_table[self.writable_from // self.block_size :]

    def check(
        self,
        start: int,
        end: int,
        *,
        num_blocks: int | None = None,
        backend: str = "",
        peer: str = "",
    ) -> None:
        """Raise WriteRefused unless positions [start, end) may be written."""

        def refuse(why: str) -> WriteRefused:
            return WriteRefused(
                f"write of positions [{start}, {end}) refused: {why}", backend=backend, peer=peer
            )

        if start < 0 or end < start:
            raise refuse("not a position range")
        if start < self.writable_from:
            raise refuse(f"positions below {self.writable_from} are the receiver's cached prefix")
        if end > self.capacity:
            raise refuse(
                f"the table's {len(self.block_table)} blocks of {self.block_size} hold "
                f"positions [0, {self.capacity})"
            )
        if end == start or num_blocks is None:
            return
        touched = self.block_table[start // self.block_size : (end - 1) // self.block_size + 1]
        outside = sorted({b for b in touched if not 0 <= b < num_blocks})
        if outside:
            raise refuse(f"block(s) {outside[:8]} outside the region's {num_blocks} blocks")


@dataclass(frozen=True)
class Segment:
    """Copy `length` bytes from offset `src` of the source tensor to offset `dst` of the pool."""

    src: int
    dst: int
    length: int


def plan_write(
    layout: RegionLayout,
    target: WriteTarget,
    token_start: int,
    num_tokens: int,
    layer_start: int = 0,
    num_layers: int | None = None,
) -> list[Segment]:
    """Byte segments that move a C-contiguous [layers, 2, num_tokens, heads, dim] tensor in the
    layout's dtype into positions token_start.. of `target`. Checked first (WriteRefused)."""
    spec = layout.spec
    if target.block_size != spec.block_size:
        raise BadRegion(
            f"the request's block size {target.block_size} differs from the "
            f"region's {spec.block_size}"
        )
    layers = spec.num_layers - layer_start if num_layers is None else num_layers
    if layer_start < 0 or layers <= 0 or layer_start + layers > spec.num_layers:
        raise WriteRefused(
            f"layers [{layer_start}, {layer_start + layers}) outside the region's {spec.num_layers}"
        )
    end = token_start + num_tokens
    target.check(token_start, end, num_blocks=layout.num_blocks)
    row = spec.token_bytes_per_layer_kv
    bs = spec.block_size
    segments: list[Segment] = []
    for li in range(layers):
        for kv in (0, 1):
            src_base = (li * 2 + kv) * num_tokens * row
            pos = token_start
            while pos < end:
                run = min(bs - pos % bs, end - pos)
                dst = layout.offset(layer_start + li, kv, target.block_table[pos // bs], pos % bs)
                src = src_base + (pos - token_start) * row
                last = segments[-1] if segments else None
                if (
                    last is not None
                    and last.src + last.length == src
                    and last.dst + last.length == dst
                ):  # consecutive blocks: one run
                    segments[-1] = Segment(last.src, last.dst, last.length + run * row)
                else:
                    segments.append(Segment(src, dst, run * row))
                pos += run
    return segments


def backend_of_descriptor(descriptor: str) -> str:
    """Which backend a receiver's region descriptor (KV_ALLOC_RESPONSE.region) belongs to:
    '' -> tcp (the receiver imports KV_CHUNK frames itself), 'mooncake:...' -> mooncake,
    anything else -> shm (a shared-memory pool name, as RLD has always sent)."""
    if descriptor == "":
        return "tcp"
    if descriptor.startswith(MOONCAKE_SCHEME):
        return "mooncake"
    return "shm"


# -- the interface -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completion:
    """What KV_DONE reports: chunks the receiver must have seen (0 for one-sided writes) and
    bytes moved (what the receiver counts for two-sided, what landed in its pool otherwise)."""

    num_chunks: int
    num_bytes: int


class KVSink(ABC):
    """A receiver's pool registered with a backend: the destination region."""

    backend: str = ""
    #: True: the sender's writes land in the pool by themselves and KV_DONE means "all in";
    #: False (tcp): the receiver imports each KV_CHUNK and counts chunks/bytes against KV_DONE.
    one_sided: bool = True

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.layout = RegionLayout.of_pool(pool)
        self.closed = False

    @property
    @abstractmethod
    def descriptor(self) -> str:
        """Text for KV_ALLOC_RESPONSE.region (at most 128 characters)."""

    @abstractmethod
    async def close(self) -> None:
        """Deregister the pool (idempotent). The pool itself stays its owner's."""


class KVWriter(ABC):
    """A sender's handle on one destination region; `begin` one KVTransfer per request."""

    backend: str = ""

    def __init__(self, peer: str, deadline_s: float, abort_grace_s: float) -> None:
        if deadline_s <= 0 or abort_grace_s < 0:
            raise ValueError("deadline_s must be > 0 and abort_grace_s >= 0")
        self.peer = peer
        self.deadline_s = deadline_s
        self.abort_grace_s = abort_grace_s
        self.closed = False
        self.bytes_written = 0
        self.writes = 0
        # a modelled line the writes must also cross (an emulated cluster's RDMA NIC): each
        # write completes when both the real write and the line are done (pddnet.device.line)
        self.line: ModelledLine | None = None

    def begin(self, request_id: str, target: WriteTarget) -> KVTransfer:
        if self.closed:
            raise TransferAborted(
                f"{self.backend} writer to {self.peer} is closed",
                backend=self.backend,
                peer=self.peer,
            )
        return KVTransfer(self, request_id, target)

    @abstractmethod
    async def _write(self, transfer: KVTransfer, exported: ExportedKV, deadline_s: float) -> int:
        """Move `exported` into transfer.target; return the bytes counted for KV_DONE."""

    @abstractmethod
    async def close(self) -> None:
        """Release the writer's resources (idempotent); later writes raise TransferAborted."""

    def _error(self, cls: type[TransferError], message: str) -> TransferError:
        return cls(message, backend=self.backend, peer=self.peer)


class KVTransfer:
    """One request's writes to one destination. Not thread-safe; one task writes at a time."""

    def __init__(self, writer: KVWriter, request_id: str, target: WriteTarget) -> None:
        self.writer = writer
        self.request_id = request_id
        self.target = target
        self.bytes_written = 0
        self.writes = 0
        self.chunks = 0  # KV_CHUNK frames sent (tcp)
        self.aborted: str | None = None
        self._active = 0
        # Engine calls that outlived their deadline: they may still land bytes, so abort()
        # waits for them before the receiver is told it may reuse the blocks.
        self.lingering: list[concurrent.futures.Future] = []

    async def write(self, exported: ExportedKV, *, deadline_s: float | None = None) -> int:
        """Write the export at its own positions (meta.token_start..). Returns bytes counted."""
        w = self.writer
        if self.aborted is not None:
            raise w._error(
                TransferAborted, f"transfer of {self.request_id} was aborted: {self.aborted}"
            )
        if w.closed:
            raise w._error(TransferAborted, f"{w.backend} writer to {w.peer} is closed")
        meta = exported.meta
        self.target.check(meta.token_start, meta.token_end, backend=w.backend, peer=w.peer)
        self._active += 1
        try:
            started = time.monotonic()
            n = await w._write(self, exported, deadline_s or w.deadline_s)
            if w.line is not None:
                wait = w.line.complete(started, n, time.monotonic())
                if wait > 0:
                    await asyncio.sleep(wait)
        finally:
            self._active -= 1
        self.bytes_written += n
        self.writes += 1
        w.bytes_written += n
        w.writes += 1
        return n

    def completion(self) -> Completion:
        return Completion(num_chunks=self.chunks, num_bytes=self.bytes_written)

    @property
    def quiescent(self) -> bool:
        return self._active == 0 and all(f.done() for f in self.lingering)

    async def abort(self, reason: str, grace_s: float | None = None) -> bool:
        """Refuse further writes and wait (at most the grace) until none is in flight.
        True: nothing of this transfer can land any more; False: an engine call is still stuck
        (the receiver is hung; the engine's progress timeout ends it later)."""
        if self.aborted is None:
            self.aborted = reason or "aborted"
        grace = self.writer.abort_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace
        while not self.quiescent and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        return self.quiescent

    def __repr__(self) -> str:
        state = f"aborted: {self.aborted}" if self.aborted else "open"
        return (
            f"<KVTransfer {self.writer.backend} {self.request_id} -> {self.writer.peer} "
            f"{self.bytes_written} B {state}>"
        )


class KVBackend(ABC):
    """A way to move KV: receivers register pools, senders open their descriptors."""

    name: str = ""

    @abstractmethod
    async def register(self, pool: KVPool) -> KVSink:
        """Make `pool` a destination region; its descriptor goes into KV_ALLOC_RESPONSE."""

    @abstractmethod
    async def open(self, descriptor: str) -> KVWriter:
        """A writer for the region a receiver described (KV_ALLOC_RESPONSE.region)."""

    @abstractmethod
    async def close(self) -> None:
        """Close every sink and writer this backend made, then the backend (idempotent)."""

    def stats(self) -> dict[str, Any]:
        return {"backend": self.name}


W = TypeVar("W", bound=KVWriter)


class TrackingBackend(KVBackend):
    """A backend whose sinks and writers need no engine of their own (shm, tcp): it keeps what
    it made to close it and to count it. Subclasses set `sink_class` and implement `open`,
    passing each new writer through `track`."""

    sink_class: type[KVSink]

    def __init__(self, *, deadline_s: float = 10.0, abort_grace_s: float = 2.0) -> None:
        self.deadline_s = deadline_s
        self.abort_grace_s = abort_grace_s
        self.sinks: list[KVSink] = []
        self.writers: list[KVWriter] = []

    async def register(self, pool: KVPool) -> KVSink:
        sink = self.sink_class(pool)
        self.sinks.append(sink)
        return sink

    def track(self, writer: W) -> W:
        self.writers.append(writer)
        return writer

    async def close(self) -> None:
        for w in self.writers:
            await w.close()
        for s in self.sinks:
            await s.close()
        self.writers.clear()
        self.sinks.clear()

    def stats(self) -> dict[str, Any]:
        return {
            "backend": self.name,
            "writers": len(self.writers),
            "sinks": len(self.sinks),
            "bytes_written": sum(w.bytes_written for w in self.writers),
        }


def check_descriptor_for(backend: str, descriptor: str) -> None:
    """Raise BadRegion unless `descriptor` belongs to `backend` (a receiver configured with
    another transport than the sender is a deployment error, caught at the first request)."""
    if backend not in BACKEND_NAMES:
        raise ValueError(
            f"unknown KV backend {backend!r}: choose one of {', '.join(BACKEND_NAMES)}"
        )
    found = backend_of_descriptor(descriptor)
    if found != backend:
        raise BadRegion(
            f"the receiver described a {found} region ({descriptor[:64]!r}) but this "
            f"path is configured for {backend}: use the same [transport] on both "
            "hosts",
            backend=backend,
        )


def validate_segments(segments: Sequence[Segment], src_bytes: int, dst_bytes: int) -> None:
    """Raise WriteRefused unless every segment lies inside both buffers (a last line of defence
    before raw bytes go to an engine that would write wherever it is told)."""
    for seg in segments:
        if (
            seg.length <= 0
            or seg.src < 0
            or seg.dst < 0
            or seg.src + seg.length > src_bytes
            or seg.dst + seg.length > dst_bytes
        ):
            raise WriteRefused(
                f"segment {seg} outside source ({src_bytes} B) or region ({dst_bytes} B)"
            )
