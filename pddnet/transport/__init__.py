"""pddnet.transport: the asyncio shells around the sans-IO protocol.

    conn = await dial(host, port, role="prefill", instance_id="p-0", lane="control", secret=s)
    await conn.send(msg); reply = await conn.recv()
    server = Server(host, 0, role="main_decode", instance_id="md-0", secret=s, on_connection=h)

See connection.py (dial, Server, Connection; it runs pddnet/protocol/handshake.py, the sans-IO
HELLO/AUTH machine), stripes.py (KV chunks over parallel bulk lanes) and shm_region.py (one-sided writes into a
peer's shared-memory KV pool).
"""

from .connection import (
    HANDSHAKE_LIMITS,
    LANE_LIMITS,
    LANES,
    AuthenticationFailed,
    Connection,
    ConnectionClosed,
    DialError,
    DialRefused,
    DialTimeout,
    Server,
    dial,
    dial_with_retry,
    lane_limits,
)
from .stripes import LaneFailed, StripedSender, choose_lane


def __getattr__(name: str):
    # RemoteKVRegion needs torch (through the KV pool); import it only when asked, so that a
    # process that only routes messages (the router) does not load torch for the transport.
    if name == "RemoteKVRegion":
        from .shm_region import RemoteKVRegion

        return RemoteKVRegion
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "LANES",
    "LANE_LIMITS",
    "HANDSHAKE_LIMITS",
    "lane_limits",
    "Connection",
    "ConnectionClosed",
    "DialError",
    "DialRefused",
    "DialTimeout",
    "AuthenticationFailed",
    "Server",
    "dial",
    "dial_with_retry",
    "StripedSender",
    "LaneFailed",
    "choose_lane",
    "RemoteKVRegion",
]
