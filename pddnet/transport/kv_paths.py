"""The KV backends one daemon process uses, made from the cluster config at start.

    paths = await KVPaths.create(config, section, ("intra_dc", "wan"))   # P in pdd mode
    paths.backend("wan")                     # the wan path's KVBackend
    paths.describe()                         # {"intra_dc": "mooncake", "wan": "tcp"}
    await paths.close()

A daemon creates these before it loads its model, so a backend that cannot run here (mooncake
without its package, rdma without NICs) fails `pdd up` / `pdd serve` at once with the reason.

Both paths on mooncake get one Transfer Engine *each*, not one shared: measured in the testbed,
a write stuck on a SIGSTOPped MD across the WAN also stalled P's writes to RLD inside the
shared engine, turning one hung peer into two failed paths. Separate engines keep a hung
receiver's damage to its own path (each engine binds its own ports in the configured range).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pddnet.device.dilation import rdma_bytes_per_s
from pddnet.device.line import ModelledLine
from pddnet.transport.backends import MooncakeSettings, create_backend
from pddnet.transport.kv_backend import BackendUnavailable, KVBackend, KVWriter

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.config import ClusterConfig, DaemonSection

PATHS = ("intra_dc", "wan")
UNROUTABLE = ("0.0.0.0", "::", "")
DEFAULT_ABORT_GRACE_S = 2.0


def advertised_host(section: DaemonSection, where: str) -> str:
    """The address peers reach this daemon at: its dial host, else its listen host. A wildcard
    cannot be advertised (the sender would dial itself)."""
    host = section.dial_address()[0]
    if host in UNROUTABLE:
        raise BackendUnavailable(
            f"{where}: the mooncake backend advertises this daemon's address to senders, but "
            f'{where}.host is {host!r}: set {where}.dial = "ADDRESS:PORT" (an address the '
            "other hosts reach) or listen on that address",
            backend="mooncake",
        )
    return host


def mooncake_settings(config: ClusterConfig, local_host: str) -> MooncakeSettings:
    t = config.transport
    try:
        return MooncakeSettings(
            protocol=t.mooncake_protocol,
            device=t.mooncake_device,
            local_host=local_host,
            deadline_s=t.deadline_s,
            progress_timeout_s=t.progress_timeout_s,
            staging_bytes=t.mooncake_staging_mib << 20,
            abort_grace_s=t.abort_grace_s,
            rpc_port_min=t.mooncake_port_min,
            rpc_port_max=t.mooncake_port_max,
        )
    except ValueError as exc:
        raise BackendUnavailable(f"mooncake settings: {exc}", backend="mooncake") from None


class KVPaths:
    """The backend of each KV path this daemon takes part in (sender or receiver)."""

    def __init__(
        self, backends: dict[str, KVBackend], lines: dict[str, ModelledLine] | None = None
    ) -> None:
        self._backends = backends
        self.lines = lines or {}  # path -> the modelled line its writes cross (emulated NICs)

    @classmethod
    async def create(
        cls, config: ClusterConfig, section: DaemonSection, where: str, paths: tuple[str, ...]
    ) -> KVPaths:
        t = config.transport
        grace = t.abort_grace_s if t.abort_grace_s is not None else DEFAULT_ABORT_GRACE_S
        made: dict[str, KVBackend] = {}
        try:
            for path in paths:
                name = t.backend_of(path)
                if name == "mooncake":  # an engine per path (see above)
                    settings = mooncake_settings(config, advertised_host(section, where))
                    made[path] = await create_backend("mooncake", mooncake=settings)
                else:
                    made[path] = await create_backend(
                        name,
                        deadline_s=t.deadline_s,
                        abort_grace_s=grace,
                        chunk_tokens=config.wan.chunk_tokens,
                    )
        except BaseException:
            await cls(made).close()
            raise
        lines = {}
        rate = rdma_bytes_per_s(config)
        if rate is not None and "intra_dc" in paths:
            lines["intra_dc"] = ModelledLine(rate)
        return cls(made, lines)

    async def open(self, path: str, descriptor: str) -> KVWriter:
        """A writer on a path's backend to the region a receiver described, crossing the path's
        modelled line if it has one."""
        writer = await self.backend(path).open(descriptor)
        writer.line = self.lines.get(path)
        return writer

    def backend(self, path: str) -> KVBackend:
        try:
            return self._backends[path]
        except KeyError:
            raise ValueError(
                f"this daemon has no {path} KV path (it has {', '.join(self._backends) or 'none'})"
            ) from None

    def name(self, path: str) -> str:
        return self.backend(path).name

    def describe(self) -> dict[str, str]:
        return {path: b.name for path, b in self._backends.items()}

    def stats(self) -> dict[str, Any]:
        out = {path: b.stats() for path, b in self._backends.items()}
        for path, line in self.lines.items():
            out[path] = {**out[path], "modelled_line": line.to_stats()}
        return out

    async def close(self) -> None:
        """Close each distinct backend once."""
        seen: set[int] = set()
        for b in self._backends.values():
            if id(b) not in seen:
                seen.add(id(b))
                await b.close()
