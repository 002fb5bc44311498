"""The router's request machine, sans-IO: messages and clock events in, actions out."""

from __future__ import annotations

import dataclasses

import pytest

from pddnet.api.parse import parse_completion_request
from pddnet.api.types import CompletionRequest, ModelInfo
from pddnet.lifecycle.actions import CancelAll, Replay, Stalled, TokenGaps
from pddnet.lifecycle.assembler import StreamAssembler
from pddnet.lifecycle.choice_text import ChoiceText
from pddnet.lifecycle.pdd_object import RouterFacts
from pddnet.lifecycle.router_request import RouterRequest
from pddnet.model.tokenizer import ByteTokenizer
from pddnet.protocol import messages as m
from tests.samples import pipeline_choice, pipeline_inputs

TOK = ByteTokenizer()
MODEL = ModelInfo("tiny", TOK.vocab_size, max_position=1024, eos_token_id=TOK.eos_token_id)
ALL = frozenset({"prefill", "relay", "main_decode"})
RID = "cmpl-1"


def request(max_tokens: int = 8, stop: tuple[str, ...] = ()) -> CompletionRequest:
    """A greedy request for three prompt ids, as the router's HTTP front parses it."""
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": max_tokens, "temperature": 0}
    body.update(ignore_eos=True, stop=list(stop))
    return parse_completion_request(body, MODEL, TOK.encode, max_tokens_limit=1024)


def machine(
    req: CompletionRequest | None = None,
    facts: RouterFacts | None = None,
    peers=ALL,
    arrival: float = 100.0,
) -> RouterRequest:
    req = req or request()
    return RouterRequest(
        RID,
        req,
        seed=7,
        assembler=StreamAssembler(req.max_tokens, None, (), req.ignore_eos),
        text=ChoiceText(lambda ids: TOK.decode(ids, skip_special=True), req.stop),
        arrival=arrival,
        facts=facts or RouterFacts(mode="pdd", default_pipeline="p_rld_md"),
        peers=peers,
    )


def timeline(event: str, producer: str, number: int | None = None, label: str = "") -> m.Timeline:
    return m.Timeline(
        request_id=RID,
        event=event,
        time=101.0,
        producer=producer,
        detail_int=number,
        detail_str=label,
    )


def tokens(index: int, ids: tuple[int, ...], producer: str) -> m.TokenEvent:
    return m.TokenEvent(request_id=RID, index=index, token_ids=ids, producer=producer, time=1.0)


def choice(pipeline: str = "p_md") -> m.PipelineChoice:
    return pipeline_choice(
        request_id=RID,
        pipeline=pipeline,
        reason="rule 2",
        wan_transfer_s=0.1234567,
        incremental_bytes=4096,
        time=100.5,
    )


# -- carriers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pipeline", "events", "owner", "carriers"),
    [
        ("p_rld_md", [("rld_kv_sent", "prefill")], "relay", {"relay"}),
        ("p_rld_md", [("rld_kv_complete", "relay")], "relay", {"relay"}),
        ("p_rld_md", [("rld_kv_complete", "relay"), ("handoff_start", "relay")], "relay",
         {"relay", "main_decode"}),
        ("p_rld_md", [("rld_kv_complete", "relay"), ("handoff_end", "relay")], "main_decode",
         {"main_decode"}),
        # md_kv_complete and wan_kv_acked move the request only on p_md
        ("p_rld_md", [("md_kv_complete", "main_decode")], "prefill", {"prefill"}),
        ("p_rld_md", [("wan_kv_acked", "prefill")], "prefill", {"prefill"}),
        ("p_md", [("md_kv_complete", "main_decode")], "main_decode", {"main_decode"}),
        ("p_md", [("wan_kv_acked", "prefill")], "main_decode", {"main_decode"}),
        # rld_kv_sent is P's news: it moves the request only while P owns it
        ("p_rld_md", [("handoff_end", "relay"), ("rld_kv_sent", "prefill")], "main_decode",
         {"main_decode"}),
        # milestones that carry no move
        ("p_rld_md", [("prefill_start", "prefill"), ("wan_kv_sent", "prefill")], "prefill",
         {"prefill"}),
    ],
)  # fmt: skip
def test_the_carrier_table(pipeline, events, owner, carriers):
    r = machine()
    assert r.receive(choice(pipeline), "prefill", 100.5, ALL) == []
    for event, producer in events:
        assert r.receive(timeline(event, producer), producer, 101.0, ALL) == []
    assert (r.owner, r.carriers()) == (owner, carriers)


def test_the_submit_to_p_carries_the_prompt_seed_sampling_and_handoff_mode():
    sub = machine(request(max_tokens=5)).submit(handoff_mode="streaming")
    assert (sub.request_id, sub.prompt_token_ids, sub.seed) == (RID, (1, 2, 3), 7)
    assert (sub.max_tokens, sub.temperature, sub.ignore_eos) == (5, 0.0, True)
    assert (sub.handoff_mode, sub.output_token_ids) == ("streaming", ())


def test_tokens_make_their_producer_the_owner():
    r = machine()
    r.receive(tokens(0, (72,), "relay"), "relay", 101.0, ALL)
    assert r.owner == "relay" and r.assembler.tokens == [72]


# -- replays -------------------------------------------------------------------------------------


def test_a_lost_carrier_is_replayed_by_token_ids_on_the_other_tier():
    r = machine()
    r.receive(tokens(0, (72, 105), "relay"), "relay", 101.0, ALL)
    assert r.peer_lost("main_decode", "gone", 102.0, ALL - {"main_decode"}) == []  # not a carrier
    [replay] = r.peer_lost("relay", "heartbeat deadline", 102.0, ALL - {"relay"})
    assert isinstance(replay, Replay) and replay.target == "main_decode"
    sub = replay.submit
    assert (sub.request_id, sub.prompt_token_ids, sub.output_token_ids) == (
        RID,
        (1, 2, 3),
        (72, 105),
    )
    assert sub.seed == 7 and sub.max_tokens == 8
    assert (r.replays, r.replay_target, r.owner, r.carriers()) == (
        1,
        "main_decode",
        "main_decode",
        {"main_decode"},
    )
    assert not r.assembler.strict  # the replaced attempt may still deliver the same tokens
    assert r.timeline[-1].event == "replay" and "from index 2" in r.timeline[-1].detail


@pytest.mark.parametrize("news", ["rld_kv_sent", "handoff_start"])
def test_replay_at_once_when_a_new_carrier_is_already_gone(news):
    """The loss of RLD (or MD) reached the router before the news that made it a carrier."""
    r = machine()
    producer = "prefill" if news == "rld_kv_sent" else "relay"
    lost = "relay" if news == "rld_kv_sent" else "main_decode"
    up = ALL - {lost}
    assert r.peer_lost(lost, "killed", 101.0, up) == []  # not a carrier yet: nothing to do
    [replay] = r.receive(timeline(news, producer), producer, 101.5, up)
    assert isinstance(replay, Replay) and replay.lost == lost
    assert replay.target == ({"relay", "main_decode"} - {lost}).pop()
    assert f"before its {news} reached the router" in replay.why


def test_no_tier_left_fails_the_request_as_unavailable():
    r = machine(peers=frozenset({"prefill", "relay"}))
    r.receive(timeline("rld_kv_sent", "prefill"), "prefill", 101.0, {"prefill", "relay"})
    assert r.peer_lost("relay", "killed", 102.0, {"prefill"}) == []
    assert r.failed and (r.error_code, r.error_status) == ("relay_lost", 503)
    assert "lost the connection to relay: killed" in r.assembler.error


def test_a_lost_error_from_the_carrier_replays_other_errors_fail():
    r = machine()
    lost = m.ErrorMessage(request_id=RID, code="main_decode_lost", message="md died")
    [replay] = r.receive(lost, "relay", 101.0, ALL - {"main_decode"})
    assert replay.target == "relay" and replay.lost == "main_decode"
    r2 = machine()
    r2.receive(m.ErrorMessage(request_id=RID, code="internal", message="bug"), "prefill", 1.0, ALL)
    assert r2.failed and (r2.error_code, r2.error_status) == ("internal", 500)


def error(code: str, message: str) -> m.ErrorMessage:
    return m.ErrorMessage(request_id=RID, code=code, message=message)


def test_md_failing_its_copy_before_the_handoff_leaves_the_request_to_rld():
    r = machine(request(max_tokens=3))
    r.receive(choice("p_rld_md"), "prefill", 100.5, ALL)
    r.receive(timeline("rld_kv_complete", "relay"), "relay", 101.0, ALL)
    r.receive(tokens(0, (72,), "relay"), "relay", 101.1, ALL)
    err = error("main_decode_failed", "prefill control connection closed")
    assert r.receive(err, "main_decode", 101.2, ALL) == []  # noted, RLD goes on
    assert not r.failed and r.error_code is None and r.carriers() == {"relay"}
    assert r.timeline[-1].event == "error" and r.timeline[-1].producer == "main_decode"
    r.receive(tokens(1, (105, 33), "relay"), "relay", 101.3, ALL)
    assert r.finished and not r.failed and r.assembler.tokens == [72, 105, 33]


@pytest.mark.parametrize("error_first", [False, True])
def test_md_failing_its_copy_during_the_handoff_is_replayed_on_rld(error_first):
    """From RLD's handoff_start on RLD may have cut: MD's failure is a carrier's, replayed on
    RLD as MD's loss would be, also when the error overtook the handoff_start."""
    r = machine()
    r.receive(timeline("rld_kv_complete", "relay"), "relay", 101.0, ALL)
    r.receive(tokens(0, (72, 105), "relay"), "relay", 101.1, ALL)
    news = [
        (timeline("handoff_start", "relay", 2, "one-shot"), "relay"),
        (error("engine_failed", "MD's engine stopped"), "main_decode"),
    ]
    if error_first:
        news.reverse()
    assert r.receive(*news[0], 101.2, ALL) == []
    [replay] = r.receive(*news[1], 101.3, ALL)
    assert isinstance(replay, Replay) and (replay.target, replay.lost) == ("relay", "main_decode")
    assert replay.submit.output_token_ids == (72, 105) and not r.failed
    assert ("failed it before its handoff_start" in replay.why) is error_first


def test_a_decode_tier_failing_after_the_other_took_the_request_over():
    # RLD past the cut (MD carries the request): RLD's error changes nothing
    r = machine()
    r.receive(timeline("rld_kv_complete", "relay"), "relay", 101.0, ALL)
    r.receive(timeline("handoff_end", "main_decode", 40, "one-shot"), "main_decode", 101.1, ALL)
    assert r.receive(error("relay_failed", "engine down"), "relay", 101.2, ALL) == []
    assert not r.failed and r.carriers() == {"main_decode"}
    # MD's own failure past the cut is the request's, as before
    assert r.receive(error("main_decode_failed", "bad"), "main_decode", 101.3, ALL) == []
    assert r.failed and r.error_code == "main_decode_failed"
    # while P still carries it (P->MD before MD acknowledged the copy), MD's error fails it too
    r2 = machine()
    r2.receive(choice("p_md"), "prefill", 100.5, ALL)
    r2.receive(error("main_decode_failed", "bad KV_CHUNK"), "main_decode", 101.0, ALL)
    assert r2.failed and r2.error_code == "main_decode_failed"


def test_stale_messages_of_a_replaced_attempt_are_ignored():
    r = machine()
    r.receive(tokens(0, (72,), "relay"), "relay", 101.0, ALL)
    [replay] = r.peer_lost("relay", "hung", 102.0, ALL - {"relay"})
    assert replay.target == "main_decode"
    # the hung RLD wakes up: its error, its milestones and its tokens change nothing
    err = m.ErrorMessage(request_id=RID, code="main_decode_lost", message="RLD's view")
    assert r.receive(err, "relay", 103.0, ALL) == []
    assert r.receive(timeline("handoff_end", "relay"), "relay", 103.0, ALL) == []
    r.receive(tokens(1, (105,), "relay"), "relay", 103.0, ALL)
    assert not r.failed and (r.owner, r.carriers()) == ("main_decode", {"main_decode"})
    assert r.assembler.tokens == [72, 105]  # the same tokens are welcome from anyone
    r.receive(tokens(1, (105, 33), "main_decode"), "main_decode", 104.0, ALL)  # a duplicate index
    assert r.assembler.tokens == [72, 105, 33] and not r.failed
    # a second loss is not replayed again: once per request
    assert r.peer_lost("main_decode", "killed", 105.0, {"prefill", "relay"}) == []
    assert r.failed and r.error_code == "main_decode_lost"


def test_stall_replays_once_and_is_counted():
    r = machine(arrival=100.0)
    r.receive(tokens(0, (72,), "relay"), "relay", 101.0, ALL)
    assert r.stalled(130.9, 30.0, ALL) == []  # not yet
    stalled, replay = r.stalled(131.0, 30.0, ALL)
    assert isinstance(stalled, Stalled) and "last carried by relay" in stalled.why
    assert isinstance(replay, Replay) and replay.target == "main_decode"  # not the silent one
    assert r.stalled(200.0, 30.0, ALL) == []  # replayed already: no second stall replay


def test_stall_replays_on_the_silent_carrier_when_it_is_the_only_tier():
    r = machine(peers=frozenset({"prefill", "relay"}))
    r.receive(tokens(0, (72,), "relay"), "relay", 101.0, {"prefill", "relay"})
    stalled, replay = r.stalled(140.0, 30.0, {"prefill", "relay"})
    assert replay.target == "relay" and replay.lost == "none"


def test_a_replay_that_cannot_be_sent_fails_the_request():
    r = machine()
    [replay] = r.peer_lost("prefill", "killed", 101.0, ALL - {"prefill"})
    r.replay_failed(replay, "connection closed")
    assert r.failed and r.error_code == "prefill_lost"
    assert "replay on relay failed: connection closed" in r.assembler.error


# -- assembling --------------------------------------------------------------------------------


def test_token_gaps_and_first_token():
    r = machine(facts=RouterFacts(mode="pdd", default_pipeline="p_rld_md", dilation=2.0))
    assert r.receive(tokens(0, (72,), "relay"), "relay", 101.0, ALL) == []
    [gaps] = r.receive(tokens(1, (105, 33), "relay"), "relay", 101.5, ALL)
    assert gaps == TokenGaps((0.25, 0.0))  # modelled seconds: / dilation
    assert [e.event for e in r.timeline] == ["arrival", "first_token"]


def test_a_stop_string_ends_the_choice_and_cancels_the_daemons():
    r = machine(request(stop=("!",)))
    [cancel] = r.receive(tokens(0, (72, 105, 33, 63), "relay"), "relay", 101.0, ALL)
    assert cancel == CancelAll(RID, "stop string") and r.cancel_sent
    assert r.assembler.finish_reason == "stop" and r.router_stopped and r.stop_reason == "!"
    assert r.text.text == "Hi" and not r.awaits_done_notice


def test_done_notice_is_awaited_after_the_last_token():
    r = machine(request(max_tokens=2))
    r.receive(tokens(0, (72, 105), "relay"), "relay", 101.0, ALL)
    assert r.finished and r.awaits_done_notice
    done = m.RequestDone(
        request_id=RID,
        reason="length",
        num_prompt_tokens=3,
        num_output_tokens=2,
        producer="relay",
        time=101.2,
    )
    r.receive(done, "relay", 101.3, ALL)
    assert r.done_seen and not r.awaits_done_notice


def test_time_out_is_a_504():
    r = machine()
    r.time_out(30.0)
    assert r.failed and (r.error_code, r.error_status) == ("timeout", 504)


# -- the pdd object -------------------------------------------------------------------------------


def test_the_pdd_object_fields_and_key_order():
    facts = RouterFacts(
        mode="cross-dc",
        default_pipeline="p_md",
        dilation=2.0,
        wire_scale=4.0,
        emulation={"dilation": 2.0},
    )
    r = machine(request(max_tokens=2), facts=facts, arrival=100.0)
    r.receive(choice("p_rld_md"), "prefill", 100.5, ALL)
    r.receive(timeline("prefill_start", "prefill", label="p_md"), "prefill", 100.6, ALL)
    r.receive(timeline("prefix_hit_tokens", "prefill", 16), "prefill", 100.6, ALL)
    r.receive(timeline("kv_transport", "prefill", label="relay=mooncake"), "prefill", 100.6, ALL)
    r.receive(timeline("wan_kv_sent", "prefill", 4000), "prefill", 100.6, ALL)
    r.receive(timeline("md_kv_complete", "main_decode", 4096), "main_decode", 100.7, ALL)
    change = m.PipelineChange(request_id=RID, pipeline="p_md", reason="RLD full", time=100.8)
    r.receive(change, "prefill", 100.8, ALL)
    r.receive(timeline("handoff_end", "relay", 512, "one-shot"), "relay", 100.9, ALL)
    r.receive(tokens(0, (72,), "relay"), "relay", 101.0, ALL)
    r.receive(tokens(1, (105,), "main_decode"), "main_decode", 101.2, ALL)
    r.finish(102.0)
    pdd = r.pdd().to_json()
    assert list(pdd) == [
        "request_id",
        "mode",
        "seed",
        "ttft_s",
        "emulation",
        "pipeline",
        "handoff_mode",
        "relay_tokens",
        "main_tokens",
        "prefill_tokens",
        "wan_kv_bytes",
        "target_wan_kv_bytes",
        "handoff_bytes",
        "prefix_hit_tokens",
        "replays",
        "transport",
        "pipeline_decision",
        "pipeline_changes",
        "finish_reason",
        "warnings",
        "timeline",
    ]
    timeline_ = pdd.pop("timeline")
    assert pdd == {
        "request_id": RID,
        "mode": "cross-dc",
        "seed": 7,
        "ttft_s": 0.5,  # (101.0 - 100.0) / dilation
        "emulation": {"dilation": 2.0},
        "pipeline": "p_md",  # P's change; prefill_start's label did not override the choice
        "handoff_mode": "one-shot",
        "relay_tokens": 1,
        "main_tokens": 1,
        "prefill_tokens": 0,
        "wan_kv_bytes": 4096,  # MD's count wins over P's
        "target_wan_kv_bytes": 1024,
        "handoff_bytes": 512,
        "prefix_hit_tokens": 16,
        "replays": 0,
        "transport": {"relay": "mooncake"},
        "pipeline_decision": {
            "pipeline": "p_rld_md",
            "reason": "rule 2",
            "estimated_wan_transfer_s": 0.123457,
            "incremental_kv_bytes": 4096,
            "wan_backlog_bytes": 0,
            "inputs": dataclasses.asdict(pipeline_inputs()),
            "predicted_hit_tokens": 0,
            "view_stale": False,
        },
        "pipeline_changes": [{"pipeline": "p_md", "reason": "RLD full"}],
        "finish_reason": "length",
        "warnings": [],
    }
    assert timeline_[0] == {
        "event": "arrival",
        "time": 100.0,
        "producer": "router",
        "detail": 3,
        "t_s": 0.0,
    }
    handoff = next(e for e in timeline_ if e["event"] == "handoff_end")
    assert handoff["detail"] == {"value": 512, "label": "one-shot"}
    assert [e["time"] for e in timeline_] == sorted(e["time"] for e in timeline_)
    assert timeline_[-1]["event"] == "done" and timeline_[-1]["t_s"] == 1.0


def test_the_pdd_object_defaults():
    r = machine(facts=RouterFacts(mode="pdd", default_pipeline="p_rld_md"))
    r.receive(timeline("wan_kv_sent", "prefill", 4000), "prefill", 100.6, ALL)
    pdd = r.pdd().to_json()
    assert pdd["pipeline"] == "p_rld_md" and pdd["pipeline_decision"] is None
    assert (pdd["wan_kv_bytes"], pdd["handoff_bytes"], pdd["handoff_mode"]) == (4000, 0, None)
    assert (pdd["ttft_s"], pdd["finish_reason"], pdd["pipeline_changes"]) == (None, None, [])
