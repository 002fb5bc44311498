"""The decode side of a request (pddnet.lifecycle.decode_request), sans-IO: RLD's and MD's machine
driven by hand, every move checked against the transition table."""

from __future__ import annotations

import random

import pytest

from pddnet.engine.engine import StepOutput
from pddnet.engine.sequence import FinishReason
from pddnet.lifecycle import actions as act
from pddnet.lifecycle import prefill_messages
from pddnet.lifecycle.decode_request import TRANSITIONS, DecodeRequest, Phase, Role
from pddnet.lifecycle.replay_request import ReplayRequest
from pddnet.lifecycle.takeover_hold import TakeoverHold
from pddnet.policy.handoff import HandoffPolicy
from pddnet.protocol import KvAllocRequest, KvDone, Takeover
from tests.samples import kv_alloc_request

PROMPT = 10
EOS = 2


def alloc(
    rid: str = "r1", pipeline: str = "p_rld_md", max_tokens: int = 50, **kw
) -> KvAllocRequest:
    return kv_alloc_request(PROMPT, request_id=rid, max_tokens=max_tokens, pipeline=pipeline, **kw)


def kv_done(rid: str = "r1", first: int = 100, chunks: int = 0, nbytes: int = 0) -> KvDone:
    """KV_DONE as P sends it, for the whole prompt."""
    return prefill_messages.kv_done(rid, PROMPT, chunks, nbytes, first, None, 0.0)


def relay(mode: str = "one-shot", hands_off: bool = True, **kw) -> DecodeRequest:
    return DecodeRequest(
        Role.RELAY,
        alloc(**kw),
        hit_tokens=0,
        eos_token_id=EOS,
        one_sided=True,
        policy=HandoffPolicy(mode=mode, chunk=4, threshold_tokens=8),
        hands_off=hands_off,
    )


def main(pipeline: str = "p_rld_md", one_sided: bool = False, hit: int = 0) -> DecodeRequest:
    return DecodeRequest(
        Role.MAIN,
        alloc(pipeline=pipeline),
        hit_tokens=hit,
        eos_token_id=EOS,
        one_sided=one_sided,
        chunk_tokens=4,
    )


def step(
    index: int, tokens: list[int], computed: int, finish: FinishReason | None = None
) -> StepOutput:
    return StepOutput("r1", tokens, index, computed, 1, finish is not None, finish)


def reasons_of(out: StepOutput) -> list[str | None]:
    from pddnet.lifecycle.decode_tokens import step_end_reasons

    reasons = step_end_reasons(out, ())
    assert reasons is not None
    return reasons


def drive(m: DecodeRequest, event: str, *args):
    """Feed one event; check the move against TRANSITIONS (a stale event does nothing)."""
    before = m.phase
    actions = getattr(m, event)(*args)
    key = (m.role, before, event)
    if key in TRANSITIONS:
        assert m.phase in TRANSITIONS[key], (key, m.phase)
    else:
        assert actions == [] and m.phase is before, (key, actions)
    return actions


def engine(m: DecodeRequest, out: StepOutput):
    return drive(m, "engine_step", out, reasons_of(out))


# -- RLD -----------------------------------------------------------------------------------------


def test_relay_allocation_then_kv_done_starts_decoding_and_finishes_alone():
    m = relay(hands_off=False, pipeline="p_rld", max_tokens=3)
    assert m.phase is Phase.RECEIVING_KV
    acts = drive(m, "kv_done", kv_done(nbytes=640), 1.0)
    assert acts == [
        act.KvComplete(640),
        act.StartSequence((100,), hold=False),
        act.EmitTokens(0, (100,)),
    ]
    assert m.phase is Phase.DECODING
    assert engine(m, step(1, [101], PROMPT + 1)) == [act.EmitTokens(1, (101,))]
    acts = engine(m, step(2, [102], PROMPT + 2, FinishReason.LENGTH))
    # same-dc: nobody else to stop
    assert acts == [act.EmitTokens(2, (102,)), act.FinishRequest("length", 3), act.StopSequence()]
    assert m.phase is Phase.ENDED
    assert engine(m, step(3, [103], PROMPT + 3)) == []  # stale


def test_relay_rejects_a_kv_done_for_other_positions_and_tells_p_and_md():
    m = relay()
    bad = KvDone(request_id="r1", num_tokens=3, num_chunks=0, num_bytes=0, first_token_id=5, time=0)
    acts = drive(m, "kv_done", bad, 0.0)
    assert isinstance(acts[0], act.Failed) and acts[0].code == "relay_failed"
    assert [type(a) for a in acts[1:]] == [act.SendKvAbort, act.CancelPeer, act.StopSequence]
    assert m.writes_ended and m.phase is Phase.ENDED


def test_relay_first_token_that_ends_the_request_stops_p_and_md():
    m = relay()
    acts = drive(m, "kv_done", kv_done(first=EOS), 0.0)
    assert acts == [
        act.KvComplete(0),
        act.EmitTokens(0, (EOS,)),
        act.FinishRequest("eos", 1),
        act.SendKvAbort("relay finished the request"),
        act.StopSequence(),
        act.CancelPeer("relay finished the request"),
    ]


def relay_decoding(mode: str, n: int) -> DecodeRequest:
    """An RLD request (handoff `mode`) with its KV in and `n` tokens decoded (101, 102, ...)
    after P's first token (100)."""
    m = relay(mode)
    drive(m, "kv_done", kv_done(), 0.0)
    for i in range(1, n + 1):
        engine(m, step(i, [100 + i], PROMPT + i))
    return m


def test_relay_one_shot_handoff_cuts_at_the_takeover():
    m = relay_decoding("one-shot", 4)
    acts = drive(m, "takeover", PROMPT, 4, 0.1)
    assert isinstance(acts[0], act.HandoffStarted) and acts[0].mode == "one-shot"
    assert acts[1:] == [
        act.StopSequence(),
        act.SendHandoff(0, (100, 101, 102, 103, 104), True, "one-shot"),
    ]
    assert m.phase is Phase.ENDED
    assert drive(m, "takeover", PROMPT + 3, 4, 0.1) == []  # a late progress report


def test_relay_streaming_handoff_forwards_then_cuts_when_md_keeps_pace():
    m = relay_decoding("streaming", 9)
    acts = drive(m, "takeover", PROMPT, 4, 0.1)
    assert m.phase is Phase.STREAMING
    sent = [a for a in acts if isinstance(a, act.SendHandoff)]
    assert [(a.start_index, len(a.token_ids), a.final) for a in sent] == [
        (0, 4, False),
        (4, 4, False),
        (8, 2, False),
    ]
    # RLD keeps decoding and forwarding while MD digests
    acts = engine(m, step(10, [110], PROMPT + 10))
    assert acts == [act.EmitTokens(10, (110,))]
    # MD reports it digested everything it held: it keeps pace, RLD cuts
    acts = drive(m, "takeover", PROMPT + 10 - 1, 4, 0.1)
    assert acts[0] == act.StopSequence() and acts[-1].final and m.phase is Phase.ENDED


def test_relay_takeover_before_kv_done_waits_for_p_first_token():
    m = relay("one-shot")
    assert drive(m, "takeover", PROMPT, 4, 0.0) == []
    assert m.phase is Phase.RECEIVING_KV
    acts = drive(m, "kv_done", kv_done(), 0.0)
    assert act.StopSequence() in acts and act.SendHandoff(0, (100,), True, "one-shot") in acts


def test_relay_finishes_alone_when_md_is_lost_mid_stream():
    m = relay_decoding("streaming", 9)
    drive(m, "takeover", PROMPT, 4, 0.1)
    acts = drive(m, "peer_lost")
    assert acts == [act.HandoffAbandoned("main decode lost during a streaming handoff")]
    assert m.phase is Phase.DECODING and not m.has_peer
    acts = engine(m, step(10, [110], PROMPT + 10, FinishReason.STOP))
    assert acts == [act.EmitTokens(10, (110,)), act.FinishRequest("eos", 11), act.StopSequence()]


def test_relay_finishes_alone_when_md_drops_its_copy_before_the_cut():
    """MD's CANCEL (MD failed its copy) takes the path of MD's loss, with MD's reason."""
    m = relay_decoding("streaming", 9)
    drive(m, "takeover", PROMPT, 4, 0.1)
    acts = drive(m, "peer_lost", "main decode dropped it: bad HANDOFF")
    assert acts == [
        act.HandoffAbandoned("main decode dropped it: bad HANDOFF during a streaming handoff")
    ]
    assert m.phase is Phase.DECODING and not m.has_peer
    acts = engine(m, step(10, [110], PROMPT + 10, FinishReason.LENGTH))
    # MD was told already and P dropped MD's copy: nobody else to stop
    assert acts == [act.EmitTokens(10, (110,)), act.FinishRequest("length", 11), act.StopSequence()]
    receiving = relay()  # before P's KV_DONE: no TAKEOVER will come, decoding starts as usual
    assert drive(receiving, "peer_lost", "main decode dropped it: x") == [
        act.HandoffAbandoned("main decode dropped it: x")
    ]
    acts = drive(receiving, "kv_done", kv_done(), 0.0)
    assert act.StartSequence((100,), hold=False) in acts and not receiving.has_peer
    cut = relay_decoding("one-shot", 2)
    drive(cut, "takeover", PROMPT, 4, 0.1)
    assert drive(cut, "peer_lost", "main decode dropped it: x") == []  # past the cut: not ours


# -- MD ------------------------------------------------------------------------------------------


def test_main_counts_chunks_against_kv_done_then_asks_for_the_cut():
    m = main(hit=4)
    assert drive(m, "kv_chunk", 0, 4, 8, 300, 1.0) == [act.ImportChunk(0)]
    # KV_DONE overtook the second chunk: not complete yet
    assert drive(m, "kv_done", kv_done(chunks=2, nbytes=600), 1.5) == []
    assert drive(m, "chunk_imported", 300) == []
    assert drive(m, "kv_chunk", 1, 8, 10, 300, 2.0) == [act.ImportChunk(1)]
    acts = drive(m, "chunk_imported", 300)
    assert acts == [
        act.KvComplete(600),
        act.SendKvReceived(600, 300, 1.0),
        act.StartSequence((100,), hold=True),
        act.SendTakeover(PROMPT, 4),
    ]
    assert m.phase is Phase.WAITING_CUT


@pytest.mark.parametrize(
    "chunk, fault",
    [
        ((0, 4, 8), "duplicate chunk index"),
        ((1, 2, 6), "outside the uncached range"),
        ((1, 8, 12), "outside the uncached range"),
    ],
)
def test_main_aborts_a_chunk_that_is_not_this_requests(chunk, fault):
    m = main(hit=4)
    drive(m, "kv_chunk", 0, 4, 8, 300, 1.0)
    acts = drive(m, "kv_chunk", *chunk, 300, 1.1)
    assert isinstance(acts[0], act.Failed) and fault in acts[0].reason
    assert acts[-1] == act.StopSequence() and m.phase is Phase.ENDED


def test_main_aborts_more_bytes_than_kv_done_counts():
    m = main()
    drive(m, "kv_chunk", 0, 0, 10, 900, 1.0)
    drive(m, "kv_done", kv_done(chunks=1, nbytes=600), 1.0)
    acts = drive(m, "chunk_imported", 900)
    assert isinstance(acts[0], act.Failed) and "more than KV_DONE's" in acts[0].reason


def test_main_one_sided_completes_on_kv_done_and_refuses_chunks():
    m = main(one_sided=True)
    acts = drive(m, "kv_done", kv_done(nbytes=4096), 3.0)
    assert acts[:2] == [act.KvComplete(4096), act.SendKvReceived(4096, 4096, 0.0)]
    m2 = main(one_sided=True)
    acts = drive(m2, "kv_chunk", 0, 0, 10, 100, 1.0)
    assert isinstance(acts[0], act.Failed) and "one-sided" in acts[0].reason


def test_main_without_relay_decodes_from_index_zero():
    m = main(pipeline="p_md")
    acts = drive(m, "kv_done", kv_done(), 0.0)
    acts = drive(m, "kv_chunk", 0, 0, 10, 0, 0.0) + acts  # (no chunks: KV_DONE said 0)
    assert act.StartSequence((100,), hold=False) in acts and act.EmitTokens(0, (100,)) in acts
    assert m.phase is Phase.DECODING
    acts = engine(m, step(1, [101], PROMPT + 1, FinishReason.STOP))
    assert acts == [act.EmitTokens(1, (101,)), act.FinishRequest("eos", 2), act.StopSequence()]


def test_main_one_shot_handoff_then_decodes_from_the_cut_and_tells_rld_it_finished():
    m = main()
    drive(m, "kv_done", kv_done(), 0.0)
    assert engine(m, step(1, [], PROMPT)) == []  # held: digesting, nothing sampled
    acts = drive(m, "handoff", 0, (100, 101, 102), True, "one-shot", 60)
    assert acts == [
        act.SetChunk(None),
        act.AppendTokens((101, 102)),
        act.ReleaseHold(),
        act.HandoffEnded("one-shot", 3),
    ]
    assert m.phase is Phase.DECODING and m.handoff_bytes == 60
    acts = engine(m, step(3, [103], PROMPT + 3))
    assert acts == [act.EmitTokens(3, (103,)), act.FirstMainToken(3)]
    acts = engine(m, step(4, [104], PROMPT + 4, FinishReason.LENGTH))
    assert acts == [
        act.EmitTokens(4, (104,)),
        act.FinishRequest("length", 5),
        act.ForwardDone(),
        act.StopSequence(),
    ]


def test_main_streaming_handoff_reports_progress_when_it_has_digested_everything():
    m = main()
    drive(m, "kv_done", kv_done(), 0.0)
    acts = drive(m, "handoff", 0, (100, 101, 102, 103), False, "streaming", 50)
    assert acts == [act.SetChunk(4), act.AppendTokens((101, 102, 103))]
    assert engine(m, step(1, [], PROMPT + 3)) == [act.SendTakeover(PROMPT + 3, 4)]
    acts = drive(m, "handoff", 4, (104,), True, "streaming", 30)
    assert acts[-2:] == [act.ReleaseHold(), act.HandoffEnded("streaming", 5)]


def test_main_keeps_a_request_past_its_final_handoff_when_rlds_lane_closes():
    m = main()
    drive(m, "kv_done", kv_done(), 0.0)
    drive(m, "handoff", 0, (100, 101), True, "one-shot", 40)
    assert drive(m, "peer_lost") == [] and m.phase is Phase.DECODING
    waiting = main()
    drive(waiting, "kv_done", kv_done(), 0.0)
    acts = drive(waiting, "peer_lost")
    assert acts[0] == act.Failed(
        "main_decode_failed", "relay connection closed before the final handoff", False
    )
    assert acts[-1] == act.StopSequence() and waiting.phase is Phase.ENDED
    alone = main(pipeline="p_md")  # no relay: its loss changes nothing
    assert drive(alone, "peer_lost") == [] and alone.phase is Phase.RECEIVING_KV


def test_main_failing_its_copy_before_the_takeover_leaves_the_request_to_rld():
    """Before MD's TAKEOVER RLD cannot have cut: MD's failure is its copy's alone. The router
    is not told (a timeline note), P drops MD's copy, RLD is told and finishes alone."""
    why = "prefill control connection closed before the KV was complete"
    m = main()
    drive(m, "kv_chunk", 0, 0, 5, 300, 1.0)
    acts = drive(m, "abort", why)
    assert acts == [
        act.Failed("main_decode_failed", why, tell_router=False),
        act.SendKvAbort(why),
        act.CancelPeer(why),
        act.StopSequence(),
    ]
    assert m.phase is Phase.ENDED
    bad = main()  # a fault in P's copy: the same
    drive(bad, "kv_chunk", 0, 0, 5, 300, 1.0)
    acts = drive(bad, "kv_chunk", 0, 0, 5, 300, 1.1)
    assert acts[0] == act.Failed("main_decode_failed", acts[0].reason, tell_router=False)
    assert "duplicate chunk index" in acts[0].reason and act.CancelPeer(acts[0].reason) in acts
    # without a relay MD is the request's only decoder: its failure is the request's
    alone = main(pipeline="p_md")
    assert drive(alone, "abort", why)[0] == act.Failed("main_decode_failed", why)
    # from the TAKEOVER on RLD may have cut: the router is told and decides
    waiting = main()
    drive(waiting, "kv_done", kv_done(), 0.0)
    assert waiting.phase is Phase.WAITING_CUT
    acts = drive(waiting, "abort", "engine down", "engine_failed")
    assert (
        acts[0] == act.Failed("engine_failed", "engine down")
        and act.CancelPeer("engine down") in acts
    )


def test_main_rejects_a_handoff_that_contradicts_its_tokens():
    m = main()
    drive(m, "kv_done", kv_done(), 0.0)
    acts = drive(m, "handoff", 0, (999, 101), True, "one-shot", 40)
    assert isinstance(acts[0], act.Failed) and "bad HANDOFF" in acts[0].reason


def test_a_replay_replaces_mds_part_tells_p_and_ignores_stale_messages():
    m = main()
    drive(m, "kv_chunk", 0, 0, 10, 300, 1.0)
    acts = drive(m, "replaced")
    assert acts == [act.SendKvAbort("replayed on main decode by the router"), act.StopSequence()]
    assert m.phase is Phase.ENDED
    # the lost attempt's messages, arriving late, do nothing
    assert drive(m, "kv_done", kv_done(chunks=1, nbytes=300), 2.0) == []
    assert drive(m, "chunk_imported", 300) == []
    assert drive(m, "handoff", 0, (100,), True, "one-shot", 30) == []
    assert drive(m, "cancel") == []
    r = relay()
    assert drive(r, "replaced") == [act.StopSequence()]  # RLD: P's KV is local, nothing to tell


def test_cancel_by_kv_abort_marks_the_writes_ended():
    m = main(one_sided=True)
    assert not m.writes_ended
    assert drive(m, "cancel", True) == [act.StopSequence()]
    assert m.writes_ended


def test_random_event_sequences_stay_inside_the_table():
    rng = random.Random(25)
    for _ in range(300):
        m = relay(rng.choice(["one-shot", "streaming"])) if rng.random() < 0.5 else main()
        index, computed = 1, PROMPT
        for _ in range(rng.randrange(1, 14)):
            event = rng.choice(
                [
                    "kv_done",
                    "kv_chunk",
                    "chunk_imported",
                    "takeover",
                    "handoff",
                    "engine_step",
                    "peer_lost",
                    "cancel",
                    "replaced",
                ]
            )
            if event == "kv_done":
                drive(m, event, kv_done(), 0.0)
            elif event == "kv_chunk" and m.role is Role.MAIN:
                drive(m, event, rng.randrange(3), 0, PROMPT, 100, 0.0)
            elif event == "chunk_imported" and m.role is Role.MAIN and m.kv.imports_pending:
                drive(m, event, 100)
            elif event == "takeover" and m.role is Role.RELAY:
                drive(m, event, PROMPT + rng.randrange(index), 4, 0.1)
            elif event == "handoff" and m.role is Role.MAIN:
                drive(m, event, 0, (100,), rng.random() < 0.5, "one-shot", 30)
            elif event == "engine_step" and m.phase in (Phase.DECODING, Phase.STREAMING):
                engine(m, step(index, [100 + index], computed + 1))
                index, computed = index + 1, computed + 1
            elif event in ("peer_lost", "cancel", "replaced"):
                drive(m, event)


# -- the early-takeover hold (RLD) ---------------------------------------------------------------


def takeover(rid: str) -> Takeover:
    return Takeover(request_id=rid, ready_position=PROMPT, chunk_tokens=4)


def test_a_parked_takeover_is_claimed_by_its_allocation():
    hold = TakeoverHold(ttl_s=10.0, limit=8)
    assert hold.park(takeover("a"), 5.0) == [act.ArmTimer("a", 10.0, 5.0)]
    assert "a" in hold and len(hold) == 1
    assert hold.claim("a") == takeover("a")
    assert hold.claim("a") is None
    assert hold.expire("a", 5.0) == []  # its timer finds nothing to release


def test_a_parked_takeover_expires_by_its_own_timer_unless_parked_again():
    hold = TakeoverHold(ttl_s=10.0, limit=8)
    (timer,) = hold.park(takeover("a"), 5.0)
    hold.park(takeover("a"), 7.0)  # a newer report: the first timer is not its own
    assert hold.expire("a", timer.token) == []
    assert hold.expire("a", 7.0) == [act.CancelParked("a", "relay never received the request")]
    assert len(hold) == 0


def test_refusal_overflow_and_p_loss_release_parked_takeovers_with_a_cancel():
    hold = TakeoverHold(ttl_s=10.0, limit=2)
    hold.park(takeover("a"), 1.0)
    hold.park(takeover("b"), 2.0)
    acts = hold.park(takeover("c"), 3.0)
    assert acts[-1] == act.CancelParked("a", "relay never received the request")
    assert hold.release("b", "relay refused the request") == [
        act.CancelParked("b", "relay refused the request")
    ]
    assert hold.release("b", "again") == []
    assert hold.release_all("prefill connection closed") == [
        act.CancelParked("c", "prefill connection closed")
    ]


# -- replay by token ids --------------------------------------------------------------------------


def test_replay_emits_and_stops_an_extra_stop_token_the_engine_does_not_know():
    r = ReplayRequest(PROMPT, stop_token_ids=(55,))
    acts, lp = r.engine_step(step(3, [54], PROMPT + 3))
    assert acts == [act.EmitTokens(3, (54,))] and lp is None
    acts, _ = r.engine_step(step(4, [55], PROMPT + 4))
    assert acts == [act.EmitTokens(4, (55,)), act.FinishRequest("stop", 5), act.StopSequence()]
    r2 = ReplayRequest(PROMPT, stop_token_ids=())
    acts, _ = r2.engine_step(step(4, [9], PROMPT + 4, FinishReason.LENGTH))
    assert acts == [act.EmitTokens(4, (9,)), act.FinishRequest("length", 5)]  # the engine freed it
    assert r2.engine_step(step(0, [], 0, FinishReason.ABORT))[0] == []  # our own abort
