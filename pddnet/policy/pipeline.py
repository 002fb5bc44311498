"""Pipeline choice per request: P->MD, P->RLD->MD, or RLD alone (the singular-traffic filter).

The WAN is the scarce resource and RLD a small pool, so:
- P->MD when the incremental KV (positions MD does not hold) crosses within `direct_budget_s`,
  counting the bytes P has already committed to MD and MD has not acknowledged (they are ahead
  of this request's on the line): no relay needed (most high-hit agent traffic on a quiet line);
- RLD alone when RLD would finish the whole output before MD's copy could even arrive on an
  idle line (long uncached input, short output): the WAN transfer is never started or is
  cancelled;
- P->RLD->MD otherwise: RLD hides the transfer by decoding eagerly, then hands off by token ids;
- and whenever RLD refuses admission, P->MD: the request waits for its KV instead of flooding RLD.
"""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass


class Pipeline(str, enum.Enum):
    P_MD = "P->MD"
    P_RLD_MD = "P->RLD->MD"
    RLD_ONLY = "P->RLD"

    @property
    def wire(self) -> str:
        """The name on the wire (KV_ALLOC_REQUEST.pipeline) and in the `pdd` object."""
        return _WIRE[self]

    @classmethod
    def from_wire(cls, name: str) -> Pipeline:
        for p, w in _WIRE.items():
            if w == name:
                return p
        raise ValueError(f"unknown pipeline {name!r}; expected one of {', '.join(_WIRE.values())}")


_WIRE = {Pipeline.P_MD: "p_md", Pipeline.P_RLD_MD: "p_rld_md", Pipeline.RLD_ONLY: "p_rld"}


@dataclass(frozen=True)
class PipelineInputs:
    prompt_tokens: int
    hit_tokens: int  # P's view of MD's prefix hit (MD's answer wins later)
    max_tokens: int
    kv_bytes_per_token: int
    bandwidth_bps: float  # estimated WAN goodput, bytes/s
    rtt_s: float  # estimated WAN round trip
    rld_s_per_token: float  # RLD's estimated time per output token under its load
    rld_admits: bool  # RLD's admission answer (or P's view of it)
    # P's own KV bytes towards MD not yet acknowledged by MD (other requests'): they cross
    # before this request's, so its KV arrives after them (pddnet.policy.estimators.WanBacklog)
    wan_backlog_bytes: int = 0

    def incremental_bytes(self) -> int:
        return max(self.prompt_tokens - self.hit_tokens, 0) * self.kv_bytes_per_token

    def wan_transfer_s(self) -> float:
        """When MD would have this request's KV: the allocation round trip, then the bytes
        queued ahead of it and its own uncached KV at the estimated goodput."""
        return self.rtt_s + (self.wan_backlog_bytes + self.incremental_bytes()) / self.bandwidth_bps

    def own_transfer_s(self) -> float:
        """``wan_transfer_s`` on an idle line: this request's bytes alone."""
        return self.rtt_s + self.incremental_bytes() / self.bandwidth_bps


@dataclass(frozen=True)
class PipelineDecision:
    pipeline: Pipeline
    reason: str
    wan_transfer_s: float
    incremental_bytes: int

    def record(self, inputs: PipelineInputs) -> dict:
        """The decision and its inputs, for the request's `pdd` object."""
        return {
            "pipeline": self.pipeline.wire,
            "reason": self.reason,
            "estimated_wan_transfer_s": round(self.wan_transfer_s, 6),
            "incremental_kv_bytes": self.incremental_bytes,
            "wan_backlog_bytes": inputs.wan_backlog_bytes,
            "inputs": asdict(inputs),
        }


@dataclass(frozen=True)
class PipelinePolicy:
    direct_budget_s: float = 0.2  # P->MD when the KV crosses faster than this
    singular_filter: bool = True
    singular_margin: float = 1.0  # RLD alone if output_time * margin <= transfer time

    def __post_init__(self) -> None:
        if self.direct_budget_s < 0:
            raise ValueError(f"direct_budget_s must be >= 0, got {self.direct_budget_s}")
        if self.singular_margin <= 0:
            raise ValueError(f"singular_margin must be > 0, got {self.singular_margin}")

    def decide(self, x: PipelineInputs) -> PipelineDecision:
        if not 0 <= x.hit_tokens <= x.prompt_tokens:
            raise ValueError(f"hit_tokens {x.hit_tokens} outside 0..{x.prompt_tokens}")
        if x.bandwidth_bps <= 0:
            raise ValueError(f"bandwidth_bps must be > 0, got {x.bandwidth_bps}")
        if x.wan_backlog_bytes < 0:
            raise ValueError(f"wan_backlog_bytes must be >= 0, got {x.wan_backlog_bytes}")
        t_wan, nbytes = x.wan_transfer_s(), x.incremental_bytes()

        def out(p: Pipeline, why: str) -> PipelineDecision:
            return PipelineDecision(p, why, t_wan, nbytes)

        behind = f" behind {x.wan_backlog_bytes / 1e6:.1f} MB" if x.wan_backlog_bytes else ""
        if t_wan <= self.direct_budget_s:
            return out(
                Pipeline.P_MD,
                f"KV crosses in {t_wan * 1e3:.0f} ms{behind} <= budget "
                f"{self.direct_budget_s * 1e3:.0f} ms",
            )
        if not x.rld_admits:
            return out(Pipeline.P_MD, "RLD refused admission: wait for the KV on MD")
        rld_output_s = x.max_tokens * x.rld_s_per_token
        # The filter compares with the request's own crossing time, without the backlog: a
        # request RLD keeps never reaches MD's cache (its conversation's next turn misses
        # there), and RLD is a small pool. Counting the backlog here too moved 3.5x as many
        # requests to RLD alone in the simulator's --quick scenario, where their turns then
        # fell behind the baseline's; it did shorten the full scenario's tail
        # (docs/simulator.md, "Session 4: where the simulator differed from the daemons").
        t_own = x.own_transfer_s()
        if self.singular_filter and rld_output_s * self.singular_margin <= t_own:
            return out(
                Pipeline.RLD_ONLY,
                f"RLD finishes {x.max_tokens} tokens in "
                f"{rld_output_s * 1e3:.0f} ms before the KV crosses "
                f"({t_own * 1e3:.0f} ms)",
            )
        return out(Pipeline.P_RLD_MD, f"KV needs {t_wan * 1e3:.0f} ms{behind}: RLD hides it")
