"""The lanes a pddnet connection can be (HELLO.lane; docs/architecture.md) and how each lane's
packets are marked on the network.

Control and events lanes carry small, latency-bound frames (HANDOFF, TAKEOVER, token events,
heartbeats): their packets are marked Expedited Forwarding, so a WAN with a QoS class for it (the
emulator's `priority_dscp`, a datacenter interconnect's policy) serves them ahead of bulk KV
instead of behind a queue of it. Bulk lanes (KV) stay best effort. Where nobody honours the mark
it costs nothing. The simulator marks its control messages the same way.
"""

from __future__ import annotations

LANES = ("events", "control", "bulk")
LATENCY_DSCP = 46  # Expedited Forwarding (RFC 3246)


def lane_dscp(lane: str) -> int:
    """The DSCP a lane's packets are marked with (0: best effort)."""
    if lane not in LANES:
        raise ValueError(f"unknown lane {lane!r}: expected one of {', '.join(LANES)}")
    return 0 if lane == "bulk" else LATENCY_DSCP
