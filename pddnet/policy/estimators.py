"""Smoothed estimates of WAN goodput and RTT from observations (time passed in by the caller)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

# Transfers this large or larger weigh fully in the goodput estimate (bytes of the modelled KV)
FULL_WEIGHT_BYTES = 1 << 20


@dataclass
class BandwidthEstimator:
    """EWMA of observed transfer goodput in bytes/s.

    Each sample is one completed transfer (bytes, seconds). Small transfers are dominated by RTT
    rather than bandwidth, so a sample's weight grows with its size up to `full_weight_bytes`.
    """

    initial_bps: float
    alpha: float = 0.25
    full_weight_bytes: int = FULL_WEIGHT_BYTES
    samples: int = field(default=0, init=False)
    _estimate: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        if self.initial_bps <= 0:
            raise ValueError(f"initial_bps must be > 0, got {self.initial_bps}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"alpha must be in (0, 1], got {self.alpha}")
        self._estimate = float(self.initial_bps)
        self.samples = 0  # (init=False fields: mypyc's compiled __init__ leaves them unset)

    @property
    def bytes_per_s(self) -> float:
        return self._estimate

    def observe(self, nbytes: int, seconds: float) -> None:
        if nbytes <= 0 or seconds <= 0:
            return  # nothing learned from an empty or instantaneous transfer
        weight = self.alpha * min(1.0, nbytes / self.full_weight_bytes)
        self._estimate += weight * (nbytes / seconds - self._estimate)
        self.samples += 1

    def transfer_time(self, nbytes: int, rtt_s: float = 0.0) -> float:
        """Estimated seconds to move `nbytes`: one RTT for the allocation round trip plus bytes/bw."""
        return rtt_s + max(nbytes, 0) / self._estimate


@dataclass
class RttEstimator:
    """RFC 6298 style smoothed RTT and variance (seconds)."""

    initial_s: float = 0.03
    window: int = 16  # samples the minimum is taken over
    srtt: float = field(default=0.0, init=False)
    rttvar: float = field(default=0.0, init=False)
    samples: int = field(default=0, init=False)
    _recent: deque = field(default_factory=deque, init=False)

    def __post_init__(self) -> None:
        if self.initial_s <= 0:
            raise ValueError(f"initial_s must be > 0, got {self.initial_s}")
        self.srtt = self.initial_s
        self.rttvar = self.initial_s / 2
        self.samples = 0  # (init=False fields: mypyc's compiled __init__ leaves them unset)
        self._recent = deque()

    def observe(self, rtt_s: float) -> None:
        if rtt_s < 0:
            raise ValueError(f"rtt sample must be >= 0, got {rtt_s}")
        if self.samples == 0:
            self.srtt, self.rttvar = rtt_s, rtt_s / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt_s)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt_s
        self.samples += 1
        self._recent.append(rtt_s)
        if len(self._recent) > self.window:
            self._recent.popleft()

    @property
    def min_s(self) -> float:
        """The smallest recent sample: the path's propagation delay without the queueing that
        other transfers add (what a transfer estimate of rtt + bytes / goodput should use)."""
        return min(self._recent) if self._recent else self.initial_s

    @property
    def timeout_s(self) -> float:
        """A deadline for one round trip: srtt + 4 * rttvar (at least 10 ms)."""
        return max(0.01, self.srtt + 4 * self.rttvar)


class WanBacklog:
    """P's own WAN KV bytes towards MD that MD has not acknowledged yet, per request.

    A request's incremental KV is committed when MD's allocation says how much of it will cross
    and released when MD confirms it has all of it (KV_RECEIVED) or the transfer ends any other
    way (cancel, failure, dropped target, lost connection). Those bytes are ahead of a new
    request's on the line (or still to be computed by P ahead of its own), so the direct-budget
    test counts them (``PipelineInputs.wan_backlog_bytes``). Never negative; releasing an
    unknown or already released request does nothing.
    """

    __slots__ = ("_bytes", "_total")

    def __init__(self) -> None:
        self._bytes: dict[object, int] = {}
        self._total = 0

    @property
    def bytes(self) -> int:
        return self._total

    @property
    def pending(self) -> int:
        """Requests with committed, unacknowledged bytes."""
        return len(self._bytes)

    def commit(self, key: object, nbytes: int) -> None:
        """Request ``key`` will send ``nbytes`` to MD (replaces an earlier commitment)."""
        self.release(key)
        nbytes = int(nbytes)
        if nbytes > 0:
            self._bytes[key] = nbytes
            self._total += nbytes

    def release(self, key: object) -> int:
        """MD has them, or they will never cross: the bytes ``key`` had committed (0 if none)."""
        nbytes = self._bytes.pop(key, 0)
        self._total -= nbytes
        return nbytes

    def __contains__(self, key: object) -> bool:
        return key in self._bytes
