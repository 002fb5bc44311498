"""P's pipeline planner (pdd mode) as the daemon drives it: made from [policy] and [wan], asked
for each new request's plan and machine (a baseline mode's is fixed) -- forced onto the other decode tier while one is unreachable --
and fed what the request machines give out (MD's answers, the WAN backlog, goodput samples).
The planner itself is pddnet.policy.planner's; the request machine only takes its decisions."""

from __future__ import annotations

import dataclasses
import secrets
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.lifecycle.actions import CommitWan, ObserveWanTransfer, ReleaseWan
from pddnet.lifecycle.prefill_request import MAIN, RELAY, PrefillRequest
from pddnet.policy.cache_view import Observation
from pddnet.policy.pipeline import Pipeline, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner, Plan
from pddnet.protocol import Submit

from .peer import Peer

FED = (CommitWan, ReleaseWan, ObserveWanTransfer)  # the machine's actions the planner takes
# Whom P ships to, per mode (pdd: the pipeline of each request picks among them).
TARGETS_OF_MODE: dict[ClusterMode, tuple[str, ...]] = {
    ClusterMode.PDD: (RELAY, MAIN),
    ClusterMode.CROSS_DC: (MAIN,),
    ClusterMode.SAME_DC: (RELAY,),
}
FIXED_PIPELINES = {ClusterMode.CROSS_DC: Pipeline.P_MD, ClusterMode.SAME_DC: Pipeline.RLD_ONLY}


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
        full_weight_bytes=pol.goodput_full_weight_bytes,
    )


@dataclass(frozen=True)
class Refusal:
    """No decode tier can take a new request: ERROR(code) to the router."""

    code: str
    message: str


def admit(
    sub: Submit,
    known: bool,
    config: ClusterConfig,
    targets: tuple[str, ...],
    control: Mapping[str, Peer],
    planner: PipelinePlanner | None,
    counters: Counter[str],
) -> tuple[Submit, PrefillRequest] | Refusal:
    """A new request (``known``: its id is in use or ended here) and its machine: a baseline
    mode's fixed pipeline, or (pdd mode) the planner's plan, forced onto the other decode tier
    while one is unreachable. The SUBMIT gains a concrete seed when it samples without one."""
    rid = sub.request_id
    if known:
        return Refusal("duplicate_request", f"request id {rid!r} is already in use")
    if sub.output_token_ids:
        msg = "P prefills new requests only; a replay with output_token_ids goes to a decode"
        return Refusal("bad_request", msg + " instance")
    if sub.temperature > 0 and sub.seed is None:
        # A concrete seed before the request fans out: every tier then samples alike.
        sub = dataclasses.replace(sub, seed=secrets.randbits(63))
    down = [t for t in targets if not control[t].alive]
    if planner is None:
        if down:  # a baseline has nobody else to send it to
            return Refusal(
                f"{down[0]}_lost", f"{down[0]} is unreachable: {control[down[0]].last_loss}"
            )
        return sub, PrefillRequest(len(sub.prompt_token_ids), FIXED_PIPELINES[config.mode], targets)
    if len(down) > 1:
        return Refusal("no_decode_tier", "neither relay nor main decode is reachable")
    why = None
    if down:  # the other decode tier is the fallback while one is unreachable
        peer = control[down[0]]
        why = f"{down[0]} unreachable: {peer.link().describe(peer.name)}"[:300]
        counters[f"{down[0]}_down_rerouted"] += 1
    plan = plan_request(planner, config.policy.pipeline, sub, down[0] if down else None, why)
    return sub, PrefillRequest(len(sub.prompt_token_ids), plan.pipeline, plan=plan)


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
