"""The daemons on the Mooncake Transfer Engine: token-exact in one process (both KV paths on
mooncake, loopback), refused at start where it cannot run, and -- in the testbed, each daemon in
its own namespace -- SIGKILL / SIGSTOP of the receiving daemon while P writes into its pool:
a clean transfer error within transport.deadline_s (not the engine's 30 s default), the request
completed by the fallback path (RLD alone when MD's copy fails; the router's replay on MD when
RLD's does), and afterwards nothing left: no registered staging buffer of the lost writer, no
stuck engine call, no KV block or fenced reservation on any daemon still running.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import aiohttp
import pytest

from pddnet.cluster.local import LocalCluster
from pddnet.config import ClusterMode
from pddnet.roles.relay import RelayDaemon
from pddnet.transport.backends import mooncake_import_error
from pddnet.transport.kv_backend import BackendUnavailable
from tests.chaos.harness import reference_tokens
from tests.conftest import root_netns_missing_reason
from tests.polling import wait_for
from tests.test_cluster_e2e import post
from tests.test_roles_inprocess import all_free, make_config, run_workload, running, workload

MOONCAKE_REASON = mooncake_import_error()
ROOT_REASON = root_netns_missing_reason()
pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(MOONCAKE_REASON is not None, reason=MOONCAKE_REASON or ""),
]

DEADLINE_S = 2.0
SLACK_S = 1.5  # scheduling on a shared 2-core machine, the stats poll


@pytest.fixture(scope="module")
def tiny():
    from pddnet.model.loader import load_model

    return load_model("tiny")


async def test_in_process_token_exact_with_both_paths_on_mooncake(tiny):
    cfg = make_config(ClusterMode.PDD, "dynamic", handoff_chunk=4, handoff_threshold_tokens=12)
    cfg.transport.intra_dc = cfg.transport.wan = "mooncake"
    async with running(cfg, md_delay=0.25) as (daemons, col):
        reqs = workload(3)
        await run_workload(tiny, col, reqs)
        await all_free(daemons)
        p = daemons["prefill"].stats()["transport"]
        # An engine per path: a hung receiver on one cannot stall the other.
        assert p["intra_dc"]["session"] != p["wan"]["session"]
        assert p["wan"]["bytes_written"] > 0
        for rid in (r["request_id"] for r in reqs):
            used = {e.detail_str for e in col.timeline[rid] if e.event == "kv_transport"}
            assert used <= {"relay=mooncake", "main_decode=mooncake"} and used
        assert "main_decode" in {col.producers(r["request_id"])[-1] for r in reqs}
        md = daemons["main_decode"].stats()
        assert md["transport"]["wan"]["descriptor"].startswith("mooncake:127.0.0.1:")
        assert md["transport"]["wan"]["fenced_reservations"] == 0


async def test_a_daemon_that_cannot_advertise_its_address_fails_at_start():
    cfg = make_config(ClusterMode.PDD)
    cfg.transport.intra_dc = "mooncake"
    cfg.relay.host = "0.0.0.0"
    rld = RelayDaemon(cfg)
    with pytest.raises(BackendUnavailable, match="relay.dial"):
        await rld.start()
    assert rld.engine is None  # refused before the model was even loaded
    await rld.close()


async def test_mooncake_over_the_proxy_shell_is_refused_at_start(tmp_path):
    """The proxy forwards only MD's port: Mooncake's own connections would skip the WAN."""
    with pytest.raises(Exception, match="needs --wan packet or kernel"):
        async with LocalCluster(
            mode="pdd", wan="proxy", run_dir=tmp_path, overrides={"transport.wan": "mooncake"}
        ):
            pass


# -- faults in the testbed ----------------------------------------------------------------------

PATH = {"main_decode": "wan", "relay": "intra_dc"}


@pytest.mark.root
@pytest.mark.skipif(ROOT_REASON is not None, reason=ROOT_REASON or "")
@pytest.mark.parametrize(
    "victim,sig",
    [
        # heavy: CI covers a stopped receiver in tests/test_mooncake_backend.py (32 s here)
        pytest.param("main_decode", signal.SIGSTOP, marks=pytest.mark.heavy),
        ("relay", signal.SIGKILL),
        pytest.param("main_decode", signal.SIGKILL, marks=pytest.mark.heavy),
        pytest.param("relay", signal.SIGSTOP, marks=pytest.mark.heavy),
    ],
)
async def test_receiver_killed_or_stopped_during_a_mooncake_write(victim, sig):
    # A long prompt prefilled in small chunks: P writes it as ~150 pieces, over a 4 Mbit/s WAN
    # to MD (seconds), so the signal lands while writes are in flight on either path.
    # When MD is the victim RLD must still be decoding when pddnet's deadline fires, or P simply
    # cancels the WAN copy and there is no transfer error to see: 2400 tokens keep a fast CI
    # machine's RLD (~2 ms/token) busy for ~5 s, past DEADLINE_S + SLACK_S (400 were not enough
    # there). When RLD is the victim the fault lands on its first write, so 400 suffice.
    max_tokens = 2400 if victim == "main_decode" else 400
    body = {
        "prompt": [256] + [(7 * i) % 256 for i in range(1199)],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    want = reference_tokens(body)
    overrides = {
        "transport.intra_dc": "mooncake",
        "transport.wan": "mooncake",
        "transport.deadline_s": DEADLINE_S,
        "transport.progress_timeout_s": 1,
        "policy.pipeline": "p_rld_md",
        "prefill.max_num_batched_tokens": 8,
        # heartbeats would find the victim too; the transfer deadline must be first
        "wan.heartbeat_s": 1.0,
        "wan.heartbeat_deadline_s": 10.0,
    }
    async with LocalCluster(
        mode="pdd", wan="packet", placement="hosts", rtt_ms=20.0, bw_mbit=4.0, overrides=overrides
    ) as cluster:
        pid = cluster.daemons[victim].pid
        path = PATH[victim]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=90)) as session:
            task = asyncio.create_task(post(session, cluster.url, body))

            async def writing():
                st = await cluster.stats("prefill")
                return st["counters"].get(f"kv_bytes_{path}", 0) > 0 or task.done()

            await wait_for(writing, 30, f"P's first write to {victim}", step=0.01)
            assert not task.done(), "the request ended before the fault"
            os.kill(pid, sig)
            signalled = time.time()
            try:
                res = await task
            finally:
                if sig == signal.SIGSTOP:
                    os.kill(pid, signal.SIGCONT)
        got = res["choices"][0]["token_ids"]
        assert got == want, res["pdd"]
        pdd = res["pdd"]
        failed = [e for e in pdd["timeline"] if e["event"] == "kv_transfer_failed"]
        lost = [
            e for e in pdd["timeline"] if e["event"] == "error" and "relay_lost" in str(e["detail"])
        ]
        if sig == signal.SIGKILL and victim == "relay" and not failed:
            # A killed RLD's sockets close at once: P may hear it on the control connection
            # before a write to it fails. The same fault, caught sooner (seen once in CI on a
            # loaded box); the replay and the clean-up below are checked all the same.
            assert lost, f"neither a transfer error nor relay_lost in {pdd['timeline']}"
            caught = lost
        else:
            assert failed, f"no transfer error in {pdd['timeline']}"
            caught = failed
        # A clean error within pddnet's deadline of the fault
        assert caught[0]["time"] - signalled <= DEADLINE_S + SLACK_S, caught
        if sig == signal.SIGSTOP:
            assert (
                "TransferTimeout" in failed[0]["detail"] or "PeerUnreachable" in failed[0]["detail"]
            ), failed
        # The fallback path: RLD alone when MD's copy failed, the router's replay otherwise.
        if victim == "main_decode":
            assert pdd["pipeline"] == "p_rld" and pdd["main_tokens"] == 0, pdd
        else:
            assert pdd["replays"] == 1 and pdd["main_tokens"] > 0, pdd

        # Nothing left: P's writer to the victim is closed and deregistered, nothing is stuck,
        # every block is free on every daemon still running (fences released).
        alive = [
            r
            for r in ("prefill", "relay", "main_decode")
            if not (sig == signal.SIGKILL and r == victim)
        ]

        async def clean():
            stats = {r: await cluster.stats(r) for r in alive}
            p_path = stats["prefill"]["transport"][path]
            ok = (
                p_path["stuck_writers"] == 0
                and p_path["releases_pending"] == 0
                and p_path["registered_buffers"] == p_path["writers"]
                and all(
                    s["kv_blocks"]["used"] == 0 and s["requests"]["active"] == 0
                    for s in stats.values()
                )
            )
            for r in ("relay", "main_decode"):
                if r in stats:
                    t = stats[r]["transport"][PATH[r]]
                    ok = ok and t["fenced_reservations"] == 0 and t["registered_buffers"] == 1
            return stats if ok else None

        stats = await wait_for(clean, 20, "the cluster to hold nothing of the request", step=0.3)
        if failed:
            assert stats["prefill"]["counters"][f"transfer_errors_{path}"] >= 1
    report = cluster.stop_report
    assert not report.leftover_shm
    # P, RLD and MD stop cleanly (the killed one aside); the router is only required to be gone:
    # under load it sometimes outlives the launcher's grace after a fault (a known rough spot,
    # see the session notes), which is not what this test is about.
    codes = report.exit_codes
    assert all(
        codes[r] == 0
        for r in ("prefill", "relay", "main_decode")
        if not (sig == signal.SIGKILL and r == victim)
    ), codes
    assert all(code is not None for code in codes.values()), codes  # nothing left running
