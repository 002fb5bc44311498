"""pddnet across "hosts": every daemon started with `pdd serve` in a network namespace of its own
(router, P, RLD on datacenter A's LAN, MD on B's; only A <-> B traffic crosses the emulated WAN),
token-exact against the colocated engine on each KV backend of each path.

The workload mixes prompt and output lengths, greedy and seeded sampling, and all three handoff
modes per request (the `handoff_mode` extension), so one cluster run covers them all. The run
file and every completion's timeline name the backend each path used.
"""

from __future__ import annotations

import json

import pytest

from emulation import netns
from emulation.control import ControlClient
from pddnet.cluster.local import LocalCluster
from pddnet.transport.backends import mooncake_import_error
from tests.chaos.harness import precompute_references
from tests.conftest import root_netns_missing_reason
from tests.test_cluster_e2e import assert_token_exact, make_requests, run_all

ROOT_REASON = root_netns_missing_reason()
MOONCAKE_REASON = mooncake_import_error()
WAN = {"rtt_ms": 20.0, "jitter_ms": 1.0, "bw_mbit": 40.0}
HANDOFFS = ("one-shot", "streaming", "dynamic")

pytestmark = [
    pytest.mark.root,
    pytest.mark.timeout(240),
    pytest.mark.skipif(ROOT_REASON is not None, reason=ROOT_REASON or ""),
]


def needs_mooncake():
    return pytest.mark.skipif(MOONCAKE_REASON is not None, reason=MOONCAKE_REASON or "")


def workload(n: int, seed: int) -> list[dict]:
    bodies = make_requests(n, seed=seed)
    for i, b in enumerate(bodies):
        b["handoff_mode"] = HANDOFFS[i % 3]
    return bodies


async def wan_bytes(control_url: str) -> int:
    """Bytes the emulated link carried A -> B so far."""
    link = await ControlClient(control_url, timeout=5.0).show()
    return int(link["a_to_b"]["counters"]["bytes_out"])


@pytest.mark.parametrize(
    "intra_dc,wan",
    [
        pytest.param("mooncake", "mooncake", marks=needs_mooncake()),
        pytest.param("mooncake", "tcp", marks=[needs_mooncake(), pytest.mark.heavy]),
        pytest.param("shm", "mooncake", marks=[needs_mooncake(), pytest.mark.heavy]),
    ],
)
async def test_token_exact_with_each_daemon_on_its_own_host(intra_dc, wan):
    bodies = workload(18, seed=11)
    precompute_references(bodies)  # before the cluster takes the cores
    overrides = {
        "transport.intra_dc": intra_dc,
        "transport.wan": wan,
        "policy.pipeline": "p_rld_md",
    }
    async with LocalCluster(
        mode="pdd", wan="packet", placement="hosts", overrides=overrides, **WAN
    ) as cluster:
        info = json.loads(cluster.run_file.read_text())
        assert info["transport"] == {"intra_dc": intra_dc, "wan": wan}
        daemons = {d["role"]: d for d in info["daemons"]}
        spaces = {d["namespace"] for d in daemons.values()}
        assert len(spaces) == 4 and all(netns.exists(ns) for ns in spaces)
        assert daemons["main_decode"]["address"].startswith("10.78.2.")
        assert all(
            daemons[r]["address"].startswith("10.78.1.") for r in ("router", "prefill", "relay")
        )
        before = await wan_bytes(cluster.wan["control_url"])

        results = await run_all(cluster.url, [{k: v for k, v in b.items()} for b in bodies])

        for b in bodies:
            b.pop("handoff_mode")
        assert_token_exact(bodies, results)
        pdds = [r["pdd"] for r in results]
        modes = {p["handoff_mode"] for p in pdds if p["main_tokens"] > 0}
        assert {"one-shot", "streaming"} <= modes, modes
        # Every completion names the backend each path used.
        for p in pdds:
            used = {e["detail"] for e in p["timeline"] if e["event"] == "kv_transport"}
            assert used <= {f"relay={intra_dc}", f"main_decode={wan}"}, used
        assert any(
            f"main_decode={wan}" == e["detail"]
            for p in pdds
            for e in p["timeline"]
            if e["event"] == "kv_transport"
        )
        # MD's copies crossed the emulated WAN (whichever backend carried them).
        p_stats = await cluster.stats("prefill")
        sent_to_md = p_stats["counters"]["kv_bytes_wan"]  # payload, whichever backend
        assert sent_to_md > 0 and p_stats["counters"]["kv_bytes_intra_dc"] > 0
        assert await wan_bytes(cluster.wan["control_url"]) - before >= sent_to_md
        for role in ("relay", "main_decode"):
            st = await cluster.stats(role)
            path = "intra_dc" if role == "relay" else "wan"
            assert st["transport"][path]["backend"] == (intra_dc if role == "relay" else wan)
    codes = cluster.stop_report.exit_codes
    assert all(codes[r] == 0 for r in ("prefill", "relay", "main_decode")), codes
    assert all(code is not None for code in codes.values()), codes  # nothing left running
    assert not cluster.stop_report.leftover_shm
    assert not [ns for ns in spaces if netns.exists(ns)]
