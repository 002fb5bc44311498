"""P, RLD and MD as real daemons in one process on loopback (no WAN emulator): token-exact
against the colocated Engine in every handoff mode and in the two baselines, exactly once, and
no KV block, task or shared-memory segment left behind.

A tiny event collector stands in for the router: it dials every daemon's events lane as role
"router", sends SUBMIT to P and collects TOKEN_EVENT / TIMELINE / REQUEST_DONE / ERROR.
MD's copy is made to arrive after RLD's with SlowKvMainDecode (KV frames held back on arrival).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import threading
import time
from collections import defaultdict

import pytest

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.device.pacer import StepPacer
from pddnet.engine.engine import Engine
from pddnet.engine.sampling import SamplingParams
from pddnet.model.loader import load_model
from pddnet.protocol import (
    Cancel,
    ErrorMessage,
    KvChunk,
    KvDone,
    LinkState,
    Message,
    Ping,
    Pong,
    RequestDone,
    Submit,
    TokenEvent,
)
from pddnet.protocol.messages import PipelineChoice, Timeline
from pddnet.roles.main_decode import MainDecodeDaemon
from pddnet.roles.prefill import PrefillDaemon
from pddnet.roles.relay import RelayDaemon
from pddnet.transport import Connection, dial
from tests.polling import wait_for, wait_for_sync

pytestmark = pytest.mark.timeout(120)
SECRET = "test-secret-roles"


class Collector:
    """The router's half of the events lanes, reduced to recording what arrives."""

    def __init__(self) -> None:
        self.conns: dict[str, object] = {}
        self.tokens: dict[str, dict[int, tuple[int, str]]] = defaultdict(dict)
        self.duplicates: list[tuple[str, int]] = []
        self.logprobs: dict[str, dict[int, tuple]] = defaultdict(dict)
        self.done: dict[str, RequestDone] = {}
        self.timeline: dict[str, list[Timeline]] = defaultdict(list)
        self.pipelines: dict[str, PipelineChoice] = {}  # P's decision per request
        self.errors: list[ErrorMessage] = []
        self.pongs: list[Pong] = []
        self.links: dict[str, dict[str, LinkState]] = defaultdict(dict)  # per daemon role
        self.changed = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    async def connect(self, name: str, address: tuple[str, int]) -> None:
        conn = await dial(
            *address,
            role="router",
            instance_id="test-router",
            lane="events",
            secret=SECRET.encode(),
        )
        self.conns[name] = conn
        self._tasks.append(asyncio.get_running_loop().create_task(self._read(conn)))

    async def _read(self, conn) -> None:
        async for msg in conn:
            if isinstance(msg, TokenEvent):
                seen = self.tokens[msg.request_id]
                for i, tok in enumerate(msg.token_ids, msg.index):
                    if i in seen:
                        self.duplicates.append((msg.request_id, i))
                    seen[i] = (tok, msg.producer)
                if msg.logprobs:  # (logprob, top ids, top logprobs) per index
                    k = len(msg.top_logprob_ids) // len(msg.token_ids)
                    for j, lp in enumerate(msg.logprobs):
                        self.logprobs[msg.request_id][msg.index + j] = (
                            lp,
                            msg.top_logprob_ids[j * k : (j + 1) * k],
                            msg.top_logprobs[j * k : (j + 1) * k],
                        )
            elif isinstance(msg, RequestDone):
                self.done[msg.request_id] = msg
            elif isinstance(msg, Timeline):
                self.timeline[msg.request_id].append(msg)
            elif isinstance(msg, PipelineChoice):
                self.pipelines[msg.request_id] = msg
            elif isinstance(msg, ErrorMessage):
                self.errors.append(msg)
            elif isinstance(msg, Pong):
                self.pongs.append(msg)
            elif isinstance(msg, LinkState):
                self.links[conn.peer_role][msg.link] = msg
            self.changed.set()

    async def send(self, name: str, msg) -> None:
        await self.conns[name].send(msg)

    async def wait_until(self, cond, timeout: float = 60.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert not self.errors, f"daemons reported errors: {self.errors}"
            left = deadline - time.monotonic()
            assert left > 0, f"timed out waiting for {what}"
            self.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 0.2))

    def complete(self, rid: str) -> bool:
        done = self.done.get(rid)
        return done is not None and len(self.tokens[rid]) >= done.num_output_tokens

    def output(self, rid: str) -> list[int]:
        seen = self.tokens[rid]
        assert sorted(seen) == list(range(len(seen))), f"{rid}: indices have gaps"
        return [seen[i][0] for i in range(len(seen))]

    def producers(self, rid: str) -> list[str]:
        return [self.tokens[rid][i][1] for i in range(len(self.tokens[rid]))]

    def events(self, rid: str) -> dict[str, Timeline]:
        return {e.event: e for e in self.timeline[rid]}

    async def close(self) -> None:
        for conn in self.conns.values():
            await conn.close()
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def make_config(mode: ClusterMode, handoff: str = "dynamic", **policy) -> ClusterConfig:
    cfg = ClusterConfig(name="t-roles", mode=mode, secret=SECRET)
    for sec in (cfg.prefill, cfg.relay, cfg.main_decode):
        sec.port = 0
    cfg.prefill.num_blocks, cfg.relay.num_blocks, cfg.main_decode.num_blocks = 128, 1024, 512
    # Heterogeneous block sizes; P prefills in chunks of 32 tokens.
    cfg.prefill.block_size, cfg.prefill.max_num_batched_tokens = 16, 32
    cfg.relay.block_size = 4
    cfg.main_decode.block_size = 8
    cfg.wan.stripes, cfg.wan.chunk_tokens = 2, 16
    # The daemons share this test's event loop, which the reference Engine blocks for seconds:
    # a 3 s heartbeat deadline would declare healthy peers lost (test_peer_loss uses short ones).
    cfg.wan.heartbeat_deadline_s = 120.0
    cfg.policy.handoff = handoff
    cfg.policy.pipeline = "p_rld_md"  # these tests exercise the handoff; test_drc picks pipelines
    for key, value in policy.items():
        setattr(cfg.policy, key, value)
    return cfg.validate()


class SlowKvMainDecode(MainDecodeDaemon):
    """MD whose KV arrives `kv_arrival_delay_s` late: each KV_CHUNK (and, on a one-sided path,
    the KV_DONE that completes the copy) is handed to MD that much after it came, so an
    in-process test without the WAN emulator sees MD's copy complete well after RLD's."""

    def __init__(self, config: ClusterConfig, kv_arrival_delay_s: float = 0.0) -> None:
        super().__init__(config)
        self.kv_arrival_delay_s = kv_arrival_delay_s

    async def handle(self, conn: Connection, msg: Message) -> None:
        kv_arrival = isinstance(msg, KvChunk) or (isinstance(msg, KvDone) and self.one_sided)
        if not kv_arrival or not self.kv_arrival_delay_s:
            await super().handle(conn, msg)
            return

        async def later() -> None:
            await asyncio.sleep(self.kv_arrival_delay_s)
            await super(SlowKvMainDecode, self).handle(conn, msg)

        self.spawn(later(), f"delayed {msg.TYPE.name} {msg.request_id}")


class FixedStepCost:
    """A modelled device on which every forward lasts `step_s` (StepPacer's cost)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s

    def prefill_step_time(self, chunks) -> float:
        return self.step_s


class PacedSteps:
    """A daemon whose every forward lasts at least `step_s` (paced, as on an emulated device):
    set `step_s` before the daemon's __init__, which calls init_engine."""

    step_s: float

    def init_engine(self) -> None:
        super().init_engine()  # type: ignore[misc]
        self.pacer = StepPacer(FixedStepCost(self.step_s))


class SlowStepRelay(PacedSteps, RelayDaemon):
    """RLD whose every forward lasts at least `step_s`. The tiny model decodes a short request
    on an idle host before MD's delayed copy completes, and on a loaded one it may or may not:
    a test that needs RLD to hand over mid-stream slows RLD down rather than depend on the
    host's load."""

    def __init__(self, config: ClusterConfig, step_s: float) -> None:
        self.step_s = step_s
        super().__init__(config)


class SlowStepMainDecode(PacedSteps, SlowKvMainDecode):
    """MD whose every forward lasts at least `step_s`: a test that needs MD's engine busy when
    something happens between its steps."""

    def __init__(self, config: ClusterConfig, kv_arrival_delay_s: float, step_s: float) -> None:
        self.step_s = step_s
        super().__init__(config, kv_arrival_delay_s)


@contextlib.asynccontextmanager
async def running(
    cfg: ClusterConfig, md_delay: float = 0.0, relay_step_s: float = 0.0, md_step_s: float = 0.0
):
    """Start MD, RLD, P as the mode needs (in dial order, ports 0), plus the collector; with
    `relay_step_s` / `md_step_s`, RLD's / MD's forwards last at least that long."""
    daemons: dict[str, object] = {}
    collector = Collector()
    try:
        if cfg.mode is not ClusterMode.SAME_DC:
            md = daemons["main_decode"] = (
                SlowStepMainDecode(cfg, md_delay, md_step_s)
                if md_step_s
                else SlowKvMainDecode(cfg, md_delay)
            )
            await md.start()
            cfg.main_decode.port = md.port
        if cfg.mode is not ClusterMode.CROSS_DC:
            rld = daemons["relay"] = (
                SlowStepRelay(cfg, relay_step_s) if relay_step_s else RelayDaemon(cfg)
            )
            await rld.start()
            cfg.relay.port = rld.port
        p = daemons["prefill"] = PrefillDaemon(cfg)
        await p.start()
        cfg.prefill.port = p.port
        for name, d in daemons.items():
            await collector.connect(name, ("127.0.0.1", d.port))
        yield daemons, collector
    finally:
        await collector.close()
        for d in daemons.values():
            await d.close()
    # close() left nothing behind: no engine thread, no task, no shared-memory segment
    assert not [t.name for t in threading.enumerate() if t.name.endswith("-engine")]
    assert asyncio.all_tasks() == {asyncio.current_task()}
    relay = daemons.get("relay")
    if relay is not None:
        assert not os.path.exists(f"/dev/shm/{relay.kv_shm_name()}")


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def reference(tiny, prompt, max_tokens, sp, ignore_eos, stop_token_ids=()):
    """The colocated engine's tokens, cut after the first extra stop token (SUBMIT semantics)."""
    model, tok = tiny
    out = Engine(model, tok, num_blocks=128, block_size=16).generate(
        prompt, max_tokens, sp, ignore_eos
    )
    for i, t in enumerate(out):
        if t in stop_token_ids:
            return out[: i + 1]
    return out


def with_stop_token(tiny, req: dict, index: int, request_id: str) -> dict:
    """A copy of `req` with a stop token that first occurs in its output at or after `index`."""
    sp = SamplingParams(temperature=req["temperature"], top_p=req["top_p"], seed=req["seed"])
    ref = reference(tiny, req["prompt_token_ids"], req["max_tokens"], sp, req["ignore_eos"])
    fresh = [i for i in range(index, len(ref)) if ref[i] not in ref[:i]]
    assert fresh, f"no token first occurring at index >= {index} in {request_id}'s output"
    return dict(req, request_id=request_id, stop_token_ids=(ref[fresh[0]],))


def workload(seed_base: int = 0) -> list[dict]:
    """Mixed prompt / output lengths, greedy and seeded sampling."""
    out = []
    specs = [
        (12, 24, 0.0, True),
        (45, 90, 0.8, True),
        (70, 40, 0.0, False),
        (33, 500, 1.0, True),
        (5, 1, 0.0, True),
    ]
    for i, (plen, max_tokens, temp, ignore_eos) in enumerate(specs):
        prompt = [(37 * i + 11 * j + seed_base) % 250 + 1 for j in range(plen)]
        out.append(
            dict(
                request_id=f"r{seed_base}-{i}",
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                temperature=temp,
                top_p=0.9 if temp else 1.0,
                seed=1000 + i if temp else None,
                ignore_eos=ignore_eos,
            )
        )
    return out


async def run_workload(tiny, collector: Collector, reqs: list[dict]) -> None:
    for r in reqs:
        await collector.send("prefill", Submit(**r))
    for r in reqs:
        await collector.wait_until(
            lambda r=r: collector.complete(r["request_id"]), what=f"{r['request_id']} to complete"
        )
    assert not collector.duplicates, f"indices emitted twice: {collector.duplicates}"
    assert not collector.errors
    for r in reqs:
        sp = SamplingParams(temperature=r["temperature"], top_p=r["top_p"], seed=r["seed"])
        ref = reference(
            tiny,
            r["prompt_token_ids"],
            r["max_tokens"],
            sp,
            r["ignore_eos"],
            r.get("stop_token_ids", ()),
        )
        assert collector.output(r["request_id"]) == ref, r["request_id"]
        if r.get("stop_token_ids") and len(ref) < r["max_tokens"]:
            assert collector.done[r["request_id"]].reason == "stop"


async def all_free(daemons: dict, timeout: float = 20.0) -> None:
    last: dict = {}

    def free() -> bool:
        stats = last["stats"] = {name: d.stats() for name, d in daemons.items()}
        json.dumps(stats)  # JSON-able, as `pdd status` needs
        # and P's WAN backlog (bytes MD has not acknowledged) released however requests ended
        return all(
            s["kv_blocks"]["free"] == s["kv_blocks"]["total"]
            and s["requests"]["active"] == 0
            and s.get("planner", {}).get("wan_backlog_bytes", 0) == 0
            and s.get("planner", {}).get("wan_backlog_requests", 0) == 0
            for s in stats.values()
        )

    await wait_for(free, timeout, lambda: f"KV freed everywhere: {last['stats']}")


def handoff_frames(md: MainDecodeDaemon) -> int:
    return sum(c.stats["frames_in"].get("HANDOFF", 0) for c in md.server.connections)


@pytest.mark.parametrize("handoff", ["one-shot", "streaming", "dynamic"])
async def test_pdd_token_exact_in_every_handoff_mode(tiny, handoff):
    cfg = make_config(ClusterMode.PDD, handoff, handoff_chunk=4, handoff_threshold_tokens=12)
    async with running(cfg, md_delay=0.25) as (daemons, col):
        reqs = workload()
        # extra stop tokens, hit early (by RLD) and late (by MD, after the handoff)
        stops = [
            with_stop_token(tiny, reqs[1], 2, "stop-early"),
            with_stop_token(tiny, reqs[3], 440, "stop-late"),
        ]
        await run_workload(tiny, col, reqs + stops)
        assert col.producers("stop-early")[-1] == "relay"
        assert col.producers("stop-late")[-1] == "main_decode"
        await all_free(daemons)
        md, rld = daemons["main_decode"], daemons["relay"]
        modes = {
            col.events(r["request_id"])["handoff_start"].detail_str
            for r in reqs
            if "handoff_start" in col.events(r["request_id"])
        }
        long_rid = reqs[3]["request_id"]  # 500 tokens: handed over to MD
        producers = col.producers(long_rid)
        # Eager: RLD made the first tokens, MD the rest after one cut.
        assert producers[0] == "relay" and producers[-1] == "main_decode"
        cut = producers.index("main_decode")
        assert set(producers[:cut]) == {"relay"} and set(producers[cut:]) == {"main_decode"}
        ev = col.events(long_rid)
        assert ev["rld_kv_complete"].time < ev["md_kv_complete"].time
        assert {
            "prefill_start",
            "prefill_end",
            "wan_kv_sent",
            "handoff_start",
            "handoff_end",
            "first_md_token",
        } <= set(ev)
        assert ev["first_md_token"].detail_int == cut
        # Token ids, not KV: one-shot < 2 KiB per 100 tokens (per at least 100: a cut of a few
        # tokens, as when RLD is slowed by a loaded machine, is mostly the frame's fixed fields);
        # streaming (a frame per `chunk` tokens) still a small fraction of the 1 KiB per token of
        # the tiny model's KV.
        handoff_bytes = ev["handoff_end"].detail_int
        if ev["handoff_start"].detail_str == "one-shot":
            assert handoff_bytes * 100 / max(cut, 100) < 2048
        assert handoff_bytes < cut * 1024 / 8
        max_extend = md.stats()["max_extend_tokens"]
        if handoff == "one-shot":
            assert modes == {"one-shot"}
            assert handoff_frames(md) == md.stats()["requests"]["handoffs"]
            assert max_extend["one-shot"] >= cut  # the whole backlog in one extend step
        elif handoff == "streaming":
            assert modes == {"streaming"}
            assert handoff_frames(md) > md.stats()["requests"]["handoffs"]  # non-final ones
            assert max_extend["streaming"] <= 4  # never more than `chunk` per step
        else:  # per request: one-shot iff the backlog is within the threshold (RLD not loaded)
            for r in reqs:
                start = col.events(r["request_id"]).get("handoff_start")
                if start is not None:
                    want = "one-shot" if start.detail_int <= 12 else "streaming"
                    assert start.detail_str == want, (r["request_id"], start)
            assert max_extend.get("streaming", 0) <= 4
        # The 1-token request ends with P's token: RLD reports it, nothing decodes.
        tiny_rid = reqs[4]["request_id"]
        assert col.producers(tiny_rid) == ["relay"] and col.done[tiny_rid].reason == "length"
        assert rld.stats()["requests"]["handed_off"] >= 1


def settle_engine_between_calls(daemon) -> None:
    """Injected delay: after each engine call the daemon makes, wait (bounded) until its engine
    has nothing left to compute, so the engine steps between any two calls -- what a busy
    event loop does by chance."""
    original = daemon.compute

    async def compute(fn, *args, **kwargs):
        result = await original(fn, *args, **kwargs)

        async def idle() -> bool:
            return not await original(daemon.engine.has_work)

        with contextlib.suppress(AssertionError):  # at most 5 s: a settle, not a check
            await wait_for(idle, 5.0, "the engine to settle", step=0.002)
        return result

    daemon.compute = compute


async def test_one_shot_handoff_is_one_extend_even_when_the_engine_steps_between_calls(tiny):
    """Regression: MD applied a HANDOFF as three engine calls (chunk cap, append, release). A
    step between the append and the release extended all but the last handed-over token while
    the sequence was still held, then that last one: the one-shot cut took two steps."""
    cfg = make_config(ClusterMode.PDD, "one-shot", handoff_chunk=4)
    async with running(cfg, md_delay=0.25) as (daemons, col):
        md = daemons["main_decode"]
        settle_engine_between_calls(md)
        req = workload()[3]  # 500 tokens: RLD cannot finish it first
        await run_workload(tiny, col, [req])
        producers = col.producers(req["request_id"])
        cut = producers.index("main_decode")
        assert cut > 2, producers
        # index 0 (never computed on MD) plus every handed-over token, in one step
        assert md.stats()["max_extend_tokens"] == {"one-shot": cut}
        await all_free(daemons)


def delay_calls(daemon, name: str, seconds: float) -> None:
    """Injected delay: the daemon's engine calls of function ``name`` start ``seconds`` late."""
    original = daemon.compute

    async def compute(fn, *args, **kwargs):
        if getattr(fn, "__name__", "") == name:
            await asyncio.sleep(seconds)
        return await original(fn, *args, **kwargs)

    daemon.compute = compute


@pytest.mark.parametrize("handoff", ["one-shot", "streaming"])
async def test_a_slow_relay_allocation_still_hands_off(tiny, handoff):
    """Regression: MD's TAKEOVER (MD -> RLD) once arrived before P's KV_ALLOC_REQUEST (P -> RLD)
    was served, when RLD's engine was slow to reserve, and RLD decoded the request alone. P now
    asks MD only after RLD's admission answer (P->RLD->MD), so the TAKEOVER cannot overtake the
    allocation any more (RLD still parks one that would); the request hands over as usual."""
    cfg = make_config(ClusterMode.PDD, handoff, handoff_chunk=4)
    async with running(cfg, md_delay=0.0) as (daemons, col):
        rld, md = daemons["relay"], daemons["main_decode"]
        delay_calls(rld, "reserve_in_engine", 0.5)
        req = dict(workload()[3], max_tokens=80)
        await run_workload(tiny, col, [req])
        producers = col.producers(req["request_id"])
        assert producers[0] == "relay" and producers[-1] == "main_decode", producers
        assert rld.stats()["counters"].get("early_takeovers", 0) == 0
        assert md.stats()["requests"]["cancelled"] == 0
        await all_free(daemons)


async def test_dynamic_picks_one_shot_for_a_quick_copy_and_streaming_for_a_slow_one(tiny):
    cfg = make_config(ClusterMode.PDD, "dynamic", handoff_chunk=4, handoff_threshold_tokens=32)
    async with running(cfg, md_delay=0.0) as (daemons, col):
        await run_workload(tiny, col, workload(5)[1:2])  # MD's copy lands at once
        # now it lags RLD: long enough for > 32 relay tokens on a loaded box (~15 ms a step),
        # short enough that RLD, ~2 ms a step alone, is far from its 500 tokens
        daemons["main_decode"].kv_arrival_delay_s = 0.6
        await run_workload(tiny, col, workload(9)[3:4])
        fast = col.events("r5-1")["handoff_start"]
        slow = col.events("r9-3")["handoff_start"]
        assert fast.detail_str == "one-shot" and fast.detail_int <= 32
        assert slow.detail_str == "streaming" and slow.detail_int > 32
        stats = daemons["main_decode"].stats()
        assert stats["max_extend_tokens"]["streaming"] <= 4
        await all_free(daemons)


@pytest.mark.parametrize("mode", [ClusterMode.CROSS_DC, ClusterMode.SAME_DC])
async def test_baselines_token_exact(tiny, mode):
    cfg = make_config(mode)
    async with running(cfg) as (daemons, col):
        reqs = workload(3)
        await run_workload(tiny, col, reqs)
        await all_free(daemons)
        want = "main_decode" if mode is ClusterMode.CROSS_DC else "relay"
        for r in reqs:
            assert set(col.producers(r["request_id"])) == {want}
            assert col.done[r["request_id"]].producer == want
            assert "handoff_start" not in col.events(r["request_id"])
        if mode is ClusterMode.CROSS_DC:
            assert col.events(reqs[1]["request_id"])["md_kv_complete"].detail_int > 0
        # every daemon answers heartbeats on its events lane
        for name in daemons:
            await col.send(name, Ping(nonce=7, time=1.5))
        await col.wait_until(lambda: len(col.pongs) == len(daemons), what="PONGs")
        assert {(p.nonce, p.time) for p in col.pongs} == {(7, 1.5)}


async def test_same_prompt_twice_reuses_decode_side_cache(tiny):
    """MD answers hit_tokens > 0 for a cached prefix; P then ships only the rest."""
    cfg = make_config(ClusterMode.CROSS_DC)
    async with running(cfg) as (daemons, col):
        first = workload(7)[1]
        second = dict(first, request_id="again")
        await run_workload(tiny, col, [first])
        await run_workload(tiny, col, [second])
        sent = [col.events(r["request_id"])["wan_kv_sent"].detail_int for r in (first, second)]
        assert 0 < sent[1] < sent[0]
        hits = [
            col.events(r["request_id"])["prefix_hit_tokens"].detail_int for r in (first, second)
        ]
        assert hits[0] == 0 and hits[1] > 0
        assert sent[1] == sent[0] * (45 - hits[1]) // 45  # only positions >= the hit crossed
        await all_free(daemons)


async def test_cancel_mid_stream_frees_blocks_everywhere(tiny):
    cfg = make_config(ClusterMode.PDD, "streaming", handoff_chunk=2)
    async with running(cfg, md_delay=0.3) as (daemons, col):
        prompt = list(range(1, 60))
        await col.send(
            "prefill",
            Submit(request_id="gone", prompt_token_ids=prompt, max_tokens=1500, ignore_eos=True),
        )
        await col.send(
            "prefill",
            Submit(
                request_id="early", prompt_token_ids=prompt[:40], max_tokens=1500, ignore_eos=True
            ),
        )
        await col.wait_until(lambda: len(col.tokens["gone"]) >= 5, what="a few tokens")
        for name in ("prefill", "relay", "main_decode"):  # what the router does
            await col.send(name, Cancel(request_id="early", reason="client disconnected"))
        await col.wait_until(
            lambda: any(p == "main_decode" for _, p in col.tokens["gone"].values()),
            what="MD to take over",
        )
        for name in ("prefill", "relay", "main_decode"):
            await col.send(name, Cancel(request_id="gone", reason="client disconnected"))
        await all_free(daemons)
        assert not col.duplicates
        n = len(col.tokens["gone"])
        assert n < 1500 and "gone" not in col.done


async def test_cancel_right_after_submit_frees_everything(tiny):
    """CANCEL racing the allocations and the prefill: nothing may be left reserved anywhere."""
    cfg = make_config(ClusterMode.PDD, "one-shot")
    async with running(cfg, md_delay=0.05) as (daemons, col):
        for i in range(4):
            rid = f"race-{i}"
            await col.send(
                "prefill",
                Submit(
                    request_id=rid,
                    prompt_token_ids=list(range(1, 90)),
                    max_tokens=200,
                    ignore_eos=True,
                ),
            )
            if i % 2:  # the CANCEL lands at a different point of each request's start
                await asyncio.sleep(0.01 * i)
            for name in ("relay", "main_decode", "prefill"):
                await col.send(name, Cancel(request_id=rid, reason="client disconnected"))
        await all_free(daemons)
        # and the cluster still serves
        await run_workload(tiny, col, workload(11)[:1])
        await all_free(daemons)


def break_one_step(daemon, rid: str, after_sampled: int) -> list[str]:
    """Fault injection: the daemon's next engine step once ``rid``'s sequence has sampled
    ``after_sampled`` tokens raises. Returns a list that records the fault when it fires."""
    engine, real_step, fired = daemon.engine, daemon.engine.step, []

    def step():  # runs in the engine thread
        if not fired and engine.has_request(rid):
            seq = engine.get_sequence(rid)
            if not seq.is_finished and seq.num_sampled_tokens >= after_sampled:
                fired.append(rid)
                raise RuntimeError("injected engine fault")
        return real_step()

    engine.step = step
    return fired


@pytest.mark.parametrize("role, after_sampled", [("prefill", 0), ("relay", 3), ("main_decode", 3)])
async def test_a_failing_engine_step_fails_its_requests_and_frees_their_blocks(
    tiny, role, after_sampled
):
    cfg = make_config(ClusterMode.PDD, "one-shot", handoff_chunk=4)
    async with running(cfg, md_delay=0.25) as (daemons, col):
        fired = break_one_step(daemons[role], "doomed", after_sampled)
        await col.send(
            "prefill",
            Submit(
                request_id="doomed",
                prompt_token_ids=list(range(1, 40)),
                max_tokens=300,
                ignore_eos=True,
            ),
        )
        await wait_for(lambda: col.errors, 30, "an ERROR for the request of the broken step", 0.02)
        assert fired == ["doomed"]
        (err,) = col.errors
        assert err.request_id == "doomed" and err.code == "engine_failed", err
        assert "injected engine fault" in err.message and role in err.message
        assert "doomed" not in col.done
        await all_free(daemons)
        assert daemons[role].stats()["counters"]["engine_errors"] == 1
        col.errors.clear()
        await run_workload(tiny, col, workload(17)[:2])  # the daemon still serves
        await all_free(daemons)


async def test_md_without_room_leaves_the_request_to_rld(tiny):
    """pdd mode, MD's pool too small for the request: P drops the WAN copy, RLD decodes it all."""
    cfg = make_config(ClusterMode.PDD, "one-shot")
    cfg.main_decode.num_blocks = 8  # 64 positions at block size 8
    async with running(cfg) as (daemons, col):
        req = workload(13)[1]  # 45-token prompt + 90 output tokens
        await run_workload(tiny, col, [req])
        assert set(col.producers(req["request_id"])) == {"relay"}
        assert "main_decode_refused" in col.events(req["request_id"])
        assert daemons["main_decode"].stats()["requests"]["refused"] == 1
        await all_free(daemons)


async def test_a_kv_allocation_md_has_no_room_for_yet_waits_instead_of_failing(tiny):
    """cross-dc mode (MD is the only decoder), MD's pool holds one of the two requests at a
    time: the second one's KV_ALLOC waits for the first one's blocks, and both finish
    token-exact with no error (the pool refused nothing; the wait is counted and shown)."""
    cfg = make_config(ClusterMode.CROSS_DC)
    cfg.main_decode.num_blocks = 24  # 45 + 90 tokens need 17 blocks of 8: one at a time
    cfg.router.stall_timeout_s = 0.03  # MD tells the router every 10 ms that it waits
    reqs = [dict(workload(21)[1], request_id=f"room-{i}") for i in range(2)]
    for i, r in enumerate(reqs):  # different prompts: no shared cached prefix
        r["prompt_token_ids"] = [(t + 97 * i) % 250 + 1 for t in r["prompt_token_ids"]]
    async with running(cfg) as (daemons, col):
        await run_workload(tiny, col, reqs)
        md = daemons["main_decode"].stats()["requests"]
        assert md["alloc_waits"] == 1 and md["refused"] == 0
        waits = [
            e for r in reqs for e in col.timeline[r["request_id"]] if e.event == "kv_alloc_wait"
        ]
        assert len(waits) >= 2  # queued, then still queued: not a stall for the router
        await all_free(daemons)


async def test_a_request_cancelled_while_waiting_for_md_room_leaves_nothing(tiny):
    cfg = make_config(ClusterMode.CROSS_DC)
    cfg.main_decode.num_blocks = 24
    big, waiting = (dict(workload(23)[1], request_id=f"cw-{i}") for i in range(2))
    waiting["prompt_token_ids"] = [(t + 97) % 250 + 1 for t in waiting["prompt_token_ids"]]
    async with running(cfg) as (daemons, col):
        md = daemons["main_decode"]
        await col.send("prefill", Submit(**big))
        await col.send("prefill", Submit(**waiting))
        await col.wait_until(
            lambda: md.stats()["requests"]["waiting_for_room"] == 1,
            what="the second allocation to wait",
        )
        await col.send("prefill", Cancel(request_id="cw-1", reason="client went away"))
        await col.wait_until(
            lambda: md.stats()["requests"]["waiting_for_room"] == 0,
            what="the waiting allocation to go",
        )
        await col.wait_until(lambda: col.complete("cw-0"), what="the first request")
        assert not col.errors
        await all_free(daemons)


def test_pdd_serve_serves_until_sigterm_and_cleans_up(tmp_path):
    """`pdd serve relay` by hand (no stats file) in its own process: SIGTERM ends it cleanly
    and the relay's shared-memory pool is unlinked."""
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = make_config(ClusterMode.SAME_DC)
    cfg.relay.port = port
    path = tmp_path / "cluster.toml"
    path.write_text(cfg.to_toml())
    proc = subprocess.Popen(
        [sys.executable, "-m", "pddnet", "serve", "relay", "--config", str(path)]
    )
    try:

        def listening() -> bool:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    return True
            assert proc.poll() is None, "relay exited early"
            return False

        wait_for_sync(listening, 60, "the relay to listen", step=0.1)
        segments = [
            n for n in os.listdir("/dev/shm") if n.startswith(f"pdd-t-roles-relay-{proc.pid}-")
        ]
        assert len(segments) == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not os.path.exists(f"/dev/shm/{segments[0]}")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def test_a_finished_prefill_is_copied_to_rld_while_the_next_prefill_runs(tiny):
    # P's KV export runs beside the engine: A's copy to RLD (and so its first token) must not
    # wait for B's prefill step that is running when the copy can start. Here RLD answers A's
    # KV_ALLOC_REQUEST just after A's prefill ended, while B's last step runs (steps of 2048
    # tokens: A's 1500 with B's first 548, then B's other 2048) -- as a busy RLD or P event loop
    # does (the calibration run saw copies wait up to 4.7 s). In the engine thread the export
    # would run only after that step, i.e. after B's prefill had ended.
    cfg = make_config(ClusterMode.SAME_DC)
    cfg.prefill.max_num_batched_tokens, cfg.prefill.num_blocks = 2048, 512
    cfg.relay.num_blocks = 4096
    reqs = [
        dict(
            request_id=rid,
            prompt_token_ids=[(13 * j + k) % 250 + 1 for j in range(n)],
            max_tokens=4,
            temperature=0.0,
            top_p=1.0,
            seed=None,
            ignore_eos=True,
        )
        for rid, n, k in (("A", 1500, 1), ("B", 2596, 2))
    ]
    async with running(cfg) as (daemons, col):
        relay = daemons["relay"]
        answer = relay._alloc

        async def after_a_prefilled(p, msg):
            if msg.request_id == "A":
                await col.wait_until(lambda: "prefill_end" in col.events("A"), what="A prefilled")
                await asyncio.sleep(0.05)  # the injected delay: B's last step is running
            await answer(p, msg)

        relay._alloc = after_a_prefilled
        for r in reqs:
            await col.send("prefill", Submit(**r))
        for r in reqs:
            await col.wait_until(
                lambda r=r: col.complete(r["request_id"]), what=f"{r['request_id']} to complete"
            )
        await all_free(daemons)
    a, b = col.events("A"), col.events("B")
    assert a["rld_kv_complete"].time < b["prefill_end"].time, (
        f"A's copy completed {a['rld_kv_complete'].time - b['prefill_end'].time:+.3f} s after "
        "B's prefill ended: it waited behind B's step"
    )


# -- vLLM's sampling extensions (issue 24): penalties, min_tokens, n, logprobs ------------------


def extension_requests() -> list[dict]:
    """Penalties and min_tokens, greedy and seeded, two choices of one prompt (n = 2 as the
    router sends it: one SUBMIT per choice, seed = choice_seed(seed, i)), logprobs."""
    from pddnet.engine.sampling import choice_seed

    prompt = [(7 * j) % 40 + 1 for j in range(40)]  # repetitive: the penalties matter
    base = dict(prompt_token_ids=prompt, max_tokens=120, top_p=1.0, ignore_eos=False)
    out = [
        dict(
            base,
            request_id="pen-greedy",
            temperature=0.0,
            seed=None,
            repetition_penalty=1.3,
            frequency_penalty=0.4,
            presence_penalty=0.3,
            logprobs=3,
        ),
        dict(
            base,
            request_id="mintok",
            temperature=0.9,
            seed=77,
            min_tokens=100,
            stop_token_ids=(10, 32),
            presence_penalty=-0.5,
            logprobs=0,
        ),
    ]
    for i in range(2):
        out.append(
            dict(
                base,
                request_id=f"n2-{i}",
                temperature=1.0,
                seed=choice_seed(2**64 - 1, i),
                frequency_penalty=1.1,
                repetition_penalty=0.8,
                top_p=0.95,
            )
        )
    return out


def extension_params(r: dict) -> SamplingParams:
    return SamplingParams(
        temperature=r["temperature"],
        top_p=r["top_p"],
        seed=r["seed"],
        min_tokens=r.get("min_tokens", 0),
        stop_token_ids=tuple(r.get("stop_token_ids", ())),
        presence_penalty=r.get("presence_penalty", 0.0),
        frequency_penalty=r.get("frequency_penalty", 0.0),
        repetition_penalty=r.get("repetition_penalty", 1.0),
        logprobs=r.get("logprobs"),
    )


@pytest.mark.parametrize("mode", [ClusterMode.PDD, ClusterMode.CROSS_DC, ClusterMode.SAME_DC])
async def test_sampling_extensions_token_exact_across_the_handoff_and_a_replay(tiny, mode):
    """Penalties (a function of the prompt and every output token so far), min_tokens and
    n = 2 seeds stay token-exact when RLD hands over to MD mid-stream, and when MD replays a
    request from the tokens the client has; logprobs computed wherever a token is sampled
    (P for index 0, RLD, MD) reach the router with it and match the reference."""
    model, tok = tiny
    reqs = extension_requests()
    refs = {}
    for r in reqs:
        eng = Engine(model, tok, num_blocks=128, block_size=16)
        refs[r["request_id"]] = eng.generate_logprobs(
            r["prompt_token_ids"], r["max_tokens"], extension_params(r), r["ignore_eos"]
        )
        eng.close()
    # the extensions change the tokens (or the test would prove nothing)
    plain = Engine(model, tok, num_blocks=128, block_size=16).generate(
        reqs[0]["prompt_token_ids"], 120, SamplingParams(), False
    )
    assert refs["pen-greedy"][0] != plain
    assert refs["n2-0"][0] != refs["n2-1"][0]
    mintok = refs["mintok"][0]
    assert len(mintok) >= 100 and not {10, 32, tok.eos_token_id} & set(mintok[:99])

    cfg = make_config(mode, "streaming", handoff_chunk=4)
    # RLD at >= 10 ms a step needs >= 1.2 s for 120 tokens, MD's copy completes after ~0.25 s:
    # in PDD every request is handed over mid-stream, however busy the host
    async with running(cfg, md_delay=0.25, relay_step_s=0.01) as (daemons, col):
        for r in reqs:
            await col.send("prefill", Submit(**r))
        for r in reqs:
            await col.wait_until(
                lambda r=r: col.complete(r["request_id"]), what=f"{r['request_id']} to complete"
            )
        assert not col.duplicates and not col.errors
        for r in reqs:
            rid = r["request_id"]
            tokens, entries = refs[rid]
            assert col.output(rid) == tokens, rid
            if r.get("logprobs") is not None:  # every token's, wherever it was sampled
                got = col.logprobs[rid]
                assert sorted(got) == list(range(len(tokens))), rid
                for i, e in enumerate(entries):
                    assert abs(got[i][0] - e.logprob) < 1e-9 and got[i][1] == e.top_ids, (rid, i)
        if mode is ClusterMode.PDD:
            handed = [
                r["request_id"]
                for r in reqs
                if {"main_decode", "relay"} <= set(col.producers(r["request_id"]))
            ]
            assert handed == [r["request_id"] for r in reqs], "RLD hands every request over"
        # A replay by token ids on a decode tier (what the router does when the carrier is
        # lost): the history-dependent sampling continues token-exact from index 50.
        r = dict(reqs[1], request_id="mintok-replay")
        tier = "relay" if mode is ClusterMode.SAME_DC else "main_decode"
        await col.send(tier, Submit(**r, output_token_ids=tuple(mintok[:50])))
        await col.wait_until(
            lambda: (
                "mintok-replay" in col.done
                and len(col.tokens["mintok-replay"])
                == col.done["mintok-replay"].num_output_tokens - 50
            ),
            what="the replay",
        )
        got = col.tokens["mintok-replay"]
        assert [got[i][0] for i in sorted(got)] == mintok[50:]
        assert sorted(got) == list(range(50, len(mintok)))
        await all_free(daemons)


async def test_logprobs_reach_the_router_with_their_tokens(tiny):
    """TOKEN_EVENT carries each token's raw logprob and top-k where it was sampled: P's first
    token (through KV_DONE), RLD's, MD's after the cut; equal to the reference engine's."""
    model, tok = tiny
    r = dict(
        request_id="lp",
        prompt_token_ids=list(range(1, 60)),
        max_tokens=300,
        temperature=0.8,
        top_p=1.0,
        seed=5,
        ignore_eos=True,
        logprobs=4,
        repetition_penalty=1.2,
    )
    eng = Engine(model, tok, num_blocks=128, block_size=16)
    want_tokens, want = eng.generate_logprobs(r["prompt_token_ids"], 300, extension_params(r), True)
    eng.close()
    cfg = make_config(ClusterMode.PDD, "one-shot", handoff_chunk=4)
    async with running(cfg, md_delay=0.25) as (daemons, col):
        await col.send("prefill", Submit(**r))
        await col.wait_until(lambda: col.complete("lp"), what="lp to complete")
        assert col.output("lp") == want_tokens
        producers = col.producers("lp")
        assert producers[0] == "relay" and producers[-1] == "main_decode", producers
        assert len(want) == len(want_tokens) == len(col.logprobs["lp"])
        for i, entry in enumerate(want):
            lp, top_ids, top_lps = col.logprobs["lp"][i]
            assert abs(lp - entry.logprob) < 1e-9, i
            assert top_ids == entry.top_ids and len(top_ids) == 4
            assert all(abs(a - b) < 1e-9 for a, b in zip(top_lps, entry.top_logprobs, strict=True))
        await all_free(daemons)


async def test_a_parked_takeover_whose_allocation_never_comes_expires_on_its_own(tiny, monkeypatch):
    """Issue 23: a TAKEOVER that overtook an allocation that never comes is released after the
    TTL by its own timer (before, only a later TAKEOVER swept it, so a lone one stayed)."""
    from pddnet.protocol import Takeover
    from pddnet.roles import relay as relay_module

    monkeypatch.setattr(relay_module, "EARLY_TAKEOVER_TTL_S", 0.3)
    async with running(make_config(ClusterMode.PDD)) as (daemons, col):
        rld = daemons["relay"]
        rld._takeover(Takeover(request_id="never-allocated", ready_position=4, chunk_tokens=16))
        assert rld.stats()["early_takeovers_waiting"] == 1
        await col.wait_until(
            lambda: rld.stats()["early_takeovers_waiting"] == 0,
            timeout=10,
            what="the parked TAKEOVER to expire",
        )
        assert rld.stats()["counters"]["early_takeovers_expired"] == 1
