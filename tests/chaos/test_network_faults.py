"""Network faults on the emulated WAN between datacenter A (router, P, RLD) and B (MD), injected
through the WAN's control API while a mixed workload runs. Each fault here heals completely, so
every request must come out token-exact (a request may fail only with a clear OpenAI-style
error), nothing may leak, and the cluster must serve new requests afterwards.

The WAN: 30 ms RTT, 1 ms jitter, 8 Mbit/s per direction; the tiny model's KV is 1 KiB per
token, so a 200-500-token prompt's copy needs 0.2-0.5 s to cross to MD (more when several
cross at once) and faults can land mid-transfer. Every request takes the P->RLD->MD pipeline,
so each one has a copy on the WAN; the first prompt of each workload has 900 tokens, so that a
copy is surely crossing when a mid-transfer fault looks for one.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from tests.chaos.harness import (
    Fault,
    after,
    chaos_seed,
    control,
    link_chaos,
    mixed_workload,
    reset_connections,
    run_case,
    when_phase,
)
from tests.conftest import root_netns_missing_reason

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(170)]

PROXY = "pdd-proxy"
PROXY_CLUSTER = {
    "mode": "pdd",
    "wan": "proxy",
    "rtt_ms": 30.0,
    "jitter_ms": 1.0,
    "bw_mbit": 8.0,
    "overrides": {"policy.pipeline": "p_rld_md"},
}
MID_TRANSFER = when_phase("main_decode", ("receiving_kv",))


async def _run(chaos_clusters, key, config, case, fault, seed, **kw):
    cluster = await chaos_clusters.get(key, **config)
    bodies = mixed_workload(6, seed, max_tokens=(8, 120), first_prompt=900)
    result = await run_case(cluster, case, bodies, fault, seed=seed, **kw)
    broken = bool(result.broken())
    if broken or (fault is not None and fault.destructive):
        await chaos_clusters.drop(key, keep_logs=broken)
    result.assert_invariants(logs=cluster.run_dir / "logs")
    return result


async def test_latency_spike_mid_transfer(chaos_clusters):
    fault = link_chaos("latency-spike", MID_TRANSFER, duration=2.0, add_ms=300)
    await _run(chaos_clusters, PROXY, PROXY_CLUSTER, "latency spike +300 ms, 2 s", fault, seed=11)


@pytest.mark.parametrize("dist", ["normal", "pareto-normal"])
async def test_jitter_storm(chaos_clusters, dist):
    fault = link_chaos("jitter-storm", after(0.3), duration=2.5, jitter_ms=40, jitter_dist=dist)
    await _run(
        chaos_clusters,
        PROXY,
        PROXY_CLUSTER,
        f"jitter storm 40 ms {dist}, 2.5 s",
        fault,
        seed=12 if dist == "normal" else 13,
    )


async def test_bandwidth_collapse_mid_transfer(chaos_clusters):
    fault = link_chaos("bandwidth-collapse", MID_TRANSFER, duration=2.0, fraction=0.02)
    await _run(
        chaos_clusters, PROXY, PROXY_CLUSTER, "bandwidth collapse to 2%, 2 s", fault, seed=14
    )


async def test_partition_then_heal(chaos_clusters):
    fault = link_chaos("partition", MID_TRANSFER, duration=2.0)
    await _run(chaos_clusters, PROXY, PROXY_CLUSTER, "partition 2 s, then heal", fault, seed=15)


async def test_slow_client_reads_stream_late(chaos_clusters):
    """Streamed answers are read only 2 s after they began, then slowly: the router and the
    daemons must neither lose nor repeat tokens while the client lags, and free everything."""
    await _run(
        chaos_clusters,
        PROXY,
        PROXY_CLUSTER,
        "slow client (reads 2 s late)",
        None,
        seed=16,
        read_late_s=2.0,
        read_pause_s=0.01,
        kind="slow-client",
    )


def random_schedule(seed: int) -> Fault:
    """Three link faults drawn from `seed`: kind, start offset, duration and strength."""
    rng = random.Random(seed)
    steps = []
    for _ in range(3):
        kind = rng.choice(["latency-spike", "jitter-storm", "bandwidth-collapse", "partition"])
        params = {
            "latency-spike": {"add_ms": rng.choice([100, 250, 400])},
            "jitter-storm": {
                "jitter_ms": rng.choice([10, 30, 60]),
                "jitter_dist": rng.choice(["normal", "pareto-normal"]),
            },
            "bandwidth-collapse": {"fraction": rng.choice([0.02, 0.1, 0.3])},
            "partition": {},
        }[kind]
        steps.append(
            (round(rng.uniform(0.1, 0.8), 2), kind, round(rng.uniform(0.5, 1.5), 2), params)
        )

    async def inject(cluster) -> str:
        c = control(cluster)
        done = []
        for gap, kind, duration, params in steps:
            await asyncio.sleep(gap)
            if fault.injected_at is None:  # the figures time the schedule as one fault
                fault.mark_injected()
            await c.chaos(kind, duration, **params)
            done.append(f"{kind} {duration} s {params}")
            await asyncio.sleep(duration)
        fault.mark_healed()
        return "; ".join(done)

    async def heal(cluster) -> None:
        c = control(cluster)
        await c.heal()
        await c.clear()

    fault = Fault(kind="random-schedule", inject=inject, at=after(0.2), heal=heal)
    return fault


@pytest.mark.heavy
async def test_random_link_schedule(chaos_clusters):
    seed = chaos_seed()
    print(f"random link schedule seed {seed} (replay: PDD_CHAOS_SEED={seed})")
    await _run(
        chaos_clusters,
        PROXY,
        PROXY_CLUSTER,
        "random link schedule",
        random_schedule(seed),
        seed=seed,
    )


@pytest.mark.heavy
async def test_connection_reset_mid_kv(chaos_clusters):
    """Every WAN connection (P's control and bulk lanes to MD, RLD's control lane, the router's
    events lane) is reset while a KV copy crosses: in-flight requests may fail with a clear
    error, and the daemons must reconnect so that new requests are served."""
    await _run(
        chaos_clusters,
        PROXY,
        PROXY_CLUSTER,
        "connection reset mid-KV",
        reset_connections(MID_TRANSFER),
        seed=17,
    )


PACKET = "pdd-packet"
PACKET_CLUSTER = {**PROXY_CLUSTER, "wan": "packet"}


@pytest.mark.heavy
@pytest.mark.root
@pytest.mark.skipif(
    root_netns_missing_reason() is not None, reason=str(root_netns_missing_reason())
)
@pytest.mark.parametrize("loss_pct", [20.0, 100.0])
async def test_loss_burst_on_packet_shell(chaos_clusters, loss_pct):
    """Real TCP through TUN devices: a burst of packet loss (100%: a blackout TCP must ride out
    by retransmission) mid-transfer. TCP recovers; the requests must come out token-exact."""
    fault = link_chaos("loss-burst", MID_TRANSFER, duration=1.5, loss_pct=loss_pct)
    await _run(
        chaos_clusters,
        PACKET,
        PACKET_CLUSTER,
        f"loss burst {loss_pct:g}% 1.5 s (packet)",
        fault,
        seed=18,
    )
