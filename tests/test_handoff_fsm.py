"""The sans-IO handoff machines, driven through a simulated RLD <-> MD link.

The simulation models what matters for exactly-once: RLD decodes one token per tick and its
engine may finish a step already in flight after the cut; MD's engine computes at most its chunk
cap per step and samples only when not held; messages take `delay` ticks each way. Every token
index must reach the "router" exactly once and equal the reference sequence.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet.lifecycle.actions import (
    AppendTokens,
    CancelPeer,
    EmitTokens,
    FinishRequest,
    FirstMainToken,
    HandoffEnded,
    HandoffStarted,
    ReleaseHold,
    SendHandoff,
    SendTakeover,
    SetChunk,
    StartSequence,
    StopSequence,
)
from pddnet.lifecycle.handoff import HandoffError, MainHandoff, MainPhase, RelayHandoff, RelayPhase
from pddnet.policy.handoff import HandoffPolicy


@dataclass
class MdEngine:
    """The part of Engine that matters here: hold, chunk cap, extend-then-sample."""

    prompt_len: int
    ref: list[int]
    known: list[int] = field(default_factory=list)
    computed: int = 0
    hold: bool = True
    cap: int | None = None
    running: bool = False
    extends: list[int] = field(default_factory=list)

    def step(self) -> tuple[int, list[int], str | None] | None:
        if not self.running:
            return None
        num_tokens = self.prompt_len + len(self.known)
        target = num_tokens - 1 if self.hold else num_tokens
        if self.computed >= target:
            return None
        n = target - self.computed if self.cap is None else min(self.cap, target - self.computed)
        self.computed += n
        self.extends.append(n)
        new: list[int] = []
        reason = None
        index = len(self.known)
        if not self.hold and self.computed == num_tokens:
            new = [self.ref[index]]
            self.known.append(new[0])
            if index == len(self.ref) - 1:
                reason = "length"
                self.running = False
        return index, new, reason


@dataclass
class Run:
    emitted: dict[int, tuple[int, str]] = field(default_factory=dict)  # index -> (token, who)
    handoffs: list[SendHandoff] = field(default_factory=list)
    started: list[HandoffStarted] = field(default_factory=list)
    done_by: str | None = None
    md_extends: list[int] = field(default_factory=list)
    md_extends_after_handoff: list[int] = field(default_factory=list)
    rld_tokens_at_takeover: int | None = None
    md_cancelled: bool = False


def simulate(
    *,
    n_out: int,
    prompt_len: int,
    kv_tick: int,
    delay: int,
    chunk: int,
    policy: HandoffPolicy | None = None,  # default: streaming, MD's chunk
    stop_lag: int = 1,
    load: float = 0.0,
    max_ticks: int = 5000,
) -> Run:
    ref = [1000 + 7 * i for i in range(n_out)]
    policy = policy or HandoffPolicy(mode="streaming", chunk=chunk)
    run = Run()
    rld = RelayHandoff(prompt_len, policy)
    md = MainHandoff(prompt_len, chunk)
    md_engine = MdEngine(prompt_len, ref)
    to_md: deque[tuple[int, object]] = deque()
    to_rld: deque[tuple[int, object]] = deque()
    rld_running, rld_stop_at = True, None

    def emit(index: int, tokens: tuple[int, ...], who: str) -> None:
        for i, t in enumerate(tokens, index):
            assert i not in run.emitted, f"index {i} emitted twice ({run.emitted[i][1]} and {who})"
            run.emitted[i] = (t, who)

    def do_rld(actions: list, t: int) -> None:
        nonlocal rld_stop_at
        for a in actions:
            if isinstance(a, EmitTokens):
                emit(a.index, a.token_ids, "relay")
            elif isinstance(a, SendHandoff):
                run.handoffs.append(a)
                to_md.append((t + delay, a))
            elif isinstance(a, StopSequence):
                rld_stop_at = t + stop_lag  # a step may already be in flight
            elif isinstance(a, FinishRequest):
                assert run.done_by is None
                run.done_by = "relay"
            elif isinstance(a, CancelPeer):
                to_md.append((t + delay, a))
            elif isinstance(a, HandoffStarted):
                run.started.append(a)
                run.rld_tokens_at_takeover = rld.num_tokens
            else:
                raise AssertionError(f"unexpected relay action {a}")

    def do_md(actions: list, t: int) -> None:
        for a in actions:
            if isinstance(a, StartSequence):
                md_engine.known = list(a.output_token_ids)
                md_engine.computed = prompt_len
                md_engine.hold = a.hold
                md_engine.running = True
            elif isinstance(a, SendTakeover):
                to_rld.append((t + delay, a))
            elif isinstance(a, AppendTokens):
                md_engine.known += list(a.token_ids)
            elif isinstance(a, SetChunk):
                md_engine.cap = a.max_chunk_tokens
            elif isinstance(a, ReleaseHold):
                md_engine.hold = False
            elif isinstance(a, EmitTokens):
                emit(a.index, a.token_ids, "main")
            elif isinstance(a, FinishRequest):
                assert run.done_by is None
                run.done_by = "main"
            elif isinstance(a, StopSequence):
                md_engine.running = False
                run.md_cancelled = True
            elif not isinstance(a, (HandoffEnded, FirstMainToken)):
                raise AssertionError(f"unexpected main action {a}")

    for t in range(max_ticks):
        # RLD decodes one token per tick (index 0 is P's token, delivered at tick 0)
        if rld_running:
            if rld_stop_at is not None and t >= rld_stop_at:
                rld_running = False
            else:
                i = (
                    rld.num_tokens
                    if rld.phase not in (RelayPhase.CUT, RelayPhase.FINISHED)
                    else None
                )
                if i is None:  # past the cut: the in-flight step's token must be dropped
                    assert rld.rld_token(len(rld.tokens), 0) == []
                else:
                    reason = "length" if i == n_out - 1 else None
                    do_rld(rld.rld_token(i, ref[i], reason), t)
                    if reason:
                        rld_running = False
        if t == kv_tick:
            do_md(md.kv_complete(ref[0]), t)
        while to_md and to_md[0][0] <= t:
            _, msg = to_md.popleft()
            if isinstance(msg, SendHandoff):
                do_md(md.handoff(msg.start_index, msg.token_ids, msg.final, msg.mode), t)
                if msg.final:
                    run.md_extends_after_handoff = md_engine.extends  # same list, grows on
            else:
                do_md(md.cancel(), t)
        while to_rld and to_rld[0][0] <= t:
            _, msg = to_rld.popleft()
            do_rld(rld.takeover(msg.ready_position, msg.chunk_tokens, load), t)
        out = md_engine.step()
        if out is not None:
            index, new, reason = out
            do_md(md.md_step(md_engine.computed, index, new, reason), t)
        if run.done_by and not to_md and not to_rld and not md_engine.running:
            break
    run.md_extends = md_engine.extends
    return run


def check_exactly_once(run: Run, n_out: int) -> None:
    assert sorted(run.emitted) == list(range(n_out))
    assert [run.emitted[i][0] for i in range(n_out)] == [1000 + 7 * i for i in range(n_out)]
    relay = [i for i, (_, who) in run.emitted.items() if who == "relay"]
    main = [i for i, (_, who) in run.emitted.items() if who == "main"]
    # RLD's tokens are a prefix, MD's the rest: one cut
    assert relay == list(range(len(relay)))
    assert main == list(range(len(relay), n_out))
    if main:
        handed = [t for h in run.handoffs for t in h.token_ids]
        assert handed == [run.emitted[i][0] for i in relay]  # RLD emitted exactly what it handed
        assert [h.final for h in run.handoffs] == [False] * (len(run.handoffs) - 1) + [True]
        assert run.done_by == "main"
    else:
        assert run.done_by == "relay"


def test_one_shot_single_final_handoff_and_one_extend():
    run = simulate(
        n_out=60, prompt_len=10, kv_tick=20, delay=3, chunk=4, policy=HandoffPolicy(mode="one-shot")
    )
    check_exactly_once(run, 60)
    (h,) = run.handoffs
    assert h.final and h.mode == "one-shot" and h.start_index == 0
    k = len(h.token_ids)
    assert k > 20  # RLD decoded eagerly while the KV crossed
    # MD's first step after the cut extends every relayed token at once (the one-shot stall)
    assert max(run.md_extends) == k
    assert run.started[0].mode == "one-shot"


def test_streaming_never_extends_more_than_chunk_and_rld_keeps_decoding():
    chunk = 4
    run = simulate(n_out=120, prompt_len=10, kv_tick=40, delay=3, chunk=chunk)
    check_exactly_once(run, 120)
    assert run.done_by == "main"
    assert len(run.handoffs) > 3
    assert all(h.mode == "streaming" for h in run.handoffs)
    assert max(run.md_extends) <= chunk
    relay_count = sum(1 for _, who in run.emitted.values() if who == "relay")
    assert relay_count > run.rld_tokens_at_takeover  # RLD went on while MD caught up


def test_dynamic_picks_one_shot_for_small_backlog_and_streaming_for_large():
    policy = HandoffPolicy(mode="dynamic", threshold_tokens=16, chunk=4)
    small = simulate(n_out=80, prompt_len=5, kv_tick=5, delay=1, chunk=4, policy=policy)
    large = simulate(n_out=150, prompt_len=5, kv_tick=50, delay=1, chunk=4, policy=policy)
    loaded = simulate(
        n_out=150, prompt_len=5, kv_tick=50, delay=1, chunk=4, policy=policy, load=0.95
    )
    for run, n in ((small, 80), (large, 150), (loaded, 150)):
        check_exactly_once(run, n)
    assert small.started[0].mode == "one-shot" and len(small.handoffs) == 1
    assert large.started[0].mode == "streaming" and len(large.handoffs) > 1
    assert max(large.md_extends) <= 4
    assert loaded.started[0].mode == "one-shot" and "load" in loaded.started[0].reason


def test_rld_finishing_first_cancels_md():
    run = simulate(n_out=15, prompt_len=8, kv_tick=100, delay=3, chunk=4)
    check_exactly_once(run, 15)
    assert run.done_by == "relay" and not run.handoffs
    # MD's copy completed after RLD finished: MD got the cancel and never emitted


def test_rld_finishing_during_streaming_handoff():
    # RLD is far ahead and MD extends 1 token per step: RLD reaches max_tokens first
    run = simulate(n_out=70, prompt_len=4, kv_tick=40, delay=2, chunk=1)
    check_exactly_once(run, 70)
    assert run.done_by == "relay" and run.handoffs and not any(h.final for h in run.handoffs)
    assert run.md_cancelled


# simulate()'s timings, as hypothesis draws them (passed to it as they are)
TIMINGS = st.fixed_dictionaries(
    {
        "n_out": st.integers(1, 120),
        "prompt_len": st.integers(1, 40),
        "kv_tick": st.integers(0, 150),
        "delay": st.integers(0, 6),
        "chunk": st.integers(1, 20),
        "stop_lag": st.integers(0, 2),
        "load": st.floats(0.0, 1.0),
    }
)


@settings(max_examples=150, deadline=None)
@given(
    timing=TIMINGS,
    mode=st.sampled_from(["one-shot", "streaming", "dynamic"]),
    threshold=st.integers(0, 80),
)
def test_exactly_once_under_any_timing(timing, mode, threshold):
    chunk = timing["chunk"]
    policy = HandoffPolicy(mode=mode, threshold_tokens=threshold, chunk=chunk)
    run = simulate(**timing, policy=policy)
    check_exactly_once(run, timing["n_out"])
    if run.handoffs and run.handoffs[0].mode == "streaming":
        assert max(run.md_extends, default=0) <= chunk
        assert all(len(h.token_ids) <= chunk for h in run.handoffs)  # messages of <= chunk ids


def test_takeover_before_relay_started_waits_for_index_0():
    rld = RelayHandoff(5, HandoffPolicy(mode="one-shot"))
    assert rld.takeover(5, 4, 0.0) == []
    actions = rld.rld_token(0, 42)
    assert actions[0] == EmitTokens(0, (42,))
    assert actions[-1] == SendHandoff(0, (42,), True, "one-shot")
    assert StopSequence() in actions and rld.phase is RelayPhase.CUT


def test_same_dc_relay_never_hands_off():
    rld = RelayHandoff(5, HandoffPolicy(), hands_off=False)
    assert rld.rld_token(0, 1) == [EmitTokens(0, (1,))]
    assert rld.rld_token(1, 2, "eos") == [EmitTokens(1, (2,)), FinishRequest("eos", 2)]
    with pytest.raises(HandoffError, match="same-dc"):
        RelayHandoff(5, HandoffPolicy(), hands_off=False).takeover(5, 4, 0.0)


def test_relay_rejects_out_of_order_tokens():
    rld = RelayHandoff(5, HandoffPolicy())
    rld.rld_token(0, 1)
    with pytest.raises(HandoffError, match="index 2, expected 1"):
        rld.rld_token(2, 3)


def test_main_rejects_gaps_contradictions_and_early_sampling():
    md = MainHandoff(5, 4)
    md.kv_complete(9)
    with pytest.raises(HandoffError, match="gap"):
        md.handoff(2, (1, 2), False, "streaming")
    with pytest.raises(HandoffError, match="contradict"):
        md.handoff(0, (8, 1), False, "streaming")
    with pytest.raises(HandoffError, match="held"):
        md.md_step(6, 1, [5])
    assert md.phase is MainPhase.WAITING_CUT


def test_cross_dc_main_emits_from_index_0():
    md = MainHandoff(5, 4, with_relay=False)
    actions = md.kv_complete(9)
    assert actions[:2] == [StartSequence((9,), hold=False), EmitTokens(0, (9,))]
    assert md.md_step(6, 1, [3]) == [EmitTokens(1, (3,))]
    assert md.md_step(7, 2, [4], "eos") == [EmitTokens(2, (4,)), FinishRequest("eos", 3)]


def test_main_reports_progress_only_when_idle_during_streaming():
    md = MainHandoff(10, 4)
    md.kv_complete(1)
    assert md.handoff(0, (1, 2, 3, 4, 5, 6), False, "streaming") == [
        SetChunk(4),
        AppendTokens((2, 3, 4, 5, 6)),
    ]
    assert md.md_step(14, 1, []) == []  # still digesting what it holds: no report
    assert md.md_step(15, 1, []) == [SendTakeover(15, 4)]  # all 6 held (the last uncomputed)
    assert md.md_step(15, 1, []) == []  # no progress, no report
    one = MainHandoff(10, 4)
    one.kv_complete(1)
    assert one.handoff(0, (1, 2), True, "one-shot") == [
        SetChunk(None),
        AppendTokens((2,)),
        ReleaseHold(),
        HandoffEnded("one-shot", 2),
    ]


def test_relay_finishes_alone_when_main_decode_is_lost_mid_stream():
    from pddnet.lifecycle.actions import HandoffAbandoned

    fsm = RelayHandoff(10, HandoffPolicy(mode="streaming", chunk=2))
    for i in range(4):
        fsm.rld_token(i, 100 + i)
    acts = fsm.takeover(ready_position=10, chunk_tokens=2, rld_load=0.0)
    assert fsm.phase is RelayPhase.STREAMING and any(isinstance(a, SendHandoff) for a in acts)
    lost = fsm.peer_lost()
    assert [type(a) for a in lost] == [HandoffAbandoned] and "streaming" in lost[0].reason
    # every later token is RLD's to emit, and nothing goes to MD any more
    acts = fsm.rld_token(4, 104)
    assert [type(a) for a in acts] == [EmitTokens]
    acts = fsm.rld_token(5, 105, "length")
    assert [type(a) for a in acts] == [EmitTokens, FinishRequest]  # no CancelPeer: MD is gone
    assert fsm.peer_lost() == []
