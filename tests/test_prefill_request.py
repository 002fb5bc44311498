"""P's side of one request, sans-IO (pddnet.lifecycle.prefill_request): each transition of the
machine, with the actions it gives out, without sockets, engine or clock."""

from __future__ import annotations

import pytest

from pddnet.lifecycle.actions import (
    AbortTarget,
    AskAllocation,
    CommitWan,
    Count,
    FailRequest,
    ObserveWanTransfer,
    ReleaseBlocks,
    ReleaseWan,
    ReportPipelineChange,
    ReportPipelineChoice,
    SendKvDone,
    StartPrefill,
    StopWrites,
    Timeline,
    Transfer,
)
from pddnet.lifecycle.prefill_request import (
    MAIN,
    RELAY,
    TARGET_TRANSITIONS,
    IllegalTransition,
    PrefillRequest,
    TargetState,
)
from pddnet.policy.cache_view import Observation
from pddnet.policy.pipeline import Pipeline, PipelineDecision, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner, Plan

P_MD, P_RLD_MD, RLD_ONLY = Pipeline.P_MD, Pipeline.P_RLD_MD, Pipeline.RLD_ONLY


def plan(pipeline: Pipeline, prompt: int = 40) -> Plan:
    planner = PipelinePlanner(
        PipelinePolicy(), 1024, bandwidth_bps=1e6, rtt_s=0.02, rld_step_s=0.01
    )
    return planner.plan([1] * prompt, 10, force=pipeline)


def singular(base: Plan) -> Plan:
    """The planner's recheck turning P->RLD->MD into P->RLD."""
    d = PipelineDecision(RLD_ONLY, "singular: RLD is done first", 0.5, 0)
    return Plan(d, base.inputs, base.prediction)


def kinds(actions: list) -> list[type]:
    return [type(a) for a in actions]


def counts(actions: list) -> list[str]:
    return [a.name for a in actions if isinstance(a, Count)]


def events(actions: list) -> list[str]:
    return [a.event for a in actions if isinstance(a, Timeline)]


def started(n: int, pipeline: Pipeline, targets: tuple[str, ...] | None = None) -> PrefillRequest:
    m = PrefillRequest(n, pipeline, targets)
    m.start()
    return m


def relayed(n: int = 10) -> PrefillRequest:
    """P->RLD->MD with both targets allocated (hit 0)."""
    m = started(n, P_RLD_MD)
    m.allocated(RELAY, 0, now=0.0)
    m.allocated(MAIN, 0, now=1.0)
    return m


# -- the flow of KV (moved from the PrefillFlow tests) ---------------------------------------------


def test_ships_each_range_once_from_the_hit_and_releases_last():
    m = started(40, P_RLD_MD)
    assert m.computed(16) == []  # nobody allocated yet
    assert m.allocated(RELAY, 0, now=0.0) == [
        Transfer(RELAY, 0, 16),
        AskAllocation(MAIN, P_RLD_MD, 0),  # RLD admitted it: MD is asked now
    ]
    assert m.computed(32) == [Transfer(RELAY, 16, 32)]
    acts = m.allocated(MAIN, 24, now=1.0)
    assert acts[:2] == [CommitWan(16), Transfer(MAIN, 24, 32)]  # from its hit
    assert Timeline("prefix_hit_tokens", 24) in acts
    assert m.computed(40) == [Transfer(RELAY, 32, 40), Transfer(MAIN, 32, 40)]
    assert m.first_token_sampled(7) == [
        Timeline("prefill_end", 40),
        SendKvDone(RELAY, 7),
        SendKvDone(MAIN, 7),
    ]
    assert m.kv_done_out(RELAY, 100) == [Timeline("rld_kv_sent", 100)]  # MD's copy still going
    assert m.kv_done_out(MAIN, 200) == [Timeline("wan_kv_sent", 200)]
    assert not m.over
    assert m.kv_received(200, now=3.0) == [
        ObserveWanTransfer(200, 2.0),
        Timeline("wan_kv_acked", 200),
        ReleaseBlocks(),
        ReleaseWan(),
    ]
    assert m.over and m.shipped
    assert m.cancel("late") == []


def test_late_allocation_gets_everything_and_done_at_once():
    m = started(10, P_MD, (MAIN,))
    m.computed(10)
    assert m.first_token_sampled(3) == [Timeline("prefill_end", 10)]
    acts = m.allocated(MAIN, 0, now=0.0)
    assert acts[:3] == [CommitWan(10), Transfer(MAIN, 0, 10), SendKvDone(MAIN, 3)]


def test_start_asks_the_first_target_and_reports_the_plan():
    p = plan(P_RLD_MD)
    m = PrefillRequest(40, P_RLD_MD, plan=p)
    assert m.targets == (RELAY, MAIN)
    assert m.start() == [
        Count("submitted"),
        Count("pipeline_p_rld_md"),
        ReportPipelineChoice(p),
        AskAllocation(RELAY, P_RLD_MD, 0),  # RLD never gets a predicted hit
        StartPrefill(),
    ]
    with pytest.raises(IllegalTransition, match="started already"):
        m.start()
    direct = PrefillRequest(40, P_MD, plan=p)
    assert AskAllocation(MAIN, P_MD, p.prediction.hit_tokens) in direct.start()


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="num_tokens"):
        PrefillRequest(0, P_MD)
    with pytest.raises(ValueError, match="distinct"):
        PrefillRequest(4, P_MD, (MAIN, MAIN))
    m = started(10, P_RLD_MD)
    with pytest.raises(ValueError, match="not a target"):
        m.allocated("router", 0, now=0.0)
    with pytest.raises(ValueError, match="hit_tokens 10 outside"):
        m.allocated(RELAY, 10, now=0.0)
    with pytest.raises(
        IllegalTransition, match="main_decode: allocated is not allowed when waiting"
    ):
        m.allocated(MAIN, 0, now=0.0)  # MD was not asked yet
    m.allocated(RELAY, 0, now=0.0)
    with pytest.raises(IllegalTransition, match="relay: allocated is not allowed when shipping"):
        m.allocated(RELAY, 0, now=0.0)  # answered twice
    with pytest.raises(ValueError, match="prefill progress 11"):
        m.computed(11)
    with pytest.raises(ValueError, match="first token sampled with 0/10"):
        m.first_token_sampled(1)
    with pytest.raises(IllegalTransition, match="kv_done_out is not allowed when shipping"):
        m.kv_done_out(RELAY, 0)


def test_finished_is_final_and_dropped_takes_only_late_answers():
    # the table covers each state but FINISHED as a source, and DROPPED is final but for late answers
    sources = {s for s, _ in TARGET_TRANSITIONS}
    assert TargetState.FINISHED not in sources
    assert {e for s, e in TARGET_TRANSITIONS if s is TargetState.DROPPED} == {"late_answer"}


# -- pipelines and their changes -------------------------------------------------------------------


def test_singular_filter_never_asks_main_decode():
    m = started(10, RLD_ONLY)
    acts = m.allocated(RELAY, 0, now=0.0)
    assert counts(acts) == ["wan_transfers_never_started"]
    assert not any(isinstance(a, AskAllocation) for a in acts)
    assert m.state(MAIN) is TargetState.DROPPED
    m.computed(10)
    assert m.first_token_sampled(5)[-1] == SendKvDone(RELAY, 5)
    assert m.kv_done_out(RELAY, 64) == [Timeline("rld_kv_sent", 64), ReleaseBlocks()]
    assert m.shipped


def test_relay_refusal_sends_the_request_p_md():
    m = started(10, P_RLD_MD)
    acts = m.refused(RELAY, "full")
    assert acts == [
        Count("relay_refused"),
        Timeline("relay_refused", None, "full"),
        Count("pipeline_p_rld_md_to_p_md"),
        ReportPipelineChange(P_MD, "RLD refused: full"),
        AskAllocation(MAIN, P_MD, 0),
    ]
    assert m.pipeline is P_MD and m.state(RELAY) is TargetState.DROPPED
    # MD refusing too leaves nobody: the request fails (no KV_ABORT to RLD, which refused)
    acts = m.refused(MAIN, "full too")
    assert acts == [
        FailRequest("kv_alloc_refused", "main_decode refused: full too"),
        ReleaseBlocks(),
    ]
    assert m.over and not m.shipped


def test_main_decode_refusal_with_relay_sufficing():
    m = started(10, P_RLD_MD)
    m.allocated(RELAY, 0, now=0.0)
    acts = m.refused(MAIN, "no room")
    assert acts == [Count("main_decode_refused"), Timeline("main_decode_refused", None, "no room")]
    assert not m.over
    assert m.computed(10) == [Transfer(RELAY, 0, 10)]
    assert m.first_token_sampled(1)[-1] == SendKvDone(RELAY, 1)
    assert m.kv_done_out(RELAY, 10) == [Timeline("rld_kv_sent", 10), ReleaseBlocks()]
    assert m.shipped  # MD left out, RLD holds it all: completed


def test_relay_refusal_when_it_is_the_only_target_fails():
    m = started(10, RLD_ONLY, (RELAY,))  # same-dc
    acts = m.refused(RELAY, "no room")
    assert acts == [FailRequest("kv_alloc_refused", "relay refused: no room"), ReleaseBlocks()]


def test_md_refusal_under_p_md_fails_and_aborts_the_others():
    # (P->MD after RLD refused is covered above; here the baseline cross-dc request)
    m = started(10, P_MD, (MAIN,))
    assert kinds(m.refused(MAIN, "x")) == [FailRequest, ReleaseBlocks]


def test_mds_answer_may_make_the_request_singular():
    base = plan(P_RLD_MD)
    m = PrefillRequest(40, P_RLD_MD, plan=base)
    m.start()
    m.allocated(RELAY, 0, now=0.0)
    m.computed(16)
    new = singular(base)
    seen = Observation(predicted_tokens=16, actual_tokens=0)
    acts = m.allocated(MAIN, 0, now=1.0, seen=seen, recheck=new)
    assert acts == [
        CommitWan(40),
        Transfer(MAIN, 0, 16),
        Timeline("prefix_hit_tokens", 0),
        Count("md_view_wrong"),
        Timeline("md_view_wrong", 16, "predicted 16, MD holds 0"),
        Count("pipeline_p_rld_md_to_p_rld"),
        ReportPipelineChange(RLD_ONLY, "singular: RLD is done first"),
        Count("wan_transfers_cancelled"),
        AbortTarget(MAIN, "singular traffic: singular: RLD is done first"),
        ReleaseWan(),  # MD's bytes will not cross: out of the WAN backlog at once
    ]
    assert m.plan is new and m.pipeline is RLD_ONLY and m.state(MAIN) is TargetState.DROPPED
    assert m.computed(40) == [Transfer(RELAY, 16, 40)]  # only RLD's copy goes on


def test_recheck_is_ignored_once_the_pipeline_is_no_longer_relayed():
    base = plan(P_RLD_MD)
    m = PrefillRequest(10, P_RLD_MD, plan=base)
    m.start()
    m.refused(RELAY, "full")  # now P->MD
    acts = m.allocated(MAIN, 0, now=0.0, recheck=singular(base))
    assert not any(isinstance(a, ReportPipelineChange) for a in acts)
    assert m.pipeline is P_MD


# -- failures ----------------------------------------------------------------------------------


def test_transfer_failure_to_md_leaves_rld_alone_under_p_rld_md():
    m = relayed()
    acts = m.transfer_failed(MAIN, "hung")
    assert acts == [
        Count("pipeline_p_rld_md_to_p_rld"),
        ReportPipelineChange(RLD_ONLY, "hung"),
        AbortTarget(MAIN, "hung"),
        ReleaseWan(),
    ]
    assert not m.over
    assert m.transfer_failed(MAIN, "again") == []  # MD is out already


def test_transfer_failure_to_rld_fails_the_request():
    m = relayed()
    acts = m.transfer_failed(RELAY, "dead")
    assert acts == [
        FailRequest("relay_lost", "dead"),
        AbortTarget(RELAY, "dead"),
        AbortTarget(MAIN, "dead"),
        ReleaseBlocks(),
        ReleaseWan(),
    ]
    assert m.transfer_failed(MAIN, "late") == [] and m.fail("x", "y") == []


def test_transfer_failure_under_p_md_fails_as_md_lost():
    m = started(10, P_MD, (MAIN,))
    m.allocated(MAIN, 0, now=0.0)
    assert m.transfer_failed(MAIN, "timeout")[0] == FailRequest("main_decode_lost", "timeout")


def test_peer_lost_before_kv_done_relay_continues():
    m = relayed()
    acts = m.peer_lost(MAIN, "md gone")
    assert acts == [
        StopWrites(MAIN, "md gone"),
        Count("main_lost_relay_continues"),
        Count("pipeline_p_rld_md_to_p_rld"),
        ReportPipelineChange(RLD_ONLY, "md gone"),
        ReleaseWan(),  # no KV_ABORT: it cannot reach MD
    ]
    assert not m.over and m.state(MAIN) is TargetState.DROPPED


def test_peer_lost_after_kv_done_out_but_before_acknowledgement():
    m = relayed()
    m.computed(10)
    m.first_token_sampled(2)
    m.kv_done_out(RELAY, 10)
    m.kv_done_out(MAIN, 10)
    acts = m.peer_lost(MAIN, "md gone")
    assert acts[0] == StopWrites(MAIN, "md gone")
    assert acts[-2:] == [ReleaseBlocks(), ReleaseWan()]  # RLD holds it all: P is done
    assert m.shipped and m.over


def test_peer_lost_after_the_target_finished_changes_nothing():
    m = relayed()
    m.computed(10)
    m.first_token_sampled(2)
    m.kv_done_out(RELAY, 10)
    assert m.peer_lost(RELAY, "rld gone") == []  # RLD holds its KV; P is not its carrier now


def test_relay_lost_before_it_answered_fails_as_relay_lost():
    m = started(10, P_RLD_MD)
    acts = m.peer_lost(RELAY, "rld gone")
    assert acts[:2] == [StopWrites(RELAY, "rld gone"), FailRequest("relay_lost", "rld gone")]
    assert acts[-1] == ReleaseBlocks()


def test_engine_failure_fails_only_a_prefill_in_progress():
    m = relayed()
    assert m.engine_failed("oom")[0] == FailRequest("engine_failed", "oom")
    done = relayed()
    done.computed(10)
    done.first_token_sampled(1)
    assert done.engine_failed("oom") == []


def test_answers_after_the_target_was_dropped():
    m = relayed()
    m.peer_lost(MAIN, "md gone")  # dropped while its transfer was on
    assert m.refused(MAIN, "late") == []
    assert m.allocation_unusable(MAIN, "late") == [AbortTarget(MAIN, "unusable allocation: late")]
    # whatever it reserved is given back (a dropped target may have been asked, not answered)
    assert m.allocated(MAIN, 0, now=2.0) == [AbortTarget(MAIN, "request no longer active")]


def test_unusable_allocation_is_given_back_then_refused():
    m = started(10, P_RLD_MD)
    m.allocated(RELAY, 0, now=0.0)
    acts = m.allocation_unusable(MAIN, "bad region")
    assert acts[0] == AbortTarget(MAIN, "unusable allocation: bad region")
    assert counts(acts) == ["main_decode_refused"] and not m.over


# -- cancel and KV_ABORT ---------------------------------------------------------------------------


def test_cancel_aborts_every_target_and_a_late_answer_is_given_back():
    m = started(10, P_RLD_MD)
    m.allocated(RELAY, 0, now=0.0)
    assert m.cancel("client went away") == [
        Count("cancelled"),
        AbortTarget(RELAY, "client went away"),
        AbortTarget(MAIN, "client went away"),
        ReleaseBlocks(),
    ]
    assert m.over and not m.shipped
    assert m.computed(10) == [] and m.first_token_sampled(1) == []  # the engine's last step


def test_an_answer_after_the_cancel_is_given_back_at_once():
    m = started(10, P_MD, (MAIN,))
    m.cancel("gone")
    assert m.allocated(MAIN, 0, now=0.0) == [AbortTarget(MAIN, "request no longer active")]
    assert m.state(MAIN) is TargetState.DROPPED


def test_cancel_during_transfer_stops_the_flow():
    m = relayed()
    m.computed(4)
    acts = m.cancel("stop", by="router")
    assert AbortTarget(MAIN, "stop") in acts and ReleaseWan() in acts
    assert m.computed(10) == []


def test_relay_finishing_first_cancels_mds_copy():
    m = relayed()
    m.computed(10)
    m.kv_written(MAIN, 4096)
    acts = m.cancel("relay finished", by=RELAY)
    assert acts[:3] == [
        Count("wan_transfers_cancelled"),
        Timeline("wan_cancelled", 4096, "relay finished"),
        Count("cancelled"),
    ]


def test_mds_kv_abort_under_p_rld_md_leaves_rld_serving_it():
    m = relayed()
    acts = m.cancel("replayed", by=MAIN)
    assert acts == [
        Count("pipeline_p_rld_md_to_p_rld"),
        ReportPipelineChange(RLD_ONLY, "main decode dropped it: replayed"),
        ReleaseWan(),
        AbortTarget(MAIN, "acknowledged: replayed"),  # MD may be fencing blocks
    ]
    assert not m.over


def test_mds_kv_abort_under_p_md_releases_ps_side():
    # a replay replaced MD's part: P's side is released, MD hears it back
    m = started(10, P_MD, (MAIN,))
    m.allocated(MAIN, 0, now=0.0)
    acts = m.cancel("replaced by a replay", by=MAIN)
    assert acts == [
        Count("cancelled"),
        AbortTarget(MAIN, "replaced by a replay"),
        ReleaseBlocks(),
        ReleaseWan(),
    ]


# -- the carriers the router reads -----------------------------------------------------------------


def test_rld_kv_sent_is_reported_when_p_hands_over_to_rld():
    m = relayed()
    m.computed(10)
    m.first_token_sampled(9)
    acts = m.kv_done_out(RELAY, 1234)
    assert acts == [Timeline("rld_kv_sent", 1234)]
    assert m.state(RELAY) is TargetState.FINISHED


def test_wan_kv_acked_for_p_md():
    m = started(10, P_MD, (MAIN,))
    m.allocated(MAIN, 2, now=5.0)
    m.computed(10)
    assert m.kv_received(8, now=5.5) == [ObserveWanTransfer(8, 0.5)]  # not all out: no ack
    m.first_token_sampled(1)
    m.kv_done_out(MAIN, 8)
    acts = m.kv_received(8, now=6.0)
    assert acts == [
        ObserveWanTransfer(8, 1.0),
        Timeline("wan_kv_acked", 8),
        ReleaseBlocks(),
        ReleaseWan(),
    ]
    assert m.shipped


def test_wan_backlog_is_committed_once_and_released_once():
    m = relayed()  # MD allocated: committed
    actions = m.cancel("x") + m.cancel("y") + m.kv_received(1, now=2.0)
    assert actions.count(ReleaseWan()) == 1
    never = started(10, RLD_ONLY)
    acts = never.allocated(RELAY, 0, now=0.0)
    assert CommitWan not in kinds(acts) and ReleaseWan not in kinds(acts)
