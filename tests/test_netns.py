"""Namespace and TUN plumbing: create/delete, code and exec inside, TUN devices."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from conftest import root_netns_missing_reason

from emulation import netns, tun
from tests.polling import wait_for_sync

root = pytest.mark.skipif(
    root_netns_missing_reason() is not None, reason=str(root_netns_missing_reason())
)


@pytest.fixture
def ns():
    name = f"pddtn-{os.getpid()}"
    netns.create(name)
    try:
        yield name
    finally:
        netns.kill_all_in(name)
        netns.delete(name)
    assert name not in netns.list_netns()


def links(ns_name: str) -> dict[str, dict]:
    def read() -> dict[str, dict]:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            out = {}
            for link in ipr.get_links():
                out[link.get_attr("IFLA_IFNAME")] = {
                    "up": bool(link["flags"] & 1),
                    "mtu": link.get_attr("IFLA_MTU"),
                    "addrs": [a.get_attr("IFA_LOCAL") for a in ipr.get_addr(index=link["index"])],
                }
            return out

    return netns.run_in_netns(ns_name, read)


def test_bad_names_are_rejected_with_a_reason():
    for bad in ("", "../etc", "a/b", "x" * 64, "-lead", "sp ace"):
        with pytest.raises(ValueError, match="bad network namespace name"):
            netns.netns_path(bad)
    with pytest.raises(ValueError, match="bad MTU"):
        tun.TunConfig("wan0", "10.0.0.1", "10.0.0.2", mtu=70000)
    with pytest.raises(ValueError, match="bad peer"):
        tun.TunConfig("wan0", "10.0.0.1", "nope")
    with pytest.raises(ValueError, match="must differ"):
        tun.TunConfig("wan0", "10.0.0.1", "10.0.0.1")
    with pytest.raises(ValueError, match="bad interface name"):
        tun.TunConfig("a-very-long-ifname", "10.0.0.1", "10.0.0.2")


@root
def test_create_gives_an_isolated_namespace_with_loopback_up(ns):
    assert ns in netns.list_netns()
    inside = links(ns)
    assert set(inside) == {"lo"} and inside["lo"]["up"]
    with pytest.raises(FileExistsError):
        netns.create(ns)
    # The caller's thread never moved into it.
    assert os.stat("/proc/thread-self/ns/net").st_ino != os.stat(netns.netns_path(ns)).st_ino


@root
def test_socket_in_lives_in_the_namespace(ns):
    s = netns.socket_in(ns, socket.AF_INET, socket.SOCK_DGRAM)
    with s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        # Another namespace's loopback is a different network: nothing arrives from the host.
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as host:
            host.sendto(b"x", ("127.0.0.1", port))
        s.settimeout(0.2)
        with pytest.raises(TimeoutError):
            s.recv(10)


@root
def test_exec_trampoline_keeps_the_pid_and_enters_the_namespace(ns):
    st = os.stat(netns.netns_path(ns))
    code = "import os; s = os.stat('/proc/self/ns/net'); print(os.getpid(), s.st_dev, s.st_ino)"
    proc = subprocess.Popen(
        netns.exec_argv(ns, [sys.executable, "-c", code]), stdout=subprocess.PIPE, text=True
    )
    out, _ = proc.communicate(timeout=20)
    pid, dev, ino = map(int, out.split())
    assert proc.returncode == 0
    assert pid == proc.pid
    assert (dev, ino) == (st.st_dev, st.st_ino)


@root
def test_kill_all_in_ends_the_processes_inside_and_only_those(ns):
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    inside = subprocess.Popen(
        netns.exec_argv(ns, [sys.executable, "-c", "import time; time.sleep(30)"])
    )
    try:
        wait_for_sync(lambda: inside.pid in netns.pids_in(ns), 10, "the process inside", 0.02)
        assert outside.pid not in netns.pids_in(ns)
        ended = netns.kill_all_in(ns, grace_s=0.5)
        assert ended == [inside.pid]
        assert inside.wait(timeout=5) is not None
        assert outside.poll() is None
    finally:
        outside.kill()
        outside.wait()
        inside.kill()
        inside.wait()


@root
def test_tun_device_is_configured_and_vanishes_with_its_fd(ns):
    fd = tun.create_in_netns(ns, tun.TunConfig("wan0", "10.99.0.1", "10.99.0.2", mtu=65535))
    try:
        dev = links(ns)["wan0"]
        assert dev["mtu"] == 65535 and dev["up"] and dev["addrs"] == ["10.99.0.1"]
        # A datagram to the peer is routed into the TUN device and read from the fd.
        s = netns.socket_in(ns, socket.AF_INET, socket.SOCK_DGRAM)
        with s:
            s.sendto(b"hello", ("10.99.0.2", 9))

            def udp_packet() -> bytes | None:
                try:
                    pkt = os.read(fd, 65536)
                except BlockingIOError:
                    return None
                return pkt if pkt[0] >> 4 == 4 and pkt[9] == socket.IPPROTO_UDP else None

            pkt = wait_for_sync(udp_packet, 2, "a UDP packet out of the TUN device", step=0.01)
        assert pkt[16:20] == socket.inet_aton("10.99.0.2") and pkt.endswith(b"hello")
    finally:
        os.close(fd)
    assert "wan0" not in links(ns)
