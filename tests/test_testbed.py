"""The testbed's lifecycle: up/down leaves the machine as it was (also after crashes), several
testbeds coexist, processes run inside the namespaces, process faults work."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys

import pytest
from conftest import root_netns_missing_reason

from emulation import netns
from emulation.probes import UdpEcho, udp_rtts
from emulation.testbed import Testbed, find_emulators, load_state, status_processes, teardown
from tests.link_measurement import assert_measured
from tests.polling import wait_for, wait_for_sync
from tests.run_module import run_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
root = pytest.mark.skipif(
    root_netns_missing_reason() is not None, reason=str(root_netns_missing_reason())
)


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    d = tmp_path / "state"
    monkeypatch.setenv("PDD_STATE_DIR", str(d))
    return str(d)


def host_links() -> list[str]:
    # The host namespace's interfaces. Whole, although other test processes (pytest-xdist
    # workers) run testbeds at the same time: every link of the project is made inside a
    # namespace (TUN devices, the veth pair), never in the host's, so this list stays put.
    return sorted(os.listdir("/sys/class/net"))


def machine(name: str, state_dir: str) -> dict:
    """What testbed `name` could leave behind: its namespaces, host links, its processes, state.
    Only its own namespaces (`name`-a, -b, adopted `name`-h): other test processes make theirs."""
    return {
        "netns": [n for n in netns.list_netns() if n.startswith(f"{name}-")],
        "links": host_links(),
        "procs": status_processes(name),
        "emulators": find_emulators(name),
        "state": sorted(os.listdir(state_dir)) if os.path.isdir(state_dir) else [],
    }


def cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return run_module("emulation.testbed_cli", *args, cwd=ROOT, timeout=timeout)


def test_bad_arguments_are_rejected_before_anything_is_made():
    with pytest.raises(ValueError, match="bad testbed name"):
        Testbed(name="no/slash")
    with pytest.raises(ValueError, match="unknown shell"):
        Testbed(name="t", shell="tcp")
    with pytest.raises(ValueError, match="bad MTU"):
        Testbed(name="t", mtu=70000)
    with pytest.raises(ValueError, match="loss_pct"):
        Testbed(name="t", loss_pct=120)
    with pytest.raises(ValueError, match="tcp_rto_min_ms"):
        Testbed(name="t", tcp_rto_min_ms=0)


@root
def test_cli_up_status_exec_down_leaves_the_machine_as_before(state_dir):
    name = "pddtt-cli"
    before = machine(name, state_dir)
    up = cli("up", "--name", name, "--rtt-ms", "20", "--shell", "packet", "--tcp-rto-min-ms", "450")
    try:
        assert up.returncode == 0, up.stderr
        assert netns.exists(f"{name}-a") and netns.exists(f"{name}-b")
        for side in "ab":
            assert netns.read_sysctl(f"{name}-{side}", "net.ipv4.tcp_rto_min_us") == "450000"
        ex = cli(
            "exec",
            "--name",
            name,
            "b",
            "--",
            sys.executable,
            "-c",
            "import socket; s = socket.socket(); s.bind(('10.77.0.2', 0)); print('bound')",
        )
        assert ex.returncode == 0 and ex.stdout.strip() == "bound", ex.stderr
        st = cli("status", "--name", name)
        assert st.returncode == 0, st.stdout + st.stderr
        assert "a_to_b: delay 10.0 ms" in st.stdout and "emulator" in st.stdout
        assert cli("up", "--name", name).returncode == 1  # refuses to make it twice
    finally:
        down = cli("down", "--name", name)
    assert down.returncode == 0, down.stderr
    assert machine(name, state_dir) == before
    assert cli("status", "--name", name).returncode == 1


@root
def test_down_cleans_up_after_the_emulator_was_killed(state_dir):
    name = "pddtt-crash"
    before = machine(name, state_dir)
    assert cli("up", "--name", name, "--shell", "packet").returncode == 0
    sleeper = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "emulation.testbed_cli",
            "exec",
            "--name",
            name,
            "a",
            "--",
            "sleep",
            "60",
        ],
        cwd=ROOT,
    )
    try:
        state = load_state(name, state_dir)
        wait_for_sync(
            lambda: sleeper.pid in netns.pids_in(f"{name}-a"), 10, "the sleeper in a", step=0.02
        )
        os.kill(state["emulator"]["pid"], signal.SIGKILL)
        wait_for_sync(lambda: not find_emulators(name), 10, "the emulator to die")
        assert cli("status", "--name", name).returncode == 1  # reported as broken
    finally:
        report = teardown(name, state_dir)
        sleeper.wait(timeout=10)
    assert sleeper.pid in report["processes"]
    assert machine(name, state_dir) == before


@root
async def test_down_finds_leftovers_by_name_without_a_state_file(state_dir):
    name = "pddtt-nostate"
    before = machine(name, state_dir)
    tb = Testbed(name=name, shell="packet")
    await tb.start()
    tb.detach()
    os.unlink(os.path.join(state_dir, f"testbed-{name}.json"))  # as if it was never written
    report = teardown(name, state_dir)
    assert report["emulators"] == [tb.emulator_pid]
    assert sorted(report["namespaces"]) == [f"{name}-a", f"{name}-b"]
    await wait_for(
        lambda: machine(name, state_dir) == before,
        5,
        lambda: f"the machine as before, still {machine(name, state_dir)}",
    )
    os.waitpid(tb.emulator_pid, 0)  # our child: reap it


@root
async def test_an_exception_inside_the_block_still_removes_everything(state_dir):
    name = "pddtt-exc"
    before = machine(name, state_dir)
    with pytest.raises(RuntimeError, match="boom"):
        async with Testbed(name=name, shell="packet") as tb:
            proc = tb.exec("b", ["sleep", "60"])
            raise RuntimeError("boom")
    assert proc.poll() is not None
    assert machine(name, state_dir) == before


OWNER = """
import asyncio, sys
from emulation import netns
from emulation.testbed import Testbed

async def main():
    tb = Testbed(name=sys.argv[1], shell="packet", die_with_parent=True)
    await tb.start()
    tb.adopt_namespace(sys.argv[1] + "-h")   # as a LocalCluster's one-namespace-per-host does
    netns.create(sys.argv[1] + "-h")
    print(tb.emulator_pid, flush=True)
    await asyncio.sleep(60)  # alive until the test kills it

asyncio.run(main())
"""


@root
async def test_a_killed_owner_takes_its_emulator_along_and_the_next_start_reaps_the_rest(state_dir):
    name = "pddtt-owner"
    before, next_before = machine(name, state_dir), machine("pddtt-next", state_dir)
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, name], cwd=ROOT, stdout=subprocess.PIPE, text=True
    )
    try:
        emulator = int(owner.stdout.readline())
        owner.kill()  # no cleanup runs in the owner
        owner.wait(timeout=10)
        # PR_SET_PDEATHSIG: the emulator goes with its owner.
        await wait_for(lambda: not find_emulators(name), 10, f"emulator {emulator} to go too")
        assert netns.exists(f"{name}-h") and load_state(name, state_dir) is not None
        # Starting any testbed removes the dead owner's: namespaces, adopted ones, state.
        async with Testbed(name="pddtt-next", shell="packet", die_with_parent=True):
            assert not netns.exists(f"{name}-a") and not netns.exists(f"{name}-h")
            assert load_state(name, state_dir) is None
    finally:
        if owner.poll() is None:
            owner.kill()
        teardown(name, state_dir)
    assert machine(name, state_dir) == before
    assert machine("pddtt-next", state_dir) == next_before


async def median_rtt(tb: Testbed, port: int) -> float:
    server = tb.socket("b", socket.AF_INET, socket.SOCK_DGRAM)
    server.bind((tb.addr_b, port))
    client = tb.socket("a", socket.AF_INET, socket.SOCK_DGRAM)
    echo = UdpEcho(server)
    try:
        got = await asyncio.to_thread(udp_rtts, client, (tb.addr_b, port), 30, 0.002)
    finally:
        echo.stop()
        server.close()
        client.close()
    assert None not in got
    return sorted(got)[len(got) // 2]


@root
@pytest.mark.link_measurement
async def test_two_testbeds_with_the_same_addresses_coexist(state_dir):
    async with (
        Testbed(name="pddtt-one", rtt_ms=20, shell="packet") as one,
        Testbed(name="pddtt-two", rtt_ms=2, shell="packet") as two,
    ):
        assert one.addr_b == two.addr_b and one.control_url != two.control_url
        r1, r2 = await median_rtt(one, 7100), await median_rtt(two, 7100)
        assert_measured(r1, 20, 22, "RTT median on one (ms)")
        assert_measured(r2, 2, 4, "RTT median on two (ms)")
        await two.link.set(delay_ms=5)  # changing one leaves the other alone
        r1, r2 = await median_rtt(one, 7101), await median_rtt(two, 7101)
        assert_measured(r1, 20, 22, "RTT median on one after two changed (ms)")
        assert_measured(r2, 10, 12, "RTT median on two after its change (ms)")


ECHO_SERVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], int(sys.argv[2])))
print("ready", flush=True)
while True:
    data, peer = s.recvfrom(2048)
    s.sendto(data, peer)
"""


@root
async def test_process_faults_hang_then_resume_and_kill(state_dir):
    async with Testbed(name="pddtt-faults", shell="packet") as tb:
        server = tb.exec(
            "b",
            [sys.executable, "-c", ECHO_SERVER, tb.addr_b, "7200"],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert (await asyncio.to_thread(server.stdout.readline)).strip() == "ready"
        client = tb.socket("a", socket.AF_INET, socket.SOCK_DGRAM)
        dst = (tb.addr_b, 7200)
        assert None not in await asyncio.to_thread(udp_rtts, client, dst, 5, 0.01)

        hang = tb.faults.hang(server.pid, 1.0)
        hung = await asyncio.to_thread(udp_rtts, client, dst, 3, 0.0, 0.2)
        assert hung == [None, None, None]  # a stopped process answers nothing
        await hang.wait()
        assert None not in await asyncio.to_thread(udp_rtts, client, dst, 5, 0.01)

        with pytest.raises(ValueError, match="not started by"):
            tb.faults.kill(os.getpid())
        tb.faults.kill(server.pid)
        assert await asyncio.to_thread(server.wait, 5) == -signal.SIGKILL
        client.close()


def _tcp_rto_us(sock: socket.socket) -> int:
    # struct tcp_info: seven u8 fields and a byte of bitfields, then tcpi_rto (u32, us)
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    return int.from_bytes(info[8:12], sys.byteorder)


@root
async def test_tcp_in_the_namespaces_takes_the_testbeds_minimum_rto(state_dir):
    """A dilated cluster's testbed makes TCP's minimum RTO k x the kernel's in its namespaces
    and in one its owner adds: a connection across it runs with an RTO of at least that (on a
    line of ~0 ms, where the kernel's own would give ~200 ms); namespaces not of the testbed
    keep the kernel's."""
    extra = f"pddtt-rto-h{os.getpid()}"
    async with Testbed(name="pddtt-rto", shell="packet", tcp_rto_min_ms=550) as tb:
        netns.create(extra)
        try:
            tb.configure_tcp(extra)
            for ns in (tb.ns("a"), tb.ns("b"), extra):
                assert netns.read_sysctl(ns, "net.ipv4.tcp_rto_min_us") == "550000"
            server = netns.socket_in(tb.ns("b"))
            client = netns.socket_in(tb.ns("a"))
            with server, client:
                server.bind((tb.addr_b, 0))
                server.listen(1)
                client.settimeout(10)
                client.connect(server.getsockname())
                peer, _ = server.accept()
                with peer:
                    for _ in range(5):  # a few round trips for the RTT estimate
                        client.sendall(b"x" * 100)
                        peer.recv(100)
                        peer.sendall(b"y")
                        client.recv(1)
                    assert _tcp_rto_us(client) >= 550_000
                    assert _tcp_rto_us(peer) >= 550_000
        finally:
            netns.delete(extra)
    plain = f"pddtt-rto-p{os.getpid()}"
    netns.create(plain)
    try:
        assert netns.read_sysctl(plain, "net.ipv4.tcp_rto_min_us") != "550000"
    finally:
        netns.delete(plain)
