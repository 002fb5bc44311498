"""Failure handling in the daemons: heartbeats with deadlines, RLD as the fallback when MD is
lost (or fails its copy) before the cut, redial of a restarted peer, and the router's replay by token ids when the
daemon producing a request dies (the chaos suite in tests/chaos covers more faults)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal

import aiohttp
import pytest
from test_roles_inprocess import all_free, make_config, running

from pddnet.config import ClusterMode
from pddnet.engine.engine import Engine
from pddnet.engine.sampling import SamplingParams
from pddnet.model.loader import load_model
from pddnet.protocol import Submit
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def reference(tiny, prompt: list[int], n: int) -> list[int]:
    model, tok = tiny
    return Engine(model, tok, num_blocks=512, block_size=16).generate(
        prompt, n, SamplingParams(), True
    )


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


async def test_relay_finishes_alone_when_md_is_lost_before_the_cut(tiny):
    prompt = prompt_of(1, 150)
    want = reference(tiny, prompt, 300)  # before the daemons share this event loop
    cfg = make_config(ClusterMode.PDD, pipeline="p_rld_md")
    cfg.wan.heartbeat_s, cfg.wan.heartbeat_deadline_s = 0.2, 1.0
    async with running(cfg, md_delay=30.0) as (daemons, col):  # MD's copy never completes
        p, rld, md = daemons["prefill"], daemons["relay"], daemons["main_decode"]
        # Readiness: each daemon reports every link it needs, all up, when the router connects.
        await col.wait_until(lambda: len(col.links) == 3, what="every daemon's LINK_STATE")
        assert set(col.links["prefill"]) == {
            "started",
            "relay control",
            "main-decode control",
            "main-decode bulk",
        }
        assert set(col.links["relay"]) == {"started", "main-decode control"}
        assert set(col.links["main_decode"]) == {"started"}
        assert all(s.up and s.ready for links in col.links.values() for s in links.values())
        await col.send(
            "prefill",
            Submit(request_id="m1", prompt_token_ids=prompt, max_tokens=300, ignore_eos=True),
        )
        await col.wait_until(lambda: len(col.tokens["m1"]) >= 5, what="RLD's first tokens")
        await md.close()  # MD goes away before any handoff
        await col.wait_until(lambda: col.complete("m1"), what="m1 to complete on RLD")
        assert col.output("m1") == want and set(col.producers("m1")) == {"relay"}
        assert not col.duplicates and not col.errors
        assert p.stats()["counters"]["main_lost_relay_continues"] == 1
        assert rld.stats()["counters"]["handoffs_abandoned"] == 1
        # While MD is down, new requests stay on RLD (the fallback), and succeed.
        prompt2 = prompt_of(2, 40)
        await col.send(
            "prefill",
            Submit(request_id="m2", prompt_token_ids=prompt2, max_tokens=12, ignore_eos=True),
        )
        await col.wait_until(lambda: col.complete("m2"), what="m2 on RLD while MD is down")
        assert col.output("m2") == reference(tiny, prompt2, 12)
        # ... and say why: MD's link is down, since when, with the cause (not "configured")
        decision = col.pipelines["m2"]
        assert decision.pipeline == "p_rld", decision
        assert decision.reason.startswith(
            "main_decode unreachable: main-decode control down since "
        ), decision
        md_link = col.links["prefill"]["main-decode control"]
        assert not md_link.up and not md_link.ready and md_link.detail
        assert not col.links["prefill"]["main-decode bulk"].up
        assert p.stats()["counters"]["main_decode_down_rerouted"] == 1
        assert p.stats()["peers"]["main-decode control"]["up"] is False
        await all_free({"prefill": p, "relay": rld})


async def test_relay_finishes_alone_when_md_fails_the_request_before_the_cut(tiny):
    """MD aborting a request by itself before the cut (here P's control connection to MD closes
    while MD's copy is incomplete, as on a starved WAN line) is MD's copy's failure, not the
    request's: RLD, still decoding, finishes it alone (it was cancelled, and the request
    failed at the router, with "main_decode_failed")."""
    prompt = prompt_of(7, 150)
    want = reference(tiny, prompt, 300)
    cfg = make_config(ClusterMode.PDD, pipeline="p_rld_md")
    async with running(cfg, md_delay=30.0) as (daemons, col):  # MD's copy stays incomplete
        p, rld, md = daemons["prefill"], daemons["relay"], daemons["main_decode"]
        await col.send(
            "prefill",
            Submit(request_id="f1", prompt_token_ids=prompt, max_tokens=300, ignore_eos=True),
        )
        await col.wait_until(lambda: len(col.tokens["f1"]) >= 5, what="RLD's first tokens")
        assert md.active_phases() == {"f1": "receiving_kv"}
        await p.control["main_decode"].conn.close("test: the line dropped P's control lane")
        await col.wait_until(lambda: col.complete("f1"), what="f1 to complete on RLD")
        assert col.output("f1") == want and set(col.producers("f1")) == {"relay"}
        assert not col.duplicates and not col.errors
        events = col.events("f1")
        assert events["md_dropped"].producer == "main_decode"
        assert "before the KV was complete" in events["md_dropped"].detail_str
        assert events["handoff_abandoned"].detail_str.startswith("main decode dropped it: ")
        assert rld.stats()["counters"]["handoffs_abandoned"] == 1
        assert p.stats()["counters"]["main_lost_relay_continues"] == 1
        await all_free(daemons)


async def test_md_finishes_alone_when_rld_is_lost_after_the_cut(tiny):
    """Past the final HANDOFF MD carries the request: losing RLD then must not drop it (it did,
    silently, and only the router's 30 s stall timer revived it)."""
    prompt = prompt_of(6, 60)
    want = reference(tiny, prompt, 200)
    cfg = make_config(ClusterMode.PDD, handoff="one-shot", pipeline="p_rld_md")
    async with running(cfg) as (daemons, col):
        p, rld, md = daemons["prefill"], daemons["relay"], daemons["main_decode"]
        await col.send(
            "prefill",
            Submit(request_id="r1", prompt_token_ids=prompt, max_tokens=200, ignore_eos=True),
        )
        await col.wait_until(
            lambda: "main_decode" in col.producers("r1"), what="MD's first token after the cut"
        )
        await rld.close()
        await col.wait_until(lambda: col.complete("r1"), what="r1 to complete on MD")
        assert col.output("r1") == want and not col.duplicates and not col.errors
        assert md.stats()["counters"].get("aborted", 0) == 0
        await all_free({"prefill": p, "main_decode": md})


# -- real processes: SIGKILL / SIGSTOP, the router's replay ------------------------------------


async def _stream(url: str, body: dict, seen: list[int]) -> dict:
    """Stream a completion, appending token ids to `seen` as they arrive; return the pdd object
    (or the error)."""
    body = {**body, "stream": True, "return_token_ids": True}

    async with aiohttp.ClientSession() as s, s.post(url + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.strip()
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            if "error" in chunk:
                return {"error": chunk["error"]}
            for c in chunk.get("choices", []):
                seen.extend(c.get("token_ids") or [])
            if "pdd" in chunk:
                return chunk["pdd"]
    return {}


@contextlib.asynccontextmanager
async def streaming_past_the_cut(prompt: list[int], max_tokens: int):
    """A real-process PDD cluster (WAN proxy, one-shot handoff, 0.25 s heartbeats with a 1.5 s
    deadline) streaming `prompt`; entered once MD has taken the request over and is the only
    producer (tokens past the cut). Yields the cluster, the request body, the stream's task
    (its pdd object) and the token ids seen so far."""
    from pddnet.cluster.local import LocalCluster

    overrides = {
        "policy.pipeline": "p_rld_md",
        "policy.handoff": "one-shot",
        "wan.heartbeat_s": 0.25,
        "wan.heartbeat_deadline_s": 1.5,
    }
    async with LocalCluster(
        mode="pdd", wan="proxy", rtt_ms=10.0, jitter_ms=0.0, bw_mbit=200.0, overrides=overrides
    ) as cluster:
        seen: list[int] = []
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        task = asyncio.create_task(_stream(cluster.url, body, seen))

        async def cut() -> bool:
            stats = await cluster.stats("main_decode")
            return stats["requests"]["handoffs"] >= 1 and len(seen) > 20

        await wait_for(cut, 20, "the handoff to MD")
        yield cluster, body, task, seen


@pytest.mark.timeout(240)
async def test_router_replays_on_the_relay_when_md_dies_after_the_handoff(tiny):
    prompt = prompt_of(3, 120)
    want = reference(tiny, prompt, 400)
    async with streaming_past_the_cut(prompt, 400) as (cluster, body, task, seen):
        os.kill(cluster.daemons["main_decode"].pid, signal.SIGKILL)
        pdd = await asyncio.wait_for(task, 120)
        assert "error" not in pdd, pdd
        assert seen == want  # token-exact, no index twice, none skipped
        assert pdd["replays"] == 1
        replay = [e for e in pdd["timeline"] if e["event"] == "replay"]
        assert replay and "main_decode lost" in replay[0]["detail"]
        # by MD's loss, not by the router's stall timer (30 s of silence)
        assert "no progress" not in replay[0]["detail"], replay
        # MD comes back (same port) and the others redial it: pdd requests work again.
        await cluster.restart("main_decode")

        async def redialled() -> bool:
            # every link up again, P's bulk stripes to MD too: until then P keeps new requests
            # off MD (honest readiness), and this one would never reach it
            return (await cluster.health())["status"] == "ok"

        await wait_for(redialled, 10, "P and RLD to redial the restarted MD", step=0.1)
        seen2: list[int] = []
        prompt2 = prompt_of(4, 60)
        pdd2 = await _stream(cluster.url, {**body, "prompt": prompt2, "max_tokens": 200}, seen2)
        assert "error" not in pdd2 and seen2 == reference(tiny, prompt2, 200)
        assert pdd2["main_tokens"] > 0, pdd2


@pytest.mark.timeout(240)
async def test_a_hung_md_is_detected_and_its_request_replayed(tiny):
    prompt = prompt_of(5, 100)
    want = reference(tiny, prompt, 400)
    async with streaming_past_the_cut(prompt, 400) as (cluster, _, task, seen):
        md_pid = cluster.daemons["main_decode"].pid
        os.kill(md_pid, signal.SIGSTOP)  # hung, its sockets still open
        try:
            pdd = await asyncio.wait_for(task, 120)
        finally:
            os.kill(md_pid, signal.SIGCONT)
        assert "error" not in pdd, pdd
        assert seen == want and pdd["replays"] == 1
        router = await cluster.stats("router")
        assert router["replays"] == 1 and not router.get("stalls"), router
