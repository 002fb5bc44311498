"""pddnet.transport: the asyncio shells around the sans-IO protocol.

    conn = await dial(host, port, role="prefill", instance_id="p-0", lane="control", secret=s)
    await conn.send(msg); reply = await conn.recv()
    server = Server(host, 0, role="main_decode", instance_id="md-0", secret=s, on_connection=h)

See connection.py (dial, Server, Connection; it runs pddnet/protocol/handshake.py, the sans-IO
HELLO/AUTH machine), stripes.py (KV chunks over parallel bulk lanes), kv_backend.py and backends/
(KV transfer backends: shm, tcp, mooncake).
"""

from pddnet.lanes import LANES, LATENCY_DSCP, lane_dscp

from .connection import (
    HANDSHAKE_LIMITS,
    LANE_LIMITS,
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

__all__ = [
    "LANES",
    "LANE_LIMITS",
    "HANDSHAKE_LIMITS",
    "lane_limits",
    "LATENCY_DSCP",
    "lane_dscp",
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
]
