"""P's pipeline planner (pdd mode) as the daemon drives it: made from [policy] and [wan], asked
for each new request's plan -- forced onto the other decode tier while one is unreachable --
and fed what the request machines give out (MD's answers, the WAN backlog, goodput samples).
The planner itself is pddnet.policy.planner's; the request machine only takes its decisions."""

from __future__ import annotations

from pddnet.config import ClusterConfig
from pddnet.lifecycle.prefill_actions import CommitWan, ObserveWanTransfer, ReleaseWan
from pddnet.lifecycle.prefill_request import MAIN
from pddnet.policy.cache_view import Observation
from pddnet.policy.pipeline import Pipeline, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner, Plan
from pddnet.protocol import Submit

FED = (CommitWan, ReleaseWan, ObserveWanTransfer)  # the machine's actions the planner takes


def make_planner(config: ClusterConfig, bytes_per_token: int) -> PipelinePlanner:
    pol = config.policy
    mbit = pol.wan_bw_mbit or config.wan.bw_mbit or 1000.0
    policy = PipelinePolicy(
        direct_budget_s=pol.direct_budget_s,
        singular_filter=pol.singular_filter,
        singular_margin=pol.singular_margin,
    )
    return PipelinePlanner(
        policy,
        bytes_per_token,
        bandwidth_bps=mbit * 1e6 / 8,
        rtt_s=max(config.wan.rtt_ms, 1.0) / 1e3,
        rld_step_s=pol.rld_step_s,
    )


def plan_request(
    planner: PipelinePlanner, configured: str, sub: Submit, down: str | None, why: str | None
) -> Plan:
    """The plan of a new request. ``configured``: [policy] pipeline ("auto": the planner's
    choice); ``down``: the decode tier that is unreachable (``why``), so the other one serves."""
    force = None if configured == "auto" else Pipeline.from_wire(configured)
    if down is not None:
        force = Pipeline.RLD_ONLY if down == MAIN else Pipeline.P_MD
    return planner.plan(sub.prompt_token_ids, sub.max_tokens, force=force, why=why)


def md_answered(
    planner: PipelinePlanner, plan: Plan, hit_tokens: int, block_size: int
) -> tuple[Observation, Plan | None]:
    """MD's hit is authoritative: repair P's view of its cache, and recheck the pipeline."""
    return planner.md_answered(plan, hit_tokens, block_size), planner.recheck(plan, hit_tokens)


def feed(
    planner: PipelinePlanner, rid: str, action: CommitWan | ReleaseWan | ObserveWanTransfer
) -> None:
    """The machine's WAN backlog and goodput actions."""
    if isinstance(action, CommitWan):
        planner.wan_committed(rid, action.num_tokens * planner.kv_bytes_per_token)
    elif isinstance(action, ReleaseWan):
        planner.wan_released(rid)
    else:
        planner.observe_transfer(action.num_bytes, action.seconds)
