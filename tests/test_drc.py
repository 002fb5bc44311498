"""The decode-side RadixCache and pipelines with real daemons (P, RLD, MD in one process on
loopback; the pipeline tests over the emulated WAN): incremental KV bytes, P's view under
eviction, admission control against a flood, and the singular-traffic filter's cancel."""

from __future__ import annotations

import random

import pytest
from test_roles_inprocess import all_free, make_config, running

from pddnet.config import ClusterMode
from pddnet.engine.engine import Engine
from pddnet.engine.sampling import SamplingParams
from pddnet.model.loader import load_model
from pddnet.protocol import Submit
from tests.polling import wait_for

pytestmark = pytest.mark.timeout(150)
MD_BS = 8  # make_config's MD block size


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def reference(tiny, prompt, max_tokens, sp, ignore_eos) -> list[int]:
    model, tok = tiny
    return Engine(model, tok, num_blocks=512, block_size=16).generate(
        prompt, max_tokens, sp, ignore_eos
    )


def kv_bytes_per_token(daemons) -> int:
    return daemons["prefill"].engine.pool.spec.bytes_per_token


def req(rid: str, prompt: list[int], max_tokens: int) -> dict:
    return dict(
        request_id=rid,
        prompt_token_ids=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        top_p=1.0,
        seed=None,
        ignore_eos=True,
    )


async def run(col, tiny, r: dict) -> list[int]:
    """Send one request, wait for it, check it token-exact; return its output."""
    await col.send("prefill", Submit(**r))
    await col.wait_until(lambda: col.complete(r["request_id"]), what=r["request_id"])
    out = col.output(r["request_id"])
    assert out == reference(tiny, r["prompt_token_ids"], r["max_tokens"], SamplingParams(), True)
    return out


def detail(col, rid: str, event: str) -> int:
    return col.events(rid)[event].detail_int


def rand_prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 256) for _ in range(n)]


async def test_only_the_uncached_kv_crosses_and_stays_token_exact(tiny):
    cfg = make_config(ClusterMode.PDD, pipeline="p_md")
    async with running(cfg) as (daemons, col):
        kvb = kv_bytes_per_token(daemons)
        p1 = rand_prompt(1, 300)
        out1 = await run(col, tiny, req("t1", p1, 24))
        assert detail(col, "t1", "prefix_hit_tokens") == 0
        assert detail(col, "t1", "md_kv_complete") == 300 * kvb
        # MD tells P what t1 left in its tree when t1 ends (a next turn comes after that).
        view = daemons["prefill"].planner.view
        await col.wait_until(lambda: len(view) >= 300 // MD_BS, what="MD's cache notice")
        # The next turn appends to the previous prompt and reply (agent traffic).
        p2 = p1 + out1 + rand_prompt(2, 37)
        await run(col, tiny, req("t2", p2, 16))
        shared = len(p1) + len(out1)
        hit = detail(col, "t2", "prefix_hit_tokens")
        assert shared - MD_BS < hit <= shared and hit % MD_BS == 0
        assert detail(col, "t2", "md_kv_complete") == (len(p2) - hit) * kvb
        # P's view predicted MD's hit from CACHE_EVENTS alone: nothing was wrong.
        assert view.predictions == 2 and view.wrong == 0 and view.notices >= 1, view.counters()
        drc = daemons["main_decode"].stats()["drc"]
        assert drc["hit_tokens"] >= hit and sum(drc["hit_intervals"].values()) == 2
        await all_free(daemons)


async def test_a_turn_sent_the_moment_the_last_one_ends_finds_p_knowing_mds_cache(tiny):
    """An agent with no think time sends its next turn the moment the last token arrives: MD
    tells P what the ended turn left in its tree before that token goes, so P predicts the next
    turn's hit exactly. MD's forwards last 30 ms and another request keeps it stepping, so a
    notice sent only after the ended request's blocks were freed (a step or two later, at
    best) would reach P after the next turn."""
    cfg = make_config(ClusterMode.PDD, pipeline="p_md")
    async with running(cfg, md_step_s=0.03) as (daemons, col):
        view = daemons["prefill"].planner.view
        busy = req("busy", rand_prompt(9, 64), 120)
        await col.send("prefill", Submit(**busy))
        p1 = rand_prompt(1, 300)
        await col.send("prefill", Submit(**req("t1", p1, 24)))
        await col.wait_until(lambda: col.complete("t1"), what="t1")
        out1 = col.output("t1")
        p2 = p1 + out1 + rand_prompt(2, 37)
        await col.send("prefill", Submit(**req("t2", p2, 8)))  # at once, no think time
        await col.wait_until(lambda: col.complete("t2") and col.complete("busy"), what="t2")
        shared = len(p1) + len(out1)
        hit = detail(col, "t2", "prefix_hit_tokens")
        assert shared - MD_BS < hit <= shared  # MD had t1's prompt and reply
        assert view.predictions == 3 and view.wrong == 0, view.counters()
        for rid, prompt, n in (
            ("t1", p1, 24),
            ("t2", p2, 8),
            ("busy", busy["prompt_token_ids"], 120),
        ):
            assert col.output(rid) == reference(tiny, prompt, n, SamplingParams(), True), rid
        await all_free(daemons)


async def test_eviction_behind_ps_back_moves_the_right_bytes_and_repairs_the_view(tiny):
    cfg = make_config(ClusterMode.PDD, pipeline="p_md")
    async with running(cfg) as (daemons, col):
        p, md = daemons["prefill"], daemons["main_decode"]
        kvb = kv_bytes_per_token(daemons)
        p1 = rand_prompt(3, 200)
        out1 = await run(col, tiny, req("e1", p1, 8))
        await col.wait_until(lambda: len(p.planner.view) >= 200 // MD_BS, what="cache notice")
        p2 = p1 + out1 + rand_prompt(4, 20)
        believed = p.planner.view.predict(p2).hit_tokens
        assert believed >= 200 - MD_BS
        # MD evicts everything unreferenced; the notice can only reach P with MD's next frame.
        cache = md.engine.prefix_cache
        evicted = await md.compute(lambda: cache.evict(cache.num_evictable))
        assert evicted
        await run(col, tiny, req("e2", p2, 8))
        assert detail(col, "e2", "prefix_hit_tokens") == 0  # MD's answer wins
        assert detail(col, "e2", "md_kv_complete") == len(p2) * kvb  # P sent all it lacked
        assert detail(col, "e2", "md_view_wrong") == believed
        view = p.planner.view
        assert (view.wrong, view.over_predicted) == (1, 1)
        assert p.stats()["counters"]["md_view_wrong"] == 1
        # Repaired: the next turn's prediction is MD's real hit again.
        p3 = p2 + rand_prompt(5, 30)
        await col.wait_until(
            lambda: view.predict(p3).hit_tokens >= len(p2) - MD_BS, what="notice of e2's blocks"
        )
        predicted = view.predict(p3).hit_tokens
        await run(col, tiny, req("e3", p3, 8))
        assert detail(col, "e3", "prefix_hit_tokens") == predicted > 0
        assert view.wrong == 1
        await all_free(daemons)


async def test_a_flood_never_takes_rld_past_its_admission_limit(tiny):
    cfg = make_config(ClusterMode.PDD, pipeline="p_rld_md", rld_max_requests=2)
    async with running(cfg, md_delay=0.05) as (daemons, col):
        reqs = [req(f"f{i}", rand_prompt(100 + i, 120 + 7 * i), 20) for i in range(12)]
        for r in reqs:  # all at once: low-hit traffic, far more than RLD may take
            await col.send("prefill", Submit(**r))
        for r in reqs:
            await col.wait_until(lambda r=r: col.complete(r["request_id"]), what=r["request_id"])
            sp = SamplingParams()
            assert col.output(r["request_id"]) == reference(
                tiny, r["prompt_token_ids"], 20, sp, True
            )
        adm = daemons["relay"].stats()["admission"]
        assert adm["peak_requests"] <= 2 and adm["refused"] > 0, adm
        assert adm["admitted"] + adm["refused"] == 12
        pc = daemons["prefill"].stats()["counters"]
        assert pc["relay_refused"] == adm["refused"]
        # the refused ones went P->MD: MD produced all of their tokens
        direct = [r["request_id"] for r in reqs if "relay_refused" in col.events(r["request_id"])]
        assert len(direct) == adm["refused"]
        for rid in direct:
            assert set(col.producers(rid)) == {"main_decode"}
        await all_free(daemons)


async def test_rld_finishing_first_makes_md_free_its_copy(tiny):
    """P->RLD->MD whose output is so short that RLD is done before MD's copy lands (here the
    bytes left P at loopback speed; over a slow WAN P stops sending them: see
    test_pipelines_over_the_emulated_wan)."""
    cfg = make_config(ClusterMode.PDD, pipeline="p_rld_md")
    async with running(cfg, md_delay=1.0) as (daemons, col):
        r = req("s1", rand_prompt(7, 400), 6)
        await run(col, tiny, r)
        assert set(col.producers("s1")) == {"relay"}
        await all_free(daemons)
        md = daemons["main_decode"].stats()
        assert md["requests"]["active"] == 0 and md["counters"].get("tokens_emitted", 0) == 0
        assert md["requests"]["cancelled"] == 1 and md["requests"]["handoffs"] == 0


async def test_pipeline_decision_and_inputs_reach_the_timeline(tiny):
    cfg = make_config(ClusterMode.PDD, pipeline="auto", wan_bw_mbit=8.0, direct_budget_s=0.2)
    async with running(cfg) as (daemons, col):
        await run(col, tiny, req("d1", rand_prompt(9, 60), 4))
        choice = col.pipelines["d1"]
        assert choice.pipeline == "p_md" and choice.prompt_tokens == 60
        assert choice.incremental_bytes == 60 * kv_bytes_per_token(daemons)
        await all_free(daemons)


# -- over the emulated WAN: the estimators see a real rate -------------------------------------


async def _complete(cluster, prompt: list[int], max_tokens: int) -> tuple[list[int], dict]:
    body = await cluster.complete(
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        ignore_eos=True,
        return_token_ids=True,
    )
    return body["choices"][0]["token_ids"], body["pdd"]


@pytest.mark.timeout(240)
async def test_pipelines_over_the_emulated_wan(tiny):
    """20 Mbit/s, 20 ms: 2000 uncached tiny-model tokens (2 MB) need ~0.8 s to cross."""
    from pddnet.cluster.local import LocalCluster

    overrides = {"policy.singular_margin": 20.0, "policy.direct_budget_s": 0.2}
    async with LocalCluster(
        mode="pdd", wan="proxy", rtt_ms=20.0, jitter_ms=0.0, bw_mbit=20.0, overrides=overrides
    ) as cluster:
        kvb = 1024  # tiny: float64, 2 layers x 2 x 2 kv heads x 16 (asserted below)
        sp = SamplingParams()

        def exact(prompt, n, out):
            assert out == reference(tiny, prompt, n, sp, True)

        # Low hit, long input and long output: the relay hides the transfer, then hands off.
        # (1500 tokens: RLD must still be decoding when the 0.8 s copy lands; a fast machine
        # decodes the tiny model at ~1.3 ms a token, and 600 were once all done before it.)
        n_a = 1500
        a = rand_prompt(20, 2000)
        out_a, pa = await _complete(cluster, a, n_a)
        exact(a, n_a, out_a)
        assert pa["pipeline"] == "p_rld_md", pa["pipeline_decision"]
        assert pa["relay_tokens"] > 0 and pa["main_tokens"] > 0
        assert pa["wan_kv_bytes"] == 2000 * kvb

        # Its next turn hits MD's tree: only the tail crosses, directly P->MD.
        async def notice_in(hashes: int) -> None:
            async def noticed() -> bool:
                return (await cluster.stats("prefill"))["planner"]["view"]["hashes"] >= hashes

            await wait_for(noticed, 10, "MD's cache notice to reach P")

        await notice_in((2000 + n_a) // 16 - 1)
        b = a + out_a + rand_prompt(21, 30)
        out_b, pb = await _complete(cluster, b, 16)
        exact(b, 16, out_b)
        hit = pb["prefix_hit_tokens"]
        assert pb["pipeline"] == "p_md" and hit >= 2000 + n_a - 16, pb["pipeline_decision"]
        assert pb["wan_kv_bytes"] == (len(b) - hit) * kvb and pb["relay_tokens"] == 0
        # Long input, two output tokens: RLD finishes it alone; the WAN copy never starts.
        c = rand_prompt(22, 2000)
        out_c, pc = await _complete(cluster, c, 2)
        exact(c, 2, out_c)
        assert pc["pipeline"] == "p_rld" and pc["wan_kv_bytes"] == 0 and pc["main_tokens"] == 0
        # Forty tokens: planned through the relay, but RLD is done before the 0.8 s transfer:
        # P stops sending and MD frees what it had reserved.
        d = rand_prompt(23, 2000)
        out_d, pd = await _complete(cluster, d, 40)
        exact(d, 40, out_d)
        assert pd["pipeline"] == "p_rld_md" and pd["main_tokens"] == 0

        async def d_cancelled() -> bool:
            return (await cluster.stats("prefill"))["counters"]["wan_transfers_cancelled"] >= 1

        await wait_for(d_cancelled, 10, "P to cancel D's WAN copy")

        async def frees_its_kv(role: str) -> None:
            last: dict = {}

            async def holds_nothing() -> bool:
                s = last["stats"] = await cluster.stats(role)
                return (
                    s["requests"]["active"] == 0
                    and s["kv_blocks"]["free"] == s["kv_blocks"]["total"]
                )

            await wait_for(holds_nothing, 10, lambda: f"{role} to free its KV: {last}")

        for role in ("prefill", "relay", "main_decode"):
            await frees_its_kv(role)
        # Read once everything is free, so no byte of D's copy can come after.
        p_stats = await cluster.stats("prefill")
        assert p_stats["counters"]["wan_transfers_cancelled"] >= 1
        sent = p_stats["lanes"]["bulk"]["bytes_out"]
        assert sent < (2000 + 30 + 2000 + 2000) * kvb + 2 * 2000 * kvb  # D's copy was cut short
        assert p_stats["planner"]["bandwidth_samples"] >= 1


async def test_bytes_md_has_not_acknowledged_count_in_the_next_decision(tiny):
    """P's WAN backlog: a request's incremental KV is committed when MD answers and released by
    KV_RECEIVED. A second request that alone would cross within the budget goes through the
    relay while the first one's bytes are unacknowledged, and its decision record says why."""
    model, tok = tiny
    bpt = Engine(model, tok, num_blocks=8, block_size=16).pool.spec.bytes_per_token
    # 1000 tokens of KV per second: 150 tokens take 0.15 s, 100 take 0.1 s (plus RTT <= 30 ms)
    cfg = make_config(
        ClusterMode.PDD, pipeline="auto", wan_bw_mbit=bpt * 1000 * 8 / 1e6, direct_budget_s=0.2
    )
    async with running(cfg, md_delay=0.5) as (daemons, col):
        planner = daemons["prefill"].planner
        first, second = req("b1", rand_prompt(21, 150), 4), req("b2", rand_prompt(22, 100), 40)
        await col.send("prefill", Submit(**first))
        await col.wait_until(lambda: planner.backlog.bytes > 0, what="b1's KV committed")
        assert planner.backlog.bytes == 150 * bpt and planner.backlog.pending == 1
        rec1 = col.pipelines["b1"]
        assert rec1.pipeline == "p_md" and rec1.wan_backlog_bytes == 0
        await col.send("prefill", Submit(**second))
        await col.wait_until(lambda: "b2" in col.pipelines, what="b2's decision")
        rec2 = col.pipelines["b2"]
        assert rec2.wan_backlog_bytes == 150 * bpt
        alone = rec2.rtt_s + 100 * bpt / rec2.bandwidth_bps
        assert alone <= 0.2 < rec2.wan_transfer_s
        assert rec2.wan_transfer_s == pytest.approx(
            alone + 150 * bpt / rec2.bandwidth_bps, abs=1e-5
        )
        assert rec2.pipeline != "p_md" and "behind" in rec2.reason
        for r in (first, second):
            await col.wait_until(lambda r=r: col.complete(r["request_id"]), what=r["request_id"])
            assert col.output(r["request_id"]) == reference(
                tiny, r["prompt_token_ids"], r["max_tokens"], SamplingParams(), True
            )
        await all_free(daemons)  # every committed byte released (all_free checks)
        assert planner.backlog.bytes == 0 and planner.counters()["wan_backlog_requests"] == 0
