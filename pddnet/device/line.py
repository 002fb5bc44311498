"""A modelled line that serialises bytes at a fixed rate, sans-IO: the intra-datacenter RDMA
path of an emulated cluster (P's NICs towards the relay pool).

Without it that path is shared memory, as fast as the box's memcpy, where a real RDMA NIC moves
its 50 GB/s; with emulated devices the line gets the chip profile's NIC rate, scaled like the
WAN (pddnet.device.dilation.rdma_bytes_per_s). Writes are served first come, first served: a
write of n bytes that started at t completes at max(t, line free) + n / rate. When the real
write took longer than that, the line **overran** (the box could not keep up with the modelled
NIC): counted, like a forward's overrun, never hidden.
"""

from __future__ import annotations

import math


class ModelledLine:
    def __init__(self, bytes_per_s: float) -> None:
        if (
            isinstance(bytes_per_s, bool)
            or not isinstance(bytes_per_s, (int, float))
            or not 0 < bytes_per_s < math.inf
        ):
            raise ValueError(
                f"a line's rate must be a finite number of bytes/s > 0, got {bytes_per_s!r}"
            )
        self.bytes_per_s = float(bytes_per_s)
        self.free_at = -math.inf
        self.writes = 0
        self.bytes = 0
        self.overruns = 0
        self.lost_s = 0.0

    def complete(self, started: float, nbytes: int, now: float) -> float:
        """A write of ``nbytes`` that started at ``started`` has really finished at ``now``:
        the seconds still to wait until the modelled line has carried it (0 on an overrun)."""
        if nbytes < 0 or now < started:
            raise ValueError(f"bad write: {nbytes} bytes from {started} to {now}")
        done = max(started, self.free_at) + nbytes / self.bytes_per_s
        self.free_at = done
        self.writes += 1
        self.bytes += nbytes
        if now > done:
            self.overruns += 1
            self.lost_s += now - done
            return 0.0
        return done - now

    def to_stats(self) -> dict[str, float | int]:
        return {
            "bytes_per_s": self.bytes_per_s,
            "writes": self.writes,
            "bytes": self.bytes,
            "overruns": self.overruns,
            "overrun_lost_s": round(self.lost_s, 6),
        }
