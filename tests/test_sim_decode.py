"""The simulated decode instance: RLD's final cut made the way the relay daemon makes it, and
tokens delivered across a jittery line as the live WAN delivers them."""

import math
import random
import statistics

import pytest

from emulation.effects import JitterSource
from pddnet.sim.decode import DecodeInstance, Member, TokenDelivery
from pddnet.sim.events import EventLoop
from pddnet.sim.metrics import Histogram

STEP_S = 0.01


class ConstantStep:
    """Every decode step takes STEP_S, whatever the batch (hand-computable times)."""

    def decode_step_time(
        self,
        batch,
        context_tokens,
        extend_tokens=0,
        extend_pairs=0.0,
        extend_seqs=None,
        jitter=True,
        extend_context=0.0,
    ):
        return STEP_S


def relay_instance(loop: EventLoop, max_seqs: int) -> DecodeInstance:
    """An RLD instance of constant STEP_S steps and no user delay, on `loop`."""
    return DecodeInstance(
        loop,
        ConstantStep(),
        "RLD0",
        max_seqs=max_seqs,
        user_delay_s=0.0,
        itl=Histogram(),
        segment_steps=32,
    )


def test_stop_takes_the_tokens_emitted_so_far_and_drops_the_one_in_flight():
    loop = EventLoop()
    inst = relay_instance(loop, max_seqs=8)
    finished = []
    cut = Member("cut", 100, 50, 0.0, lambda m, t, made: finished.append((m.state, t, made)))
    other = Member("other", 100, 5, 0.0, lambda m, t, made: finished.append((m.state, t, made)))
    inst.add(cut)
    inst.add(other)
    stopped = []
    # TAKEOVER arrives mid-step: steps ended at 10 and 20 ms, the third is in flight
    loop.at(0.025, lambda: stopped.append(inst.stop(cut, loop.now)))
    loop.run()
    made, last = stopped[0]
    assert made == 2
    assert last == pytest.approx(2 * STEP_S)  # its last token, not TAKEOVER's time
    # the stopped member never reports (its count was taken); the other decodes on alone
    assert [s for s, _, _ in finished] == ["other"]
    assert finished[0][1:] == (pytest.approx(5 * STEP_S), 5)
    assert inst.n == 0 and not inst.busy
    # the step in flight ran for the batch: 3 steps of two members, then 2 of one
    assert inst.tokens == 3 * 2 + 2
    # but its token never reached anyone: no gap for it
    assert inst.itl.n == 2 + 5


def test_a_member_stopped_in_its_first_step_here_leaves_no_gap():
    loop = EventLoop()
    inst = relay_instance(loop, max_seqs=8)
    busy = Member("busy", 10, 6, 0.0, lambda m, t, made: None)
    late = Member("late", 10, 6, 0.0, lambda m, t, made: None)
    inst.add(busy)
    loop.at(0.015, lambda: inst.add(late))  # joins at 20 ms
    out = []
    loop.at(0.025, lambda: out.append(inst.stop(late, loop.now)))  # in its first step
    loop.run()
    assert out == [(0, 0.0)]
    assert inst.itl.n == 6  # busy's only


def test_stop_before_the_member_ever_ran_gives_no_tokens():
    loop = EventLoop()
    inst = relay_instance(loop, max_seqs=1)
    calls = []
    busy = Member("busy", 10, 4, 0.0, lambda m, t, made: calls.append(m.state))
    late = Member("late", 10, 4, 0.5, lambda m, t, made: calls.append(m.state))
    inst.add(busy)
    inst.add(late)  # waits for the only slot
    out = []
    loop.at(0.015, lambda: out.append(inst.stop(late, loop.now)))
    loop.run()
    assert out == [(0, 0.5)]  # nothing made here; its last token is the one before
    assert calls == ["busy"]


# -- tokens across a jittery line ------------------------------------------------------------


def md_instance(loop: EventLoop, jitter_ms: float, seed: int = 0) -> DecodeInstance:
    """An instance 15 ms across the line from its user, of constant STEP_S steps."""
    return DecodeInstance(
        loop,
        ConstantStep(),
        "MD0",
        max_seqs=8,
        user_delay_s=0.015,
        itl=Histogram(rel_width=0.001),
        segment_steps=32,
        jitter_ms=jitter_ms,
        seed=seed,
    )


def test_token_delivery_without_jitter_is_the_delay():
    path = TokenDelivery(delay_s=0.015)
    assert not path.jittered
    assert [path.arrive(t) for t in (0.0, 0.01, 0.005)] == [0.015, 0.025, 0.02]


@pytest.mark.parametrize("bad", [{"delay_s": -0.001}, {"jitter_ms": -1.0}])
def test_token_delivery_refuses_negative_delay_or_jitter(bad):
    with pytest.raises(ValueError, match="must be >= 0"):
        TokenDelivery(**bad)


def test_token_delivery_draws_the_lines_jitter_in_order():
    emitted = [i * 0.007 for i in range(4000)]
    path = TokenDelivery(delay_s=0.015, jitter_ms=1.0, seed="a")
    arrivals = [path.arrive(t) for t in emitted]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert min(gaps) >= 0  # never before the previous step's tokens
    delays = [a - t for a, t in zip(arrivals, emitted, strict=True)]
    assert statistics.fmean(delays) == pytest.approx(0.015, abs=1e-4)
    # 7 ms apart the order rarely binds: a gap is the step plus the difference of two draws
    assert statistics.pstdev(gaps) == pytest.approx(math.sqrt(2) * 1e-3, rel=0.1)
    again = TokenDelivery(delay_s=0.015, jitter_ms=1.0, seed="a")
    assert [again.arrive(t) for t in emitted] == arrivals  # seeded
    other = TokenDelivery(delay_s=0.015, jitter_ms=1.0, seed="b")
    assert [other.arrive(t) for t in emitted] != arrivals


def test_token_delivery_draws_what_the_live_links_jitter_draws():
    # the same stream and formula as emulation.link's propagation, one draw per step
    emitted = [i * 0.007 for i in range(50)]
    path = TokenDelivery(delay_s=0.015, jitter_ms=1.0, seed="a")
    source = JitterSource(random.Random("a:tokens"))
    expected, last = [], -math.inf
    for t in emitted:
        last = max(last, t + max(0.0, 15.0 + source.draw(1.0, "normal", 0.0)) / 1e3)
        expected.append(last)
    got = path.arrivals(0.0, 0.007, 25) + [path.arrive(t) for t in emitted[25:]]
    assert got == pytest.approx(expected, abs=1e-12)


def test_token_delivery_holds_back_a_step_that_would_overtake():
    # 10 ms of jitter on steps 1 ms apart: a lucky draw would overtake, the line's order forbids
    path = TokenDelivery(delay_s=0.015, jitter_ms=10.0, seed=1)
    arrivals = [path.arrive(i * 0.001) for i in range(500)]
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:], strict=False)]
    assert min(gaps) == 0.0
    assert sum(g == 0.0 for g in gaps) > 50


def decode_alone(jitter_ms: float, tokens: int, seed: int = 0):
    """One member decoding `tokens` on an MD instance, its previous token seen at 0 (P's)."""
    loop = EventLoop()
    inst = md_instance(loop, jitter_ms, seed)
    done = []
    m = Member("r", 1000, tokens, 0.0, lambda m, t, made: done.append((t, made)))
    inst.add(m)
    loop.run()
    return inst, m, done


def test_a_jittery_line_spreads_mds_gaps_and_keeps_their_count_and_sum():
    plain, m0, done0 = decode_alone(0.0, 300)
    jittery, m1, done1 = decode_alone(1.0, 300)
    assert done0 == done1 == [(pytest.approx(300 * STEP_S), 300)]  # the device is not slowed
    assert plain.itl.n == jittery.itl.n == 300  # one gap a token (the first from P's)
    assert plain.itl.quantile(0.9) - plain.itl.quantile(0.1) < 1e-4  # every gap a step
    assert jittery.itl.quantile(0.9) - jittery.itl.quantile(0.1) > 2e-3  # ~2.56 sd of 1.4 ms
    # the gaps still add up to the last token's arrival: 300 steps + the line's delay + a draw
    assert m0.prev_user == pytest.approx(300 * STEP_S + 0.015)
    assert m1.prev_user == pytest.approx(jittery.itl.total, abs=1e-9)
    assert m1.prev_user == pytest.approx(300 * STEP_S + 0.015, abs=0.005)
    assert jittery.itl.mean == pytest.approx(STEP_S, rel=0.02)
    again, _, _ = decode_alone(1.0, 300)
    assert again.itl.counts == jittery.itl.counts  # seeded: the same run gives the same gaps


def test_a_cut_on_a_jittery_instance_reports_the_arrival_its_gaps_were_counted_to():
    loop = EventLoop()
    inst = md_instance(loop, jitter_ms=1.0)
    cut = Member("cut", 100, 50, 0.0, lambda m, t, made: None)
    other = Member("other", 100, 40, 0.0, lambda m, t, made: None)
    inst.add(cut)
    inst.add(other)
    stopped = []
    loop.at(0.125, lambda: stopped.append(inst.stop(cut, loop.now)))
    loop.run()
    made, last = stopped[0]
    assert made == 12
    # its last token is step 12's, which `other` also got: that arrival, one draw off the mean
    assert last == pytest.approx(12 * STEP_S + 0.015, abs=0.005)
    assert other.prev_user >= last
    # the cut member's 12 gaps and the other's 40 were all counted, none twice
    assert inst.itl.n == 12 + 40
