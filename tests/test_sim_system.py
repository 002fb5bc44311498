"""The simulated systems: the daemons' policy objects, determinism, the request flow."""

import argparse
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest

import emulation.link
import pddnet.kv.allocator
import pddnet.kv.radix
import pddnet.policy.admission
import pddnet.policy.cache_view
import pddnet.policy.estimators
import pddnet.policy.handoff
import pddnet.policy.pipeline
from pddnet.sim.cli import dumps, register
from pddnet.sim.config import parse_config
from pddnet.sim.reproduce import AGENT_LENGTHS
from pddnet.sim.runner import Schedule, run_systems, simulate, simulate_all
from pddnet.sim.system import SimulatedSystem
from pddnet.workload.trace import trace_stream
from tests.sim_configs import one_pool_config


def small_dict(requests=160, **over) -> dict:
    """A small simulation (two chips, every system but cross-dc-no-drc, `requests` agent
    turns) as the config dict `pdd sim run` reads; `over` replaces top-level keys."""
    cfg = {
        "seed": 3,
        "model": "qwen2.5-7b",
        "tokens_per_unit": 512,
        "systems": ["same-dc", "cross-dc", "pdd", "pdd-no-drc"],
        "chips": {"a": "gpu-a", "b": "gpu-b"},
        "pdd": {
            "prefill": {"chip": "a", "instances": 2},
            "relay": {"chip": "a", "instances": 1},
            "main_decode": {"chip": "b", "instances": 2},
        },
        "baseline": {
            "prefill": {"chip": "a", "instances": 2},
            "decode": {"chip": "a", "instances": 2},
        },
        "line": {"bw_gbit": 10, "rtt_ms": 30},
        "workload": {
            "requests": requests,
            "num_conversations": 1000,
            "conversation_rate_per_s": 0.5,
            **AGENT_LENGTHS,
            "output_len": [64, 512],
        },
    }
    cfg.update(over)
    return cfg


def small(requests=160, **over):
    return parse_config(small_dict(requests, **over))


def test_the_simulator_drives_the_daemons_policy_objects():
    sim = SimulatedSystem(small(), "pdd")
    assert type(sim.pipeline_policy) is pddnet.policy.pipeline.PipelinePolicy
    assert type(sim.handoff_policy) is pddnet.policy.handoff.HandoffPolicy
    assert all(type(a) is pddnet.policy.admission.RelayAdmission for a in sim.admission)
    assert all(type(v) is pddnet.policy.cache_view.DecodeCacheView for v in sim.views)
    assert type(sim.bw_est) is pddnet.policy.estimators.BandwidthEstimator
    assert type(sim.rtt_est) is pddnet.policy.estimators.RttEstimator
    for d in sim.decode:
        assert type(d.cache) is pddnet.kv.radix.RadixCache
        assert type(d.cache.allocator) is pddnet.kv.allocator.BlockAllocator
    assert type(sim.prefill[0].cache) is pddnet.kv.radix.RadixCache
    assert type(sim.wan.link) is emulation.link.Link
    from pddnet.workload import agent, agent_stream

    assert agent_stream.generate_agent_workload is agent.generate_agent_workload


def test_pipeline_decisions_go_through_the_daemons_planner_and_policy(monkeypatch):
    """Every pdd request is planned by a PipelinePlanner (the prefill daemon's object) that
    holds the simulator's policy, MD's view, the line's estimators and its P's WAN backlog;
    the backlog is the daemons' (committed on MD's answer, released by KV_RECEIVED or a
    cancel) and ends empty; the goodput estimator learns from every KV_RECEIVED."""
    import pddnet.sim.runner as runner
    from pddnet.policy.planner import PipelinePlanner

    made, planned = [], []
    real_plan = PipelinePlanner.plan_predicted

    def plan_predicted(self, *args, **kw):
        plan = real_plan(self, *args, **kw)
        x = plan.inputs  # the daemons' inputs: min recent RTT, P's own backlog
        assert (x.rtt_s, x.bandwidth_bps, x.wan_backlog_bytes) == (
            self.rtt.min_s,
            self.bandwidth.bytes_per_s,
            self.backlog.bytes,
        )
        planned.append((self, plan))
        return plan

    def system(*args):
        made.append(SimulatedSystem(*args))
        return made[-1]

    monkeypatch.setattr(PipelinePlanner, "plan_predicted", plan_predicted)
    monkeypatch.setattr(runner, "SimulatedSystem", system)
    res = simulate(small(), "pdd")
    (sim,) = made
    assert len(planned) == res["requests"] == sum(sim.pipelines.values())
    assert sim.planners and all(type(pl) is PipelinePlanner for pl in sim.planners.values())
    for (p, md), pl in sim.planners.items():
        assert pl.policy is sim.pipeline_policy and pl.view is sim.views[md]
        assert pl.bandwidth is sim.bw_est and pl.rtt is sim.rtt_est
        assert pl.backlog is sim.wan_backlogs[p]
        assert type(pl.backlog) is pddnet.policy.estimators.WanBacklog
    assert any(plan.inputs.wan_backlog_bytes > 0 for _, plan in planned)
    assert all(b.bytes == 0 and b.pending == 0 for b in sim.wan_backlogs)
    assert sim.bw_est.samples > 0
    # what the planners chose is what the simulator counted (RLD refusals aside)
    chosen = {
        p.value: sum(pl.chosen[p.wire] for pl in sim.planners.values())
        for p in pddnet.policy.pipeline.Pipeline
    }
    assert sim.counts["rld_refused"] or chosen == sim.pipelines


def test_the_simulated_wan_times_a_transfer_paced_by_the_prefill():
    from pddnet.sim.events import EventLoop
    from pddnet.sim.wan import WanLine

    loop = EventLoop()
    wan = WanLine(loop, rate_mbit=8.0, delay_ms=10.0, piece_bytes=100_000)  # 1 MB/s
    done = []
    tr = wan.start_transfer(500_000, done.append, sender=0)
    loop.at(1.0, wan.make_sendable, tr, 500_000)  # P computed it all after 1 s
    loop.run()
    (t,) = done
    # 1 s of prefill, 0.5 s on the line (its token bucket's 15 KB burst leaves at once), 10 ms
    assert t == pytest.approx(1.0 + (500_000 - 15_000) / 1e6 + 0.01)


def test_p_learns_its_delivery_rate_as_the_prefill_daemon_does(monkeypatch):
    """The goodput sample is the prefill daemon's: the KV's bytes over the time from MD's
    answer reaching P (the transfer's start) to KV_RECEIVED reaching P."""
    import pddnet.sim.runner as runner

    made, want, got = [], [], []

    def system(*args):
        sim = SimulatedSystem(*args)
        observe = sim.bw_est.observe
        sim.bw_est.observe = lambda n, sec: (got.append((n, sec)), observe(n, sec))
        real = sim._p_kv_received

        def received(now, st):
            if st.transfer is not None:
                want.append((st.transfer.total, now - st.transfer.started_at))
            real(now, st)

        sim._p_kv_received = received
        made.append(sim)
        return sim

    monkeypatch.setattr(runner, "SimulatedSystem", system)
    simulate(small(), "pdd")
    assert got and got == want
    owd = made[0].cfg.line.rtt_ms / 2e3
    assert all(sec > owd for _, sec in got)  # MD's acknowledgement crossed back


def test_same_seed_gives_byte_identical_json_and_another_seed_does_not():
    cfg = small(requests=120)
    a, b = dumps(simulate_all(cfg)), dumps(simulate_all(cfg))
    assert a == b
    c = dumps(simulate_all(dataclasses.replace(cfg, seed=4)))
    assert c != a


@pytest.fixture(scope="module")
def runs():
    cfg = small()
    return {s: simulate(cfg, s) for s in cfg.systems}


def test_every_request_finishes_and_tokens_add_up(runs):
    for name, r in runs.items():
        assert r["finished"] == r["requests"] > 0, name
        assert r["unfinished"] == 0
        assert r["token_share"]["rld"] + r["token_share"]["md"] == pytest.approx(1.0)
        assert r["ttft_s"]["n"] == r["requests"]
        assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
    assert runs["same-dc"]["token_share"]["rld"] == 0 and "wan" not in runs["same-dc"]


def test_pdd_relays_and_hands_off_while_cross_dc_waits(runs):
    pdd, naive = runs["pdd"], runs["cross-dc"]
    assert pdd["token_share"]["rld"] > 0
    assert pdd["pipelines"]["P->RLD->MD"] > 0
    assert sum(pdd["handoffs"].values()) > 0
    assert pdd["handoff_gap_s"]["n"] > 0
    assert naive["pipelines"]["P->RLD->MD"] == naive["pipelines"]["P->RLD"] == 0
    assert pdd["ttft_s"]["p90"] < naive["ttft_s"]["p90"]


def test_the_drc_holds_most_prefixes_and_cuts_wan_bytes(runs):
    pdd, nodrc = runs["pdd"], runs["pdd-no-drc"]
    assert runs["cross-dc"]["prefix"]["decode_side_hit_ratio"] > 0.6
    assert nodrc["prefix"]["decode_side_hit_ratio"] == 0
    per_req = (nodrc["wan"]["kv_bytes"] + nodrc["wan"]["kv_bytes_cancelled"]) / nodrc["requests"]
    assert per_req > 2 * pdd["wan"]["kv_bytes_per_request"]
    view = pdd["wan"]["view"]
    assert view["predictions"] > 0  # P's view of MD's cache was consulted and repaired


def test_p_hears_what_a_turn_left_on_md_before_the_next_turn_arrives(runs):
    """MD tells P what a finished request left in its tree at the request's end, as the
    daemons do, so an agent's next turn (sent the moment the reply is in) is predicted from
    it. When the notice rode only on MD's next KV_ALLOC answer -- the next turn's own -- P
    under-predicted 138 of these 160 requests and sent 155 of them through RLD."""
    view = runs["pdd"]["wan"]["view"]
    assert view["predictions"] == runs["pdd"]["requests"]
    assert view["under_predicted"] <= 0.02 * view["predictions"]
    assert runs["pdd"]["pipelines"]["P->MD"] > 0.2 * runs["pdd"]["requests"]


def test_on_a_jittery_line_the_notice_still_reaches_p_with_the_last_token():
    """MD posts the notice just before a request's last token, in the same in-order stream:
    a jitter draw that brings the token early brings the notice with it. When the notice kept
    the line's mean delay while the tokens drew jitter, a turn sent on an early last token
    could reach P first: P under-predicted 2 of these 160 turns (most of them sent the moment
    their predecessor ended), and 2.1% of `pdd sim reproduce`'s."""
    workload = {**small_dict()["workload"], "think_time_s": 0.01}
    cfg = small(line={"bw_gbit": 10, "rtt_ms": 30, "jitter_ms": 3.0}, workload=workload)
    pdd = simulate(cfg, "pdd")
    assert pdd["deferred_turns"] > 0.8 * pdd["requests"]
    view = pdd["wan"]["view"]
    assert view["predictions"] > 0.9 * pdd["requests"]
    assert view["under_predicted"] == 0
    assert pdd["itl_s"]["p90"] - pdd["itl_s"]["p50"] > 0.002  # the tokens did draw jitter


def test_baseline_arrivals_offer_every_system_the_same_requests_at_the_same_times():
    closed = small(requests=200)
    paced = small(requests=200, workload={**closed.source["workload"], "arrivals": "baseline"})
    res = run_systems(paced, ["pdd", "same-dc"])
    base, pdd = res["same-dc"], res["pdd"]
    # the baseline runs closed loop (agents wait for answers: its own schedule binds) ...
    assert base["deferred_turns"] > 0 and base["arrivals"] == "baseline"
    # ... and PDD replays its send times: it decodes faster, so hardly a turn has to wait
    assert pdd["deferred_turns"] <= 0.02 * pdd["requests"]
    assert pdd["requests"] == base["requests"]
    assert pdd["offered_rps"] == pytest.approx(base["offered_rps"], rel=0.02)
    # closed loop instead: the faster system is offered more requests per second
    alone = {s: simulate(closed, s) for s in ("same-dc", "pdd")}
    assert alone["pdd"]["offered_rps"] > 1.1 * alone["same-dc"]["offered_rps"]
    with pytest.raises(ValueError, match="needs the baseline system"):
        run_systems(paced, ["pdd"])


def test_schedule_replays_recorded_times_in_time_order():
    reqs = [dataclasses.replace(r, arrival_s=float(i)) for i, r in enumerate(trace_like(5))]
    sched = Schedule()
    for r, t in zip(reqs, (0.5, 4.0, 2.5, 3.0, 4.5), strict=True):
        sched.record(r.rid, t)
    out = list(sched.replay(iter(reqs)))
    assert [r.rid for r in out] == [0, 2, 3, 1, 4]
    assert [r.arrival_s for r in out] == [0.5, 2.5, 3.0, 4.0, 4.5]
    sched.times[3] = -1.0
    with pytest.raises(ValueError, match="request 3 was never sent"):
        list(sched.replay(iter(reqs)))


def test_open_arrivals_count_turns_sent_before_their_predecessor_finished():
    cfg = small(requests=120)
    opened = small(requests=120, workload={**cfg.source["workload"], "arrivals": "open"})
    r = simulate(opened, "same-dc")
    assert r["overlapping_turns"] > 0 and r["deferred_turns"] == 0
    assert simulate(cfg, "same-dc")["overlapping_turns"] == 0
    with pytest.raises(ValueError, match="arrivals must be one of"):
        small(workload={**cfg.source["workload"], "arrivals": "sometimes"})


def trace_like(n):
    from pddnet.workload.units import SimRequest

    return [SimRequest(i, i % 2, float(i), (i, i + 1), 1024, 64, (7,)) for i in range(n)]


def write_conversation_trace(
    path: Path,
    n: int,
    turns: int,
    prefix: int,
    growth: int,
    gap_ms: int,
    block: int,
    output_length: Callable[[int], int] = lambda i: 200,
) -> None:
    """A Mooncake-style trace of `n` requests, one every `gap_ms`: conversations of `turns`
    turns whose hash_ids share a `prefix`-block start and grow by `growth` blocks a turn
    (`block` tokens each); request i asks for `output_length(i)` tokens."""
    lines = []
    for i in range(n):
        conv, turn = divmod(i, turns)
        ids = list(range(conv * 1000, conv * 1000 + prefix + growth * turn))
        lines.append(
            {
                "timestamp": i * gap_ms,
                "input_length": len(ids) * block,
                "output_length": output_length(i),
                "hash_ids": ids,
                "conversation": conv,
            }
        )
    path.write_text("\n".join(json.dumps(x) for x in lines))


def test_trace_replay(tmp_path):
    # conversations of 4 turns sharing a 20-block prefix
    path = tmp_path / "t.jsonl"
    write_conversation_trace(path, 40, turns=4, prefix=20, growth=4, gap_ms=500, block=512)
    reqs = list(trace_stream(path, 512))
    assert len(reqs) == 40 and reqs[1].arrival_s == 0.5 and reqs[3].units[:20] == reqs[0].units[:20]
    cfg = small(workload={"kind": "trace", "path": str(path), "requests": 40})
    r = simulate(cfg, "cross-dc")
    assert r["finished"] == 40
    assert r["prefix"]["decode_side_hit_ratio"] > 0.5
    path.write_text(json.dumps({"timestamp": 5, "input_length": 10}))
    with pytest.raises(ValueError, match="missing output_tokens or output_length"):
        list(trace_stream(path, 512))


def test_bad_configs_get_clear_errors():
    with pytest.raises(ValueError, match="unknown system 'pdq'"):
        small(systems=["pdq"])
    with pytest.raises(ValueError, match=r"\[line\]: unknown key\(s\) bandwidth"):
        small(line={"bandwidth": 3})
    with pytest.raises(ValueError, match="queue_mb must hold at least one 1500-byte packet"):
        small(line={"bw_gbit": 10, "queue_mb": 0.001})
    with pytest.raises(ValueError, match="instances: must be an integer >= 1"):
        small(pdd={"prefill": {"chip": "a", "instances": 0}, "main_decode": {"chip": "b"}})
    with pytest.raises(ValueError, match="unknown agent workload field"):
        simulate(small(workload={"requests": 5, "turns": 3}), "pdd")


def test_cli_run_writes_json_and_plots(tmp_path):
    conf = tmp_path / "c.toml"
    conf.write_text("""
seed = 1
model = "qwen2.5-7b"
tokens_per_unit = 512
systems = ["same-dc", "pdd"]
[chips]
a = "gpu-a"
b = "gpu-b"
[pdd]
prefill = { chip = "a", instances = 1 }
relay = { chip = "a", instances = 1 }
main_decode = { chip = "b", instances = 1 }
[baseline]
prefill = { chip = "a", instances = 1 }
decode = { chip = "a", instances = 1 }
[workload]
requests = 40
""")
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(["sim", "run", "--config", str(conf), "--out", str(tmp_path)])
    assert args.handler(args) == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert set(data["systems"]) == {"same-dc", "pdd"}
    assert (tmp_path / "c-ttft.png").stat().st_size > 1000
    bad = parser.parse_args(["sim", "run", "--config", str(tmp_path / "none.toml")])
    assert bad.handler(bad) == 2


def _run_short_of_md_blocks(monkeypatch, system: type[SimulatedSystem]) -> dict:
    """cross-dc on the small config with MD's memory cut to 22%: requests wait for blocks."""
    import pddnet.sim.runner as runner

    monkeypatch.setattr(runner, "SimulatedSystem", system)
    cfg = small(requests=300)
    cfg = dataclasses.replace(cfg, engine=dataclasses.replace(cfg.engine, memory_utilisation=0.22))
    return simulate(cfg, "cross-dc")


def test_a_request_waiting_for_md_blocks_is_counted_once(monkeypatch):
    """md_alloc_waits counts requests that had to wait for blocks, not the retries of the
    head of the queue each time a request left (it used to: 147 for 55 requests here)."""
    waited: set[int] = set()

    class Recording(SimulatedSystem):
        def _alloc(self, st, queue=True):
            ok = super()._alloc(st, queue)
            if not ok:
                waited.add(st.req.rid)
            return ok

    r = _run_short_of_md_blocks(monkeypatch, Recording)
    assert r["finished"] == r["requests"]
    assert r["md_alloc_waits"] == len(waited) > 0


def test_md_serves_waiting_allocations_first_come_first_served(monkeypatch):
    """As MD's daemon: once a request waits for blocks, a later one (even a small one that
    would fit) queues behind it; the waiting ones get blocks in arrival order."""
    asked: dict[int, list[int]] = {}
    granted: dict[int, list[int]] = {}

    class Recording(SimulatedSystem):
        def _md_alloc(self, now, st):
            asked.setdefault(st.md_idx, []).append(st.req.rid)
            super()._md_alloc(now, st)

        def _alloc(self, st, queue=True):
            ok = super()._alloc(st, queue)
            if ok:
                granted.setdefault(st.md_idx, []).append(st.req.rid)
            return ok

    r = _run_short_of_md_blocks(monkeypatch, Recording)
    assert r["finished"] == r["requests"] and r["md_alloc_waits"] > 0
    for md, order in granted.items():
        assert order == asked[md]


def test_requests_rld_finishes_alone_hold_at_most_their_share_of_it(monkeypatch):
    """RLD admits the singular filter's requests (P->RLD, no MD) as the relay daemon does:
    at most singular_share (0.5) of its limits, so low-hit traffic cannot fill the small pool."""
    import pddnet.sim.runner as runner

    peak = [0, 0]

    class Recording(SimulatedSystem):
        def _choose_pipeline(self, st):
            chosen = super()._choose_pipeline(st)
            for a in self.admission:
                peak[0] = max(peak[0], len(a._singular))
                peak[1] = max(peak[1], a.num_requests)
            return chosen

    monkeypatch.setattr(runner, "SimulatedSystem", Recording)
    r = simulate(small(requests=300, policy={"rld_max_requests": 4}), "pdd-no-drc")
    assert r["pipelines"]["P->RLD"] > 0 and r["rld"]["refused"] > 0
    assert peak == [2, 4]  # half of the 4 for requests RLD finishes alone, all 4 in all


@pytest.mark.parametrize("system", ["pdd", "cross-dc", "same-dc", "pdd-no-drc"])
def test_finished_requests_are_freed_by_reference_counting(system):
    # A finished request's state must not wait for the cycle collector: at scale, requests
    # in flight at a collection were promoted to the old generation and, once finished,
    # stayed there as garbage (a third of all simulated requests at 100K, slower and bigger)
    import gc

    from pddnet.sim.system import ReqState

    cfg = small(300, systems=[system])
    gc.collect()
    gc.disable()
    try:
        r = simulate(cfg, system)
        left = sum(1 for o in gc.get_objects() if type(o) is ReqState)
    finally:
        gc.enable()
    assert r["finished"] == 300
    # (a request whose MD member was dropped by a cancel may keep its link: a rare path)
    assert left <= 3, f"{left} of 300 finished requests wait for the cycle collector"


def test_a_request_sent_later_is_the_same_request_at_another_time():
    from pddnet.sim.runner import requests_for

    for r in list(requests_for(small(requests=20)))[:20]:
        assert r.sent_at(r.arrival_s + 1.5) == dataclasses.replace(r, arrival_s=r.arrival_s + 1.5)


def _two_conversations_on_one_system_prompt(b_at: float) -> list:
    """A: a 8192-token system prompt + 1000 tokens of its own, 2000 tokens out (it decodes
    for seconds); B, of another conversation, the same system prompt + 500, sent at `b_at`."""
    import random

    from pddnet.workload.units import SimRequest

    rng = random.Random(5)
    system_prompt = tuple(rng.randrange(1 << 20) for _ in range(8192))
    a = system_prompt + tuple(rng.randrange(1 << 20) for _ in range(1000))
    b = system_prompt + tuple(rng.randrange(1 << 20) for _ in range(500))
    return [
        SimRequest(0, 0, 0.0, a, len(a), 2000, tuple(range(2000))),
        SimRequest(1, 1, b_at, b, len(b), 16, tuple(range(16))),
    ]


@pytest.mark.parametrize("system", ["same-dc", "cross-dc"])
@pytest.mark.parametrize("b_at", [5.0, 60.0])  # while A decodes on MD / D; after A is done
def test_a_request_hits_the_prompt_of_one_still_decoding(system, b_at):
    """MD's (and D's) engine indexes a request's prompt blocks at its first decode step
    (register_computed), so B, sharing A's system prompt, hits it while A is still decoding,
    not only once A has finished (the simulator's DRC took a request's blocks at its end:
    live, a conversation starting on the system prompt of one in flight sent 1.7K tokens'
    KV where the simulator sent 12K)."""
    cfg = parse_config(one_pool_config(requests=2))
    r = simulate(cfg, system, requests=_two_conversations_on_one_system_prompt(b_at))
    assert r["finished"] == 2
    assert r["prefix"]["decode_side_hit_tokens"] == 8192
    if system == "cross-dc":
        kvpt = cfg.model.kv_bytes_per_token
        assert r["wan"]["kv_bytes"] == (9192 + 500) * kvpt


def test_p_batches_a_waiting_prompt_into_a_running_ones_last_chunk():
    """[engine] p_max_seqs (the daemons' P: its max_num_seqs) lets a prompt that arrived while
    a long one is prefilled into the token budget the long one's last chunk leaves, as the
    engine's scheduler does: both finish with that step. 1, the default, is FIFO one prompt at
    a time: the short prompt waits for the long one's end, then has a step of its own."""
    import random

    from pddnet.workload.units import SimRequest

    rng = random.Random(9)
    long_units = tuple(rng.randrange(1 << 20) for _ in range(9 * 2048 + 500))
    short_units = tuple(rng.randrange(1 << 20) for _ in range(1000))
    requests = [
        SimRequest(0, 0, 0.0, long_units, len(long_units), 8, tuple(range(8))),
        SimRequest(1, 1, 0.1, short_units, len(short_units), 8, tuple(range(8))),
    ]
    first_token = {}
    for p_max_seqs in (1, 64):
        cfg = parse_config(one_pool_config(requests=2, chunk_tokens=2048, p_max_seqs=p_max_seqs))
        done: list[dict] = []
        simulate(cfg, "same-dc", requests=requests, request_records=done)
        first_token[p_max_seqs] = {
            r["rid"]: r["ttft_s"] + requests[r["rid"]].arrival_s for r in done
        }
    alone, batched = first_token[1], first_token[64]
    assert alone[1] > alone[0] + 0.01  # a step of its own after the long prompt's last
    assert batched[1] == pytest.approx(batched[0], abs=2e-3)  # the same step (+ its KV hop)
    assert batched[0] > alone[0]  # the shared step is a longer forward
    with pytest.raises(ValueError, match="p_max_seqs must be >= 1"):
        parse_config(one_pool_config(requests=2, p_max_seqs=0))
