"""The KV transport backends behind pddnet.transport.kv_backend: shm, tcp, mooncake.

    backend = await create_backend("mooncake", mooncake=MooncakeSettings(local_host="10.0.0.2"))
    backend = await create_backend("tcp", stripes=StripedSender(lanes), chunk_tokens=64)
    backend = await create_backend("shm")

A daemon creates the backend of each path it takes part in at start, so that a backend that
cannot run here (mooncake without its package) fails `pdd up` / `pdd serve` with the reason,
never the first request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pddnet.transport.kv_backend import BACKEND_NAMES, KVBackend

from .call_thread import CallThread, CallTimedOut
from .mooncake import MooncakeBackend, MooncakeSettings, mooncake_import_error
from .shm import ShmBackend
from .tcp import TcpBackend

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.transport.stripes import StripedSender


async def create_backend(
    name: str,
    *,
    deadline_s: float = 10.0,
    abort_grace_s: float = 2.0,
    stripes: StripedSender | None = None,
    chunk_tokens: int = 64,
    mooncake: MooncakeSettings | None = None,
) -> KVBackend:
    """The backend called `name`. For mooncake, `mooncake` settings carry their own deadline."""
    if name == "shm":
        return ShmBackend(deadline_s=deadline_s, abort_grace_s=abort_grace_s)
    if name == "tcp":
        return TcpBackend(
            stripes, chunk_tokens=chunk_tokens, deadline_s=deadline_s, abort_grace_s=abort_grace_s
        )
    if name == "mooncake":
        return await MooncakeBackend.create(mooncake)
    raise ValueError(f"unknown KV backend {name!r}: choose one of {', '.join(BACKEND_NAMES)}")


__all__ = [
    "create_backend",
    "ShmBackend",
    "TcpBackend",
    "MooncakeBackend",
    "MooncakeSettings",
    "mooncake_import_error",
    "CallThread",
    "CallTimedOut",
]
