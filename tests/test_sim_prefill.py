"""P's schedule (pddnet/sim/prefill.py) and the shared-host contention (pddnet/device/cost.py),
on hand-computed cases: a unit chip doing 1 TFLOP/s on a 1e9-parameter model, so a prefill
of n tokens from scratch is (2e9 n + 512 n (n + 1) / 2) / 1e12 seconds (512 = 4 x 2 layers x
4 heads x 16 head_dim attention FLOPs per pair); its 2 GB of weights at 100 GB/s (0.02 s)
never bind for the 100+ token chunks used here."""

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pddnet.device.cost import InstanceCost, SharedHost
from pddnet.device.profiles import load_chip, load_model
from pddnet.sim.events import EventLoop
from pddnet.sim.prefill import PrefillInstance
from tests.test_sim_cost import CHIP, MODEL

ATTN = 4 * 2 * 4 * 16


def pairs(start, end):
    return (end * (end + 1) - start * (start + 1)) / 2


def secs(*chunks):
    """Hand-computed time of one forward over these (start, end) chunks."""
    return sum(2e9 * (e - s) + ATTN * pairs(s, e) for s, e in chunks) / 1e12


@pytest.fixture
def cost(tmp_path):
    (tmp_path / "chip.toml").write_text(CHIP)
    (tmp_path / "model.toml").write_text(MODEL)
    return InstanceCost(load_chip(tmp_path / "chip.toml"), load_model(tmp_path / "model.toml"))


class Recorder:
    """Prefill progress reports: (request, computed tokens, time, done)."""

    def __init__(self):
        self.seen = []

    def __call__(self, state, computed, t, done):
        self.seen.append((state.name, computed, t, done))

    def done_at(self, name):
        return next(t for n, _, t, d in self.seen if n == name and d)


def request(name, tokens):
    return SimpleNamespace(
        name=name,
        req=SimpleNamespace(prompt_tokens=tokens, units=()),
        p_hit=0,
        prefill_start=-1.0,
        last_chunk_tokens=0,
    )


def instance(cost, budget=2048, max_seqs=64, **kw):
    loop = EventLoop()
    return loop, PrefillInstance(
        loop, cost, "P0", 1, 16, budget, prefix_cache=False, max_seqs=max_seqs, **kw
    )


def run(cost, prompts, **kw):
    """`prompts` (name -> tokens) submitted in order at time 0 to an `instance(cost, **kw)`,
    run to the end: the instance and its reports."""
    loop, p = instance(cost, **kw)
    rec = Recorder()
    for name, tokens in prompts.items():
        p.submit(request(name, tokens), rec)
    loop.run()
    return p, rec


def test_one_forward_over_several_chunks_adds_their_work(cost):
    assert cost.prefill_step_time([(0, 1000)]) == cost.prefill_chunk_time(0, 1000)
    assert cost.prefill_step_time([(0, 1000), (200, 500)]) == pytest.approx(
        secs((0, 1000), (200, 500))
    )
    with pytest.raises(ValueError, match="at least one chunk"):
        cost.prefill_step_time([])
    with pytest.raises(ValueError, match="bad prefill chunk"):
        cost.prefill_step_time([(0, 10), (5, 5)])


def test_one_at_a_time_by_default(cost):
    loop = EventLoop()
    p = PrefillInstance(loop, cost, "P0", 1, 16, 2048, prefix_cache=False)
    rec = Recorder()
    p.submit(request("a", 1000), rec)
    p.submit(request("b", 500), rec)
    assert p.load == 2
    loop.run()
    assert rec.done_at("a") == pytest.approx(secs((0, 1000)))
    assert rec.done_at("b") == pytest.approx(secs((0, 1000)) + secs((0, 500)))
    assert p.steps == 2 and p.load == 0 and not p.busy


def test_waiting_prompts_share_one_step_up_to_the_budget(cost):
    loop, p = instance(cost)
    rec = Recorder()
    a, b = request("a", 1000), request("b", 500)
    p.submit(a, rec)  # P idle: a's step starts at once...
    p.submit(b, rec)  # ...so b, arriving at the same instant, waits for its end
    loop.run()
    t1 = secs((0, 1000))
    assert rec.done_at("a") == pytest.approx(t1)
    assert rec.done_at("b") == pytest.approx(t1 + secs((0, 500)))
    assert b.prefill_start == pytest.approx(t1)

    # Both waiting when a step starts: one forward over both, both done at its end.
    p, rec = run(cost, {"x": 300, "a": 1000, "b": 500})
    t0 = secs((0, 300))
    both = t0 + secs((0, 1000), (0, 500))
    assert rec.done_at("a") == pytest.approx(both) and rec.done_at("b") == pytest.approx(both)
    assert p.steps == 2 and p.tokens_computed == 1800


def test_a_prompt_arriving_mid_step_waits_for_the_step_boundary(cost):
    loop, p = instance(cost)
    rec = Recorder()
    p.submit(request("a", 1000), rec)
    late = request("b", 200)
    loop.at(0.5, p.submit, late, rec)  # a's step runs [0, 2.256...)
    loop.run()
    t_a = secs((0, 1000))
    assert late.prefill_start == pytest.approx(t_a)
    assert rec.done_at("b") == pytest.approx(t_a + secs((0, 200)))


def test_the_last_admitted_prompt_is_chunked_to_the_remaining_budget(cost):
    loop, p = instance(cost, budget=1200)
    rec = Recorder()
    p.submit(request("x", 100), rec)
    a, b = request("a", 1000), request("b", 500)
    p.submit(a, rec)
    p.submit(b, rec)
    loop.run()
    t0 = secs((0, 100))
    t1 = t0 + secs((0, 1000), (0, 200))  # a whole, b's first 200 tokens
    t2 = t1 + secs((200, 500))  # running prompts first: b's remaining 300
    assert rec.done_at("a") == pytest.approx(t1)
    assert ("b", 200, pytest.approx(t1), False) in rec.seen
    assert rec.done_at("b") == pytest.approx(t2)
    assert b.last_chunk_tokens == 300


def test_max_seqs_caps_the_prompts_of_a_step(cost):
    p, rec = run(cost, dict.fromkeys("xabc", 100), max_seqs=2)
    t1 = secs((0, 100))
    t2 = t1 + secs((0, 100), (0, 100))
    assert rec.done_at("a") == pytest.approx(t2) and rec.done_at("b") == pytest.approx(t2)
    assert rec.done_at("c") == pytest.approx(t2 + secs((0, 100)))


def test_shared_host_slowdown_adds_the_weights_of_active_members():
    state = {"rld": True, "md": False, "outside": 1.5}
    host = SharedHost(
        {("P0", "RLD0"): 0.5, ("P0", "D0"): 0.25, ("P0", "outside"): 0.2, ("RLD0", "P0"): 0.7}
    )
    host.join("P0", lambda: False)
    host.join("RLD0", lambda: state["rld"])
    host.join("D0", lambda: state["md"])
    host.join("outside", lambda: state["outside"])
    assert host.slowdown("P0") == pytest.approx(1 + 0.5 + 0.2 * 1.5)
    state.update(md=True, outside=0.0)
    assert host.slowdown("P0") == pytest.approx(1.75)
    assert host.slowdown("RLD0") == 1.0  # P0 is not computing
    assert host.slowdown("D0") == 1.0  # no weights: never slowed
    with pytest.raises(ValueError, match="already joined"):
        host.join("D0", lambda: True)
    with pytest.raises(ValueError, match="not a member"):
        host.slowdown("P1")
    with pytest.raises(ValueError, match=">= 0"):
        SharedHost({("a", "b"): -0.1})
    with pytest.raises(ValueError, match="pair of two members"):
        SharedHost({("a", "a"): 0.1})
    state["outside"] = -1.0
    with pytest.raises(ValueError, match="activity"):
        host.slowdown("P0")


def test_decode_steps_on_a_shared_host_are_slowed_while_a_neighbour_computes(cost):
    busy = {"P0": True}
    host = SharedHost({("D0", "P0"): 0.4})
    host.join("D0", lambda: False)
    host.join("P0", lambda: busy["P0"])
    shared = replace(cost, host=host, host_member="D0")
    alone = cost.decode_step_time(8, 8000)
    assert shared.decode_step_time(8, 8000) == pytest.approx(1.4 * alone)
    assert shared.decode_step_time(8, 8000, jitter=False) == pytest.approx(1.4 * alone)
    busy["P0"] = False
    assert shared.decode_step_time(8, 8000) == pytest.approx(alone)
    with pytest.raises(ValueError, match="has not joined"):
        replace(cost, host=host, host_member="RLD0")


def test_prefill_work_runs_slower_while_a_neighbour_decodes(cost):
    # P's step of 1000 tokens is W seconds of work; RLD decodes for the first 0.1 s and then
    # stops. At weight 1 P runs at half speed while RLD is busy: 0.05 s of work in the
    # first 0.1 s, the remaining W - 0.05 s at full speed, so the step ends at W + 0.05.
    loop = EventLoop()
    rld = {"busy": True}
    host = SharedHost({("P0", "RLD0"): 1.0})
    host.join("RLD0", lambda: rld["busy"])
    p = PrefillInstance(
        loop, cost, "P0", 1, 16, 2048, prefix_cache=False, max_seqs=8, contention_tick_s=0.05
    )
    host.join("P0", lambda: p.busy)
    p.cost = replace(cost, host=host, host_member="P0")
    loop.at(0.1, rld.update, {"busy": False})
    rec = Recorder()
    p.submit(request("a", 1000), rec)
    loop.run()
    w = secs((0, 1000))
    assert rec.done_at("a") == pytest.approx(w + 0.05)
    assert p.busy_s == pytest.approx(w + 0.05)


def test_bad_instance_settings_are_refused(cost):
    loop = EventLoop()
    with pytest.raises(ValueError, match="max_seqs"):
        PrefillInstance(loop, cost, "P0", 1, 16, 2048, max_seqs=0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefillInstance(loop, cost, "P0", 1, 16, 0)
    with pytest.raises(ValueError, match="contention_tick_s"):
        PrefillInstance(loop, cost, "P0", 1, 16, 2048, contention_tick_s=0.0)
    for bad in (-0.1, 1.5, True, "half"):
        with pytest.raises(ValueError, match="export_wait"):
            PrefillInstance(loop, cost, "P0", 1, 16, 2048, export_wait=bad)


def test_export_waits_for_a_next_step_that_starts_at_once(cost):
    # b waits when a's step ends: the next step starts at once
    p, rec = run(cost, {"a": 1000, "b": 500}, export_wait=1.0)
    t1 = secs((0, 1000))
    t2 = t1 + secs((0, 500))
    # a's KV leaves only when b's step ends, and is reported before b's own
    assert rec.seen == [
        ("a", 0, 0.0, False),
        ("b", 0, pytest.approx(t1), False),
        ("a", 1000, pytest.approx(t2), True),
        ("b", 500, pytest.approx(t2), True),
    ]
    assert p.exports_held == 1 and p.steps == 2 and not p.busy


def test_export_goes_at_once_when_p_is_idle_after_the_step(cost):
    loop, p = instance(cost, export_wait=1.0)
    rec = Recorder()
    p.submit(request("a", 1000), rec)
    late = secs((0, 1000)) + 0.5  # after a's step: P was idle, nothing waited
    loop.at(late, p.submit, request("b", 500), rec)
    loop.run()
    assert rec.done_at("a") == pytest.approx(secs((0, 1000)))
    assert rec.done_at("b") == pytest.approx(late + secs((0, 500)))
    assert p.exports_held == 0


def test_a_chunk_report_waits_for_the_prompts_next_chunk(cost):
    _, rec = run(cost, {"a": 1000}, budget=600, export_wait=1.0)
    t1 = secs((0, 600))
    t2 = t1 + secs((600, 1000))
    # the running prompt continues at once, so its first chunk's KV leaves with the second
    assert rec.seen == [
        ("a", 0, 0.0, False),
        ("a", 600, pytest.approx(t2), False),
        ("a", 1000, pytest.approx(t2), True),
    ]


def test_export_wait_is_a_seeded_share_of_the_reports_that_could_wait(cost):
    def held_and_seen(share):
        # one prompt a step, the queue never empty
        p, rec = run(cost, {f"r{i}": 100 for i in range(400)}, max_seqs=1, export_wait=share)
        return p.exports_held, rec.seen

    held, seen = held_and_seen(0.25)
    assert 70 <= held <= 130  # 399 reports could wait, each with p = 0.25
    assert (held, seen) == held_and_seen(0.25)  # the same draws every run
    assert held_and_seen(0.0)[0] == 0
    done = [n for n, _, _, d in seen if d]
    assert sorted(done) == sorted(f"r{i}" for i in range(400))
