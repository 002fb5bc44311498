"""The `mooncake` backend: Mooncake Transfer Engine one-sided writes into the receiver's pool.

The engine under SGLang's, vLLM's and Dynamo's PD disaggregation. It runs here with its P2P
handshake (metadata "P2PHANDSHAKE": no metadata service; a peer is named "host:rpc_port") and
protocol "tcp" (or "rdma" where the NICs have it: a setting, not code). The receiver registers its
whole KV pool with its engine and describes it as

    mooncake:HOST:RPC_PORT:POOL_ADDRESS_HEX:LAYERS.HEADS.DIM.BLOCK_SIZE.DTYPE.BLOCKS

so the sender can compute every destination byte itself (kv_backend.plan_write) and the engine
writes straight into the destination blocks; completion still goes on pddnet's control lane
(KV_DONE), after the engine has acknowledged the write.

The engine's calls block, so each writer has its own CallThread and the event loop waits with
pddnet's deadline. The engine's own bounds are set low from the settings before it starts
(MC_TCP_PROGRESS_TIMEOUT_SEC: no payload progress for that long drops the connection; it
defaults to 30 s) so a hung peer ends the call soon after our deadline fires; a handshake with
a stopped peer can still block, which is what the deadline and CallTimedOut are for. A writer
whose call is stuck refuses further writes at once (PeerUnreachable) until the call returns.

The sender stages each piece of KV in a registered buffer converted to the receiver's dtype
(one copy), then issues one batch_transfer_sync_write with the plan's segments.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pddnet.transport.kv_backend import (
    MOONCAKE_SCHEME,
    BackendUnavailable,
    BadRegion,
    KVBackend,
    KVSink,
    KVTransfer,
    PeerUnreachable,
    RegionLayout,
    TransferAborted,
    TransferError,
    WriteRefused,
    check_descriptor_for,
    plan_write,
    validate_segments,
)

from .call_thread import CallThread, CallTimedOut, ThreadedWriter

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.kv.pool import KVPool
    from pddnet.kv.transfer import ExportedKV

NAME = "mooncake"
PROTOCOLS = ("tcp", "rdma")
INSTALL_HINT = (
    "install the optional extra (pip install 'pddnet[mooncake]', i.e. the wheel "
    "mooncake-transfer-engine-non-cuda) and the system library libibverbs1 "
    "(apt-get install -y libibverbs1)"
)
_DESCRIPTOR_RE = re.compile(
    r"^mooncake:(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,63}):(\d{1,5}):"
    r"([0-9a-f]{1,16}):(\S{1,60})$"
)


def mooncake_import_error() -> str | None:
    """Why the engine cannot be imported here, or None when it can (tests skip on the reason)."""
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except Exception as exc:  # ImportError, or OSError from a missing libibverbs.so.1
        return f"mooncake transfer engine unavailable ({type(exc).__name__}: {exc}); {INSTALL_HINT}"
    return None


@dataclass(frozen=True)
class MooncakeSettings:
    """How one process's engine runs (proposed [transport] keys in docs/deploy.md)."""

    protocol: str = "tcp"  # "tcp" | "rdma"
    device: str = ""  # rdma: NIC names ("mlx5_0,mlx5_1"); "" = engine's choice
    local_host: str = "127.0.0.1"  # the address peers reach this engine at (never 0.0.0.0)
    deadline_s: float = 10.0  # pddnet's bound on one write call
    progress_timeout_s: int = 2  # the engine's no-progress bound (whole seconds, >= 1)
    staging_bytes: int = 64 << 20  # sender's registered staging buffer per destination
    # Most segments in one batch call: the engine's TCP transport rejects a batch that overflows
    # its per-peer queue (MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER) instead of waiting.
    max_batch_segments: int = 256
    abort_grace_s: float | None = None  # default: progress_timeout_s * 2 + 1
    rpc_port_min: int = 0  # with rpc_port_max: the port range the engine binds (firewalls)
    rpc_port_max: int = 0
    init_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"mooncake protocol must be tcp or rdma, got {self.protocol!r}")
        if not self.local_host or self.local_host in ("0.0.0.0", "::"):
            raise ValueError(
                f"mooncake local_host must be an address peers can reach, got {self.local_host!r}"
            )
        if not re.match(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]{1,63})$", self.local_host):
            raise ValueError(
                f"mooncake local_host {self.local_host!r} is not a host name or "
                "address (bracket IPv6: [::1])"
            )
        if self.deadline_s <= 0 or self.init_timeout_s <= 0:
            raise ValueError("mooncake deadline_s and init_timeout_s must be > 0")
        if not isinstance(self.progress_timeout_s, int) or self.progress_timeout_s < 1:
            raise ValueError(
                f"mooncake progress_timeout_s must be a whole number of seconds "
                f">= 1, got {self.progress_timeout_s!r}"
            )
        if self.max_batch_segments < 1:
            raise ValueError(
                f"mooncake max_batch_segments must be >= 1, got {self.max_batch_segments}"
            )
        if self.staging_bytes < 4096:
            raise ValueError(f"mooncake staging_bytes must be >= 4096, got {self.staging_bytes}")
        if (
            self.rpc_port_min or self.rpc_port_max
        ) and not 0 < self.rpc_port_min <= self.rpc_port_max <= 65535:
            raise ValueError(
                f"mooncake rpc port range [{self.rpc_port_min}, "
                f"{self.rpc_port_max}] is not a range of ports"
            )

    @property
    def grace_s(self) -> float:
        return (
            self.abort_grace_s
            if self.abort_grace_s is not None
            else self.progress_timeout_s * 2 + 1.0
        )

    def engine_environment(self) -> dict[str, str]:
        """The engine's environment variables these settings stand for."""
        env = {
            "MC_TCP_PROGRESS_TIMEOUT_SEC": str(self.progress_timeout_s),
            "MC_TCP_STATUS_TIMEOUT_SEC": str(self.progress_timeout_s),
            # The Python binding's own wait for a synchronous transfer (default 30 s).
            "MC_TRANSFER_TIMEOUT": str(max(1, math.ceil(self.deadline_s))),
        }
        if self.rpc_port_min:
            env["MC_MIN_RPC_PORT"] = str(self.rpc_port_min)
            env["MC_MAX_RPC_PORT"] = str(self.rpc_port_max)
        return env


@dataclass(frozen=True)
class MooncakeRegion:
    """A registered pool as the sender sees it: engine session, base address, layout."""

    host: str
    rpc_port: int
    address: int
    layout: RegionLayout

    @property
    def session(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    def encode(self) -> str:
        text = (
            f"{MOONCAKE_SCHEME}{self.host}:{self.rpc_port}:{self.address:x}:{self.layout.encode()}"
        )
        if len(text) > 128:
            raise BadRegion(
                f"mooncake descriptor is {len(text)} characters, KV_ALLOC_RESPONSE "
                "carries at most 128: use a shorter host name",
                backend=NAME,
            )
        return text

    @classmethod
    def parse(cls, text: str) -> MooncakeRegion:
        m = _DESCRIPTOR_RE.match(text)
        if not m:
            raise BadRegion(
                f"bad mooncake region descriptor {text[:128]!r}: expected "
                "mooncake:HOST:PORT:ADDRESS_HEX:LAYOUT",
                backend=NAME,
            )
        host, port, address, layout = m.groups()
        if not 0 < int(port) <= 65535 or int(address, 16) == 0:
            raise BadRegion(
                f"mooncake descriptor {text!r} has port {port} / address 0x{address}", backend=NAME
            )
        try:
            parsed = RegionLayout.decode(layout)
        except ValueError as exc:
            raise BadRegion(f"mooncake descriptor {text!r}: {exc}", backend=NAME) from None
        return cls(host, int(port), int(address, 16), parsed)


def rdma_devices(topology_json: str) -> list[str]:
    """The RDMA devices (HCAs) in the engine's topology report (get_local_topology())."""
    try:
        topology = json.loads(topology_json)
    except ValueError:
        return []
    found: list[str] = []
    for lists in topology.values() if isinstance(topology, dict) else ():
        for names in lists if isinstance(lists, list) else ():
            found += (
                [n for n in names if isinstance(n, str) and n not in found]
                if isinstance(names, list)
                else []
            )
    return found


def _check_rc(rc: int, what: str, peer: str = "") -> None:
    if rc != 0:
        raise PeerUnreachable(f"mooncake {what} returned {rc}", backend=NAME, peer=peer)


class MooncakeSink(KVSink):
    backend = NAME
    one_sided = True

    def __init__(self, owner: MooncakeBackend, pool: KVPool) -> None:
        super().__init__(pool)
        self._owner = owner
        self.address = pool.data.data_ptr()
        self.region = MooncakeRegion(
            owner.settings.local_host, owner.rpc_port, self.address, self.layout
        )
        self._descriptor = self.region.encode()

    @property
    def descriptor(self) -> str:
        return self._descriptor

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        await self._owner._unregister(self.address, f"pool {self.layout.encode()}")


class MooncakeWriter(ThreadedWriter):
    backend = NAME

    def __init__(self, owner: MooncakeBackend, region: MooncakeRegion) -> None:
        s = owner.settings
        super().__init__(region.session, s.deadline_s, s.grace_s)
        self._owner = owner
        self.region = region
        self.layout = region.layout
        self._staging: torch.Tensor | None = None
        self._staging_ptr = 0
        self.released: concurrent.futures.Future | None = None

    async def _start(self) -> None:
        staging = torch.empty(self._owner.settings.staging_bytes, dtype=torch.uint8)
        ptr = staging.data_ptr()
        await self._owner._register(ptr, staging.numel(), "staging buffer")
        self._staging, self._staging_ptr = staging, ptr

    # -- the write, in the writer's thread ----------------------------------------------------

    def _write_sync(self, transfer: KVTransfer, exported: ExportedKV) -> int:
        staging = self._staging
        if staging is None or transfer.aborted is not None:
            raise TransferAborted(
                f"write of {transfer.request_id} to {self.peer} aborted before it started",
                backend=NAME,
                peer=self.peer,
            )
        spec = self.layout.spec
        meta = exported.meta
        layers, _, n, heads, dim = meta.shape
        per_token = layers * 2 * spec.token_bytes_per_layer_kv
        step = staging.numel() // per_token
        engine = self._owner.engine
        written = 0
        for s in range(0, n, step):
            if transfer.aborted is not None:
                raise TransferAborted(
                    f"write of {transfer.request_id} aborted after {written} bytes",
                    backend=NAME,
                    peer=self.peer,
                )
            e = min(n, s + step)
            piece = exported.kv[:, :, s:e]
            nbytes = piece.numel() * spec.itemsize
            # One copy: gather the slice into the staging buffer in the receiver's dtype.
            staging[:nbytes].view(spec.torch_dtype).view(piece.shape).copy_(piece)
            segments = plan_write(
                self.layout, transfer.target, meta.token_start + s, e - s, meta.layer_start, layers
            )
            validate_segments(segments, nbytes, self.layout.nbytes)
            batch = self._owner.settings.max_batch_segments
            for b in range(0, len(segments), batch):
                if transfer.aborted is not None:
                    raise TransferAborted(
                        f"write of {transfer.request_id} aborted after {written} bytes",
                        backend=NAME,
                        peer=self.peer,
                    )
                group = segments[b : b + batch]
                rc = engine.batch_transfer_sync_write(
                    self.region.session,
                    [self._staging_ptr + g.src for g in group],
                    [self.region.address + g.dst for g in group],
                    [g.length for g in group],
                )
                _check_rc(
                    rc,
                    f"batch_transfer_sync_write of {transfer.request_id} positions "
                    f"[{meta.token_start + s}, {meta.token_start + e}) to {self.peer} "
                    f"(peer dead, stalled past the engine's "
                    f"{self._owner.settings.progress_timeout_s} s progress timeout, or "
                    f"refused)",
                    self.peer,
                )
            written += nbytes
        return written

    async def _write(self, transfer: KVTransfer, exported: ExportedKV, deadline_s: float) -> int:
        if self._stuck is not None and not self._stuck.done():
            raise self._error(
                PeerUnreachable,
                f"an earlier write to {self.peer} is still stuck in the engine (the peer is hung)",
            )
        spec = self.layout.spec
        meta = exported.meta
        if tuple(meta.shape[3:]) != (spec.num_kv_heads, spec.head_dim):
            raise self._error(
                WriteRefused,
                f"KV of {meta.shape[3]} kv heads x {meta.shape[4]} "
                f"does not fit region {self.peer}'s {spec.num_kv_heads} x "
                f"{spec.head_dim}",
            )
        per_token = meta.shape[0] * 2 * spec.token_bytes_per_layer_kv
        if per_token > self._owner.settings.staging_bytes:
            raise self._error(
                WriteRefused,
                f"one position of this KV is {per_token} bytes, the "
                f"staging buffer {self._owner.settings.staging_bytes}",
            )
        # The whole write is checked before any byte moves (a refused write changes nothing).
        plan_write(
            self.layout,
            transfer.target,
            meta.token_start,
            meta.num_tokens,
            meta.layer_start,
            meta.shape[0],
        )
        try:
            return await self._in_thread(self._write_sync, transfer, exported, deadline_s)
        except TransferError:
            raise
        except (RuntimeError, ValueError) as exc:  # the engine binding's own errors
            raise self._error(
                PeerUnreachable,
                f"mooncake write to {self.peer} failed: {type(exc).__name__}: {exc}",
            ) from None

    # -- closing -------------------------------------------------------------------------------

    @property
    def released_done(self) -> bool:
        """Closed and its staging buffer deregistered (no engine call of it is left)."""
        return self.released is not None and self.released.done()

    def _release(self) -> None:
        if self._staging is not None:
            self._owner._unregister_sync(self._staging_ptr)
            self._staging = None

    async def close(self) -> None:
        """Deregister the staging buffer after any call still running (bounded wait)."""
        if self.closed:
            return
        self.closed = True
        self.released = self._thread.submit(self._release)
        self._thread.stop()
        try:
            await asyncio.wait_for(
                asyncio.shield(asyncio.wrap_future(self.released)), self.abort_grace_s
            )
        except asyncio.TimeoutError:
            pass  # a call is stuck on a hung peer; the release runs the moment it returns
        except TransferError:
            pass  # counted in the owner's stats


class MooncakeBackend(KVBackend):
    """One Transfer Engine per instance (a daemon has one); create with `await create(...)`."""

    name = NAME

    def __init__(
        self, settings: MooncakeSettings, engine: Any, rpc_port: int, control: CallThread
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.rpc_port = rpc_port
        self._control = control  # register/unregister, apart from the writers' threads
        self.registered: dict[int, str] = {}
        self.sinks: list[MooncakeSink] = []
        self.writers: list[MooncakeWriter] = []
        self.unregister_failures = 0
        self.closed = False

    @classmethod
    async def create(cls, settings: MooncakeSettings | None = None) -> MooncakeBackend:
        """Start the engine; BackendUnavailable (with the reason) when it cannot run here."""
        settings = settings or MooncakeSettings()
        reason = mooncake_import_error()
        if reason is not None:
            raise BackendUnavailable(reason, backend=NAME)
        from mooncake.engine import TransferEngine

        # Read by the engine when it starts: they must be in place before the constructor.
        os.environ.update(settings.engine_environment())
        control = CallThread("mooncake-control")

        def start() -> tuple[Any, int]:
            engine = TransferEngine()
            rc = engine.initialize(
                settings.local_host, "P2PHANDSHAKE", settings.protocol, settings.device
            )
            if rc != 0:
                raise BackendUnavailable(
                    f"mooncake initialize({settings.local_host!r}, 'P2PHANDSHAKE', "
                    f"{settings.protocol!r}, {settings.device!r}) returned {rc}"
                    + (
                        "; protocol rdma needs RDMA NICs (ibv_devices lists none?)"
                        if settings.protocol == "rdma"
                        else ""
                    ),
                    backend=NAME,
                )
            if settings.protocol == "rdma" and not rdma_devices(engine.get_local_topology()):
                # The engine does not fail here: it quietly moves the bytes over TCP instead.
                raise BackendUnavailable(
                    "mooncake protocol 'rdma' asked for, but the engine found no RDMA device "
                    '(it would fall back to TCP): use protocol = "tcp" on this host, or '
                    "check ibv_devices and the rdma-core providers",
                    backend=NAME,
                )
            return engine, engine.get_rpc_port()

        try:
            engine, port = await control.call(
                start, timeout=settings.init_timeout_s, what="mooncake engine start"
            )
        except CallTimedOut as exc:
            control.stop()
            raise BackendUnavailable(str(exc), backend=NAME) from None
        except BaseException:
            control.stop()
            raise
        return cls(settings, engine, port, control)

    # -- memory registration ---------------------------------------------------------------------

    async def _register(self, address: int, length: int, what: str) -> None:
        def reg() -> None:
            rc = self.engine.register_memory(address, length)
            if rc != 0:
                raise TransferError(
                    f"mooncake register_memory of the {what} ({length} bytes) returned {rc}",
                    backend=NAME,
                )
            self.registered[address] = what

        try:
            await self._control.call(
                reg, timeout=self.settings.init_timeout_s, what=f"register {what}"
            )
        except CallTimedOut as exc:
            raise TransferError(str(exc), backend=NAME) from None

    def _unregister_sync(self, address: int) -> None:
        if self.registered.pop(address, None) is None:
            return
        rc = self.engine.unregister_memory(address)
        if rc != 0:
            self.unregister_failures += 1
            raise TransferError(
                f"mooncake unregister_memory(0x{address:x}) returned {rc}", backend=NAME
            )

    async def _unregister(self, address: int, what: str) -> None:
        try:
            await self._control.call(
                self._unregister_sync,
                address,
                timeout=self.settings.init_timeout_s,
                what=f"unregister {what}",
            )
        except CallTimedOut as exc:
            raise TransferError(str(exc), backend=NAME) from None

    # -- the interface ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self.closed:
            raise TransferAborted("mooncake backend is closed", backend=NAME)

    async def register(self, pool: KVPool) -> MooncakeSink:
        self._check_open()
        sink = MooncakeSink(self, pool)
        await self._register(sink.address, pool.nbytes, f"KV pool {sink.layout.encode()}")
        self.sinks.append(sink)
        return sink

    async def open(self, descriptor: str) -> MooncakeWriter:
        self._check_open()
        check_descriptor_for(NAME, descriptor)
        writer = MooncakeWriter(self, MooncakeRegion.parse(descriptor))
        try:
            await writer._start()
        except BaseException:
            writer._thread.stop()
            raise
        # Writers closed and released (a receiver that went away) are forgotten here.
        self.writers = [w for w in self.writers if not w.closed or not w.released_done]
        self.writers.append(writer)
        return writer

    async def close(self) -> None:
        """Close writers (bounded), deregister pools, stop the control thread."""
        if self.closed:
            return
        self.closed = True
        await asyncio.gather(*(w.close() for w in self.writers), return_exceptions=True)
        for sink in self.sinks:
            try:
                await sink.close()
            except TransferError:
                pass  # counted in unregister_failures / still in `registered`
        self._control.stop()

    def stats(self) -> dict[str, Any]:
        return {
            "backend": NAME,
            "protocol": self.settings.protocol,
            "session": f"{self.settings.local_host}:{self.rpc_port}",
            "registered_buffers": len(self.registered),
            "writers": sum(1 for w in self.writers if not w.closed),
            "releases_pending": sum(1 for w in self.writers if w.closed and not w.released_done),
            "sinks": sum(1 for s in self.sinks if not s.closed),
            "stuck_writers": sum(
                1 for w in self.writers if w._stuck is not None and not w._stuck.done()
            ),
            "bytes_written": sum(w.bytes_written for w in self.writers),
            "unregister_failures": self.unregister_failures,
        }
