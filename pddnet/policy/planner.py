"""P's per-request pipeline planning: what P knows of MD and the WAN, turned into decisions.

Sans-IO (times and observations are passed in), so the prefill daemon and the simulator drive
the same object. It holds
- the view of MD's decode-side cache (``DecodeCacheView``, fed by CACHE_EVENTS and repaired by
  MD's authoritative answers),
- smoothed WAN goodput and RTT estimates (``BandwidthEstimator``, ``RttEstimator``),
- RLD's last reported time per output token,
and asks ``PipelinePolicy`` twice per request: before anything is sent (``plan``, on P's
predicted hit) and once MD has answered with its real hit (``recheck``): a request planned
P->RLD->MD whose real incremental KV turns out so large that RLD finishes first becomes
RLD-only (the singular filter), and MD frees what it had reserved.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from .cache_view import DecodeCacheView, HitPrediction, Observation
from .estimators import BandwidthEstimator, RttEstimator
from .pipeline import Pipeline, PipelineDecision, PipelineInputs, PipelinePolicy


@dataclass(frozen=True)
class Plan:
    decision: PipelineDecision
    inputs: PipelineInputs
    prediction: HitPrediction

    @property
    def pipeline(self) -> Pipeline:
        return self.decision.pipeline

    def record(self) -> dict[str, Any]:
        out = self.decision.record(self.inputs)
        out["predicted_hit_tokens"] = self.prediction.hit_tokens
        out["view_stale"] = self.prediction.stale
        return out


class PipelinePlanner:
    def __init__(self, policy: PipelinePolicy, kv_bytes_per_token: int, bandwidth_bps: float,
                 rtt_s: float = 0.03, rld_step_s: float = 0.02,
                 view: DecodeCacheView | None = None) -> None:
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        if rld_step_s <= 0:
            raise ValueError(f"rld_step_s must be > 0, got {rld_step_s}")
        self.policy = policy
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bandwidth = BandwidthEstimator(initial_bps=bandwidth_bps)
        self.rtt = RttEstimator(initial_s=rtt_s)
        self.rld_step_s = rld_step_s
        self.view = view if view is not None else DecodeCacheView()
        self.chosen: dict[str, int] = {p.wire: 0 for p in Pipeline}
        self.changed_after_answer = 0

    def reset_view(self) -> None:
        """A new connection to MD: what P knew of MD's cache no longer holds."""
        self.view = DecodeCacheView(max_hashes=self.view.max_hashes)

    def plan(self, prompt_token_ids: Sequence[int], max_tokens: int,
             rld_admits: bool = True, force: Pipeline | None = None) -> Plan:
        """Decide a new request's pipeline (``force``: a configured one, recorded as such)."""
        prediction = self.view.predict(prompt_token_ids)
        inputs = PipelineInputs(
            prompt_tokens=len(prompt_token_ids), hit_tokens=prediction.hit_tokens,
            max_tokens=max_tokens, kv_bytes_per_token=self.kv_bytes_per_token,
            # the propagation RTT: queueing behind other transfers is not this request's
            bandwidth_bps=self.bandwidth.bytes_per_s, rtt_s=self.rtt.min_s,
            rld_s_per_token=self.rld_step_s, rld_admits=rld_admits)
        decision = self.policy.decide(inputs)
        if force is not None:
            decision = PipelineDecision(force, "configured (policy.pipeline)",
                                        decision.wan_transfer_s, decision.incremental_bytes)
        plan = Plan(decision, inputs, prediction)
        self.chosen[plan.pipeline.wire] += 1
        return plan

    def md_answered(self, plan: Plan, hit_tokens: int, block_size: int) -> Observation:
        """MD's authoritative hit: count a misprediction and repair the view."""
        return self.view.observe(plan.prediction, hit_tokens, block_size)

    def recheck(self, plan: Plan, hit_tokens: int) -> Plan | None:
        """With MD's real hit, does a P->RLD->MD request become RLD-only? Returns the new
        plan, or None when the original stands. Only that change is made after MD answered:
        P->MD never gains a relay (RLD was not asked), and a relay already decoding stays."""
        if plan.pipeline is not Pipeline.P_RLD_MD or hit_tokens == plan.inputs.hit_tokens:
            return None
        inputs = replace(plan.inputs, hit_tokens=hit_tokens)
        decision = self.policy.decide(inputs)
        if decision.pipeline is not Pipeline.RLD_ONLY:
            return None
        self.changed_after_answer += 1
        return Plan(decision, inputs, plan.prediction)

    # -- observations ---------------------------------------------------------------------------

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.bandwidth.observe(nbytes, seconds)

    def observe_rtt(self, seconds: float) -> None:
        self.rtt.observe(seconds)

    def observe_rld_step(self, seconds_per_token: float) -> None:
        if seconds_per_token > 0:
            self.rld_step_s = seconds_per_token

    def counters(self) -> dict[str, Any]:
        return {"chosen": dict(self.chosen), "changed_after_answer": self.changed_after_answer,
                "bandwidth_bps": round(self.bandwidth.bytes_per_s, 1),
                "bandwidth_samples": self.bandwidth.samples, "srtt_s": round(self.rtt.srtt, 6),
                "min_rtt_s": round(self.rtt.min_s, 6),
                "rtt_samples": self.rtt.samples, "rld_step_s": round(self.rld_step_s, 6),
                "view": self.view.counters()}
