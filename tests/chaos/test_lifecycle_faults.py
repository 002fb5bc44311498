"""Faults at the edges of a cluster's life: a WAN partition that outlasts every timeout of the
WAN path, and faults inside the readiness window (while the cluster starts).

A partition longer than the heartbeat deadline and the KV transfer deadline makes every daemon
give MD up: requests are finished on RLD, replayed, or fail with a clear error; nothing leaks;
once the line heals, P and RLD redial MD and the cluster is ready and serves again.

In the readiness window, `LocalCluster` (what `pdd up` runs) must not return before every link
is up: with the WAN partitioned while the daemons dial, it returns only after the heal, and a
request sent then is routed by the policy, not by a half-connected cluster. A daemon dying
before the cluster is ready ends the start with an error naming it, and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import aiohttp
import pytest

from pddnet.cluster.launcher import ClusterStartError, read_run_file
from pddnet.cluster.local import LocalCluster
from pddnet.kv.shm import segments_of
from tests.chaos.harness import link_chaos, mixed_workload, run_case, when_phase
from tests.polling import wait_for

pytestmark = [pytest.mark.asyncio(loop_scope="session"), pytest.mark.timeout(170)]

# Short WAN-path timeouts, so that a 5 s partition outlasts all of them: the heartbeat deadline
# (1.5 s: P, RLD and the router give MD up) and the KV transfer deadline (3 s). The router's
# stall timer (30 s) stays: no request may need it.
SHORT_TIMEOUTS = {
    "wan.heartbeat_s": 0.5,
    "wan.heartbeat_deadline_s": 1.5,
    "transport.deadline_s": 3.0,
    "policy.pipeline": "p_rld_md",
}
CLUSTER = {"mode": "pdd", "wan": "proxy", "rtt_ms": 30.0, "jitter_ms": 1.0, "bw_mbit": 8.0}


async def test_partition_longer_than_every_timeout_then_heal(chaos_clusters):
    cluster = await chaos_clusters.get(
        "pdd-proxy-short-timeouts", **CLUSTER, overrides=SHORT_TIMEOUTS
    )
    fault = link_chaos("partition", when_phase("main_decode", ("receiving_kv",)), duration=5.0)
    bodies = mixed_workload(6, 31, max_tokens=(8, 120), first_prompt=900)
    result = await run_case(
        cluster, "partition 5 s (> heartbeat and transfer deadlines)", bodies, fault, seed=31
    )
    broken = bool(result.broken())
    await chaos_clusters.drop("pdd-proxy-short-timeouts", keep_logs=broken)
    result.assert_invariants(logs=cluster.run_dir / "logs")
    # It really outlasted them: the cut-off was seen (lanes lost), and it healed without the
    # router's last resort.
    assert result.peer_losses, "the partition was never noticed"
    assert result.stall_replays == 0


async def _run_file(cluster: LocalCluster) -> dict | None:
    """The run file once written (None before: it is being written while the cluster starts)."""
    try:
        return read_run_file(cluster.run_dir)
    except (FileNotFoundError, ValueError):
        return None


async def test_partition_during_the_readiness_window_delays_ready_until_healed(tmp_path):
    cluster = LocalCluster(
        **CLUSTER,
        run_dir=tmp_path / "run",
        overrides={"wan.heartbeat_s": 0.5, "wan.heartbeat_deadline_s": 1.5},
    )
    start = asyncio.create_task(cluster.__aenter__())
    try:
        # The WAN is up before any daemon dials it: cut it as soon as its control API is known.
        info = await wait_for(
            lambda: _run_file(cluster), 60, "the run file (state starting)", step=0.02
        )
        url = info["wan"]["control_url"]
        from emulation.control import ControlClient

        await ControlClient(url).chaos("partition", 4.0)
        cut_at = time.monotonic()
        await asyncio.wait_for(start, 120)
        ready_at = time.monotonic()
        # not ready while P and RLD could not reach MD: only after the partition healed
        assert ready_at - cut_at >= 4.0 - 0.1, f"ready {ready_at - cut_at:.2f} s after the cut"
        async with aiohttp.ClientSession() as http:
            async with http.get(cluster.url + "/health") as r:
                health = await r.json()
            assert r.status == 200 and health["waiting_for"] == [], health
            body = {
                "model": "tiny",
                "prompt": [256, 5, 6, 7],
                "max_tokens": 4,
                "temperature": 0,
                "return_token_ids": True,
            }
            async with http.post(cluster.url + "/v1/completions", json=body) as r:
                answer = await r.json()
        assert r.status == 200, answer
        reason = answer["pdd"]["pipeline_decision"]["reason"]
        assert "unreachable" not in reason and "configured" not in reason, reason
    finally:
        if not start.done():
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
        else:
            await cluster.__aexit__(None, None, None)


async def test_a_daemon_dying_in_the_readiness_window_fails_the_start_cleanly(tmp_path):
    cluster = LocalCluster(**CLUSTER, run_dir=tmp_path / "run", keep_run_dir=True)
    start = asyncio.create_task(cluster.__aenter__())
    victim = None
    try:

        async def md_spawned():
            info = await _run_file(cluster)
            pids = {d["role"]: d["pid"] for d in (info or {}).get("daemons", [])}
            return pids.get("main_decode")

        victim = await wait_for(md_spawned, 60, "MD's pid in the run file", step=0.02)
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(ClusterStartError, match="main_decode"):
            await asyncio.wait_for(start, 120)
    finally:
        if not start.done():
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
    info = await _run_file(cluster)
    pids = [d["pid"] for d in info["daemons"]]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"daemon {pid} outlived the failed start"
    assert not segments_of(pids), "a shared-memory segment outlived the failed start"
