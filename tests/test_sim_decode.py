"""The simulated decode instance: RLD's final cut made the way the relay daemon makes it."""

import pytest

from pddnet.sim.decode import DecodeInstance, Member
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
