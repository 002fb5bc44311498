"""P's per-request pipeline planning: what P knows of MD and the WAN, turned into decisions.

Sans-IO (times and observations are passed in), so the prefill daemon and the simulator drive
the same object. It holds
- the view of MD's decode-side cache (``DecodeCacheView``, fed by CACHE_EVENTS and repaired by
  MD's authoritative answers),
- smoothed WAN goodput and RTT estimates (``BandwidthEstimator``, ``RttEstimator``),
- P's own KV bytes towards MD that MD has not acknowledged yet (``WanBacklog``: committed when
  MD's allocation answer fixes a request's incremental KV, released on KV_RECEIVED or when the
  transfer ends any other way); a new request's KV queues behind them, so the direct-budget
  test counts them,
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
from .estimators import FULL_WEIGHT_BYTES, BandwidthEstimator, RttEstimator, WanBacklog
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
    """One P's planning towards one MD. ``bandwidth``, ``rtt`` and ``backlog`` may be shared
    objects (the simulator shares its line's estimators among the planners of one P, or of all
    Ps); by default the planner makes its own (its goodput samples weighing fully from
    ``full_weight_bytes`` up)."""

    def __init__(
        self,
        policy: PipelinePolicy,
        kv_bytes_per_token: int,
        bandwidth_bps: float,
        rtt_s: float = 0.03,
        rld_step_s: float = 0.02,
        view: DecodeCacheView | None = None,
        *,
        bandwidth: BandwidthEstimator | None = None,
        rtt: RttEstimator | None = None,
        backlog: WanBacklog | None = None,
        full_weight_bytes: int = FULL_WEIGHT_BYTES,
    ) -> None:
        if kv_bytes_per_token < 1:
            raise ValueError(f"kv_bytes_per_token must be >= 1, got {kv_bytes_per_token}")
        if rld_step_s <= 0:
            raise ValueError(f"rld_step_s must be > 0, got {rld_step_s}")
        self.policy = policy
        self.kv_bytes_per_token = kv_bytes_per_token
        self.bandwidth = (
            bandwidth
            if bandwidth is not None
            else BandwidthEstimator(initial_bps=bandwidth_bps, full_weight_bytes=full_weight_bytes)
        )
        self.rtt = rtt if rtt is not None else RttEstimator(initial_s=rtt_s)
        self.backlog = backlog if backlog is not None else WanBacklog()
        self.rld_step_s = rld_step_s
        self.view = view if view is not None else DecodeCacheView()
        self.chosen: dict[str, int] = {p.wire: 0 for p in Pipeline}
        self.changed_after_answer = 0

    def reset_view(self) -> None:
        """A new connection to MD: what P knew of MD's cache no longer holds."""
        self.view = DecodeCacheView(max_hashes=self.view.max_hashes)

    def plan(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        rld_admits: bool = True,
        force: Pipeline | None = None,
        why: str | None = None,
    ) -> Plan:
        """Decide a new request's pipeline. ``force``: a pipeline imposed from outside, recorded
        with ``why`` (by default: configured in policy.pipeline)."""
        return self.plan_predicted(
            len(prompt_token_ids),
            self.view.predict(prompt_token_ids),
            max_tokens,
            rld_admits=rld_admits,
            force=force,
            why=why,
        )

    def plan_predicted(
        self,
        prompt_tokens: int,
        prediction: HitPrediction,
        max_tokens: int,
        hit_tokens: int | None = None,
        rld_admits: bool = True,
        force: Pipeline | None = None,
        why: str | None = None,
    ) -> Plan:
        """``plan`` with the view's prediction already made (the simulator predicts from the
        block hashes it keeps per conversation: ``DecodeCacheView.predict_from_hashes``).
        ``hit_tokens``: the predicted hit in tokens when the view counts in other units (the
        simulator's are units of several tokens); by default the prediction's."""
        hit = prediction.hit_tokens if hit_tokens is None else hit_tokens
        inputs = PipelineInputs(
            prompt_tokens=prompt_tokens,
            hit_tokens=hit,
            max_tokens=max_tokens,
            kv_bytes_per_token=self.kv_bytes_per_token,
            # the propagation RTT: queueing behind other transfers is not this request's, and
            # P's own share of that queue is counted in bytes (the backlog)
            bandwidth_bps=self.bandwidth.bytes_per_s,
            rtt_s=self.rtt.min_s,
            rld_s_per_token=self.rld_step_s,
            rld_admits=rld_admits,
            wan_backlog_bytes=self.backlog.bytes,
        )
        decision = self.policy.decide(inputs)
        if force is not None:
            decision = PipelineDecision(
                force,
                why or "configured (policy.pipeline)",
                decision.wan_transfer_s,
                decision.incremental_bytes,
            )
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

    def wan_committed(self, key: object, nbytes: int) -> None:
        """A request's ``nbytes`` of KV will cross to MD (MD's allocation answered)."""
        self.backlog.commit(key, nbytes)

    def wan_released(self, key: object) -> int:
        """MD acknowledged the request's KV, or it will not cross (cancel, failure, drop)."""
        return self.backlog.release(key)

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        self.bandwidth.observe(nbytes, seconds)

    def observe_rtt(self, seconds: float) -> None:
        self.rtt.observe(seconds)

    def observe_rld_step(self, seconds_per_token: float) -> None:
        if seconds_per_token > 0:
            self.rld_step_s = seconds_per_token

    def counters(self) -> dict[str, Any]:
        return {
            "chosen": dict(self.chosen),
            "changed_after_answer": self.changed_after_answer,
            "bandwidth_bps": round(self.bandwidth.bytes_per_s, 1),
            "bandwidth_samples": self.bandwidth.samples,
            "srtt_s": round(self.rtt.srtt, 6),
            "min_rtt_s": round(self.rtt.min_s, 6),
            "wan_backlog_bytes": self.backlog.bytes,
            "wan_backlog_requests": self.backlog.pending,
            "rtt_samples": self.rtt.samples,
            "rld_step_s": round(self.rld_step_s, 6),
            "view": self.view.counters(),
        }
