"""The kernel shell: netem detection, the effects -> qdisc mapping, the veth pair, and (where
the kernel has sch_netem) the shell end to end."""

from __future__ import annotations

import asyncio
import os
import socket
import statistics

import pytest
from conftest import root_netns_missing_reason

from emulation import kernel_shell, netns
from emulation.effects import DEFAULT_EFFECTS
from emulation.probes import UdpEcho, udp_rtts
from tests.link_measurement import assert_measured

root = pytest.mark.skipif(
    root_netns_missing_reason() is not None, reason=str(root_netns_missing_reason())
)


def effects(**changes):
    fx = dict(DEFAULT_EFFECTS)
    fx.update(changes)
    return fx


def test_effects_map_to_netem_and_tbf():
    netem, tbf = kernel_shell.qdisc_params(
        effects(delay_ms=15, jitter_ms=2, jitter_dist="uniform", loss_pct=1.5, duplicate_pct=0.5)
    )
    assert netem["delay"] == 15_000 and netem["jitter"] == 2_000  # microseconds
    assert netem["loss"] == 1.5 and netem["duplicate"] == 0.5
    assert tbf is None  # no rate limit: no tbf
    _, tbf = kernel_shell.qdisc_params(effects(rate_mbit=200, queue_bytes=100_000), mtu=1500)
    assert tbf == {"rate": 25_000_000, "burst": 15_000, "limit": 100_000}
    netem, _ = kernel_shell.qdisc_params(effects(partition=True))
    assert netem["loss"] == 100.0


def test_effects_netem_cannot_express_are_refused_with_a_reason():
    with pytest.raises(ValueError, match="uniform jitter only"):
        kernel_shell.qdisc_params(effects(jitter_ms=5, jitter_dist="normal"))
    with pytest.raises(ValueError, match="reorder_pct.*packet shell"):
        kernel_shell.qdisc_params(effects(reorder_pct=10))


@root
def test_netem_detection_gives_a_cached_answer_with_a_reason():
    reason = kernel_shell.netem_unavailable_reason()
    assert reason is None or "netem" in reason
    assert kernel_shell.netem_unavailable_reason() is reason  # probed once
    # the probe's scratch namespace (pddprobe-<this pid>) is gone; another test process may be
    # probing with its own at this moment
    assert not netns.exists(f"pddprobe-{os.getpid()}")


@pytest.fixture
def pair():
    names = (f"pddtk-{os.getpid()}-a", f"pddtk-{os.getpid()}-b")
    for n in names:
        netns.create(n)
    try:
        yield names
    finally:
        for n in names:
            netns.kill_all_in(n)
            netns.delete(n)


@root
def test_veth_pair_joins_the_namespaces_without_touching_the_host(pair):
    # A name of this process's own: the host's other links may come and go with other test
    # processes, so the check is that this pair's name never shows up among them.
    ifname = f"pddtk{os.getpid()}"
    assert ifname not in os.listdir("/sys/class/net")
    kernel_shell.create_veth(pair[0], pair[1], "10.77.0.1", "10.77.0.2", mtu=9000, ifname=ifname)
    assert ifname not in os.listdir("/sys/class/net")
    server = netns.socket_in(pair[1], socket.AF_INET, socket.SOCK_DGRAM)
    server.bind(("10.77.0.2", 7300))
    client = netns.socket_in(pair[0], socket.AF_INET, socket.SOCK_DGRAM)
    echo = UdpEcho(server)
    try:
        got = udp_rtts(client, ("10.77.0.2", 7300), 10, 0.0)
    finally:
        echo.stop()
        server.close()
        client.close()
    assert None not in got


@root
@pytest.mark.link_measurement
async def test_kernel_shell_delay_and_rate(tmp_path, monkeypatch):
    reason = kernel_shell.netem_unavailable_reason()
    if reason is not None:
        pytest.skip(f"kernel shell: {reason}")
    from emulation.testbed import Testbed

    monkeypatch.setenv("PDD_STATE_DIR", str(tmp_path))
    async with Testbed(name="pddtk-e2e", rtt_ms=30, shell="kernel") as tb:
        server = tb.socket("b", socket.AF_INET, socket.SOCK_DGRAM)
        server.bind((tb.addr_b, 7301))
        client = tb.socket("a", socket.AF_INET, socket.SOCK_DGRAM)
        echo = UdpEcho(server)
        try:
            got = await asyncio.to_thread(udp_rtts, client, (tb.addr_b, 7301), 50, 0.005)
            assert_measured(statistics.median(got), 30.0 - 1.0, 30.0 + 1.0, "RTT median (ms)")
            await tb.link.set(delay_ms=25)  # runtime change reaches the qdiscs
            got = await asyncio.to_thread(udp_rtts, client, (tb.addr_b, 7301), 20, 0.005)
            median = statistics.median(got)
            assert_measured(median, 50.0 - 1.0, 50.0 + 1.0, "RTT median after the change (ms)")
        finally:
            echo.stop()
            server.close()
            client.close()
