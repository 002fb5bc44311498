"""KV chunks striped over parallel bulk lanes (P -> MD over the WAN).

Several TCP connections share a long fat pipe better than one (each has its own congestion
window), and a chunk waiting behind another request's chunk on one lane can take another. Each
chunk goes onto the lane with the fewest bytes queued in its transport; ties go round-robin, so
idle lanes share the work. A dead lane fails the send at once (`LaneFailed`): the caller aborts
the transfer (KV_ABORT); failover onto the surviving lanes belongs to the reliability work.
"""

from __future__ import annotations

from collections.abc import Sequence

from pddnet.protocol import KvChunk

from .connection import Connection, ConnectionClosed


class LaneFailed(ConnectionError):
    """A bulk lane is closed or broke while sending; `lane_index` says which."""

    def __init__(self, message: str, lane_index: int) -> None:
        super().__init__(message)
        self.lane_index = lane_index

    def __str__(self) -> str:
        return str(self.args[0])


def choose_lane(backlogs: Sequence[int], next_index: int) -> int:
    """The index of the least-backlogged lane; among equals, the first at or after `next_index`
    (round-robin). Pure, so the policy is tested without sockets."""
    if not backlogs:
        raise ValueError("no lanes to choose from")
    n = len(backlogs)
    least = min(backlogs)
    for step in range(n):
        i = (next_index + step) % n
        if backlogs[i] == least:
            return i
    raise AssertionError("unreachable: some lane has the least backlog")


class StripedSender:
    """Send KV_CHUNK frames over N bulk lanes. Safe to call from many tasks at once."""

    def __init__(self, lanes: list[Connection]) -> None:
        if not lanes:
            raise ValueError("StripedSender needs at least one bulk lane")
        for i, lane in enumerate(lanes):
            if lane.lane != "bulk":
                raise ValueError(f"lane {i} is a {lane.lane!r} connection, not a bulk lane")
        self.lanes = list(lanes)
        self._next = 0
        self.chunks_sent = [0] * len(lanes)
        self.bytes_sent = [0] * len(lanes)

    @property
    def alive(self) -> bool:
        """Every lane is open (what P's readiness reports as its bulk link)."""
        return not any(lane.closed or lane.peer_closed for lane in self.lanes)

    def _check_alive(self) -> None:
        for i, lane in enumerate(self.lanes):
            if lane.closed or lane.peer_closed:
                why = lane.close_reason if lane.closed else "the peer closed it"
                raise LaneFailed(
                    f"bulk lane {i} to {lane.peer_instance!r} is closed "
                    f"({why}): abort the transfer",
                    i,
                )

    async def send(self, msg: KvChunk) -> int:
        """Queue `msg` on the least-backlogged lane and wait for that lane's backpressure.
        Returns the lane index used. Raises LaneFailed if any lane is dead."""
        if not isinstance(msg, KvChunk):
            raise TypeError(f"StripedSender carries KV_CHUNK only, got {type(msg).__name__}")
        self._check_alive()
        i = choose_lane([lane.write_buffer_size() for lane in self.lanes], self._next)
        self._next = (i + 1) % len(self.lanes)
        self.chunks_sent[i] += 1
        self.bytes_sent[i] += msg.payload.nbytes
        try:
            await self.lanes[i].send(msg)
        except ConnectionClosed as exc:
            raise LaneFailed(
                f"bulk lane {i} to {self.lanes[i].peer_instance!r} failed while "
                f"sending chunk {msg.chunk_index} of {msg.request_id}: {exc.reason}",
                i,
            ) from exc
        return i

    def backlog(self) -> int:
        """Bytes queued over all lanes (not yet handed to the kernel)."""
        return sum(lane.write_buffer_size() for lane in self.lanes)

    async def close(self) -> None:
        for lane in self.lanes:
            await lane.close("striped sender closed")
