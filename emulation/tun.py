"""TUN devices inside a network namespace: open, then configure through pyroute2 (no `ip`).

The device is created by TUNSETIFF on an fd opened *inside* the namespace (in a helper thread,
see netns.run_in_netns), so it lives there; the fd itself can then be read and written from
anywhere. The device is not persistent: it disappears when the last fd on it is closed, which
is why a crashed emulator never leaves a TUN device behind.

Addressing is point-to-point: `local` on this side, `peer` on the other, /32 each
(`ip addr add LOCAL peer PEER dev IF`), which gives the kernel a route to the peer over the
device and nothing else.
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from emulation import netns

TUNSETIFF = 0x400454CA
IFF_TUN = 0x0001
IFF_NO_PI = 0x1000
IFNAMSIZ = 16
MIN_MTU = 68
MAX_TUN_MTU = 65535
DEFAULT_TXQUEUELEN = 10000  # the TUN's ring toward the reader; deep so bursts are not dropped


@dataclass(frozen=True)
class TunConfig:
    ifname: str
    local: str
    peer: str
    mtu: int = 9000
    txqueuelen: int = DEFAULT_TXQUEUELEN
    routes: Sequence[str] = field(default_factory=tuple)  # extra CIDRs routed via the device

    def __post_init__(self) -> None:
        check_ifname(self.ifname)
        check_mtu(self.mtu)
        a, b = check_ipv4(self.local, "local"), check_ipv4(self.peer, "peer")
        if a == b:
            raise ValueError(f"local and peer address must differ (both {self.local})")
        for cidr in self.routes:
            try:
                ipaddress.IPv4Network(cidr, strict=False)
            except ValueError as exc:
                raise ValueError(f"bad route {cidr!r}: {exc}") from None


def check_ifname(name: str) -> str:
    if not name or len(name.encode()) >= IFNAMSIZ or "/" in name or any(c.isspace() for c in name):
        raise ValueError(f"bad interface name {name!r}: 1-15 characters, no '/' or spaces")
    return name


def check_mtu(mtu: int) -> int:
    if not isinstance(mtu, int) or not MIN_MTU <= mtu <= MAX_TUN_MTU:
        raise ValueError(f"bad MTU {mtu!r}: must be an integer in {MIN_MTU}..{MAX_TUN_MTU}")
    return mtu


def check_ipv4(addr: str, what: str = "address") -> ipaddress.IPv4Address:
    try:
        return ipaddress.IPv4Address(addr)
    except ValueError:
        raise ValueError(f"bad {what} {addr!r}: need an IPv4 address like 10.77.0.1") from None


def open_tun(ifname: str) -> int:
    """Create TUN device `ifname` (IFF_TUN|IFF_NO_PI: raw IP packets, no header) in the calling
    thread's namespace; returns a non-blocking fd."""
    check_ifname(ifname)
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        ifr = struct.pack("16sH22x", ifname.encode(), IFF_TUN | IFF_NO_PI)
        fcntl.ioctl(fd, TUNSETIFF, ifr)
    except BaseException:
        os.close(fd)
        raise
    return fd


def configure(cfg: TunConfig) -> None:
    """Bring the device up with its MTU, queue length, point-to-point address and routes
    (in the calling thread's namespace)."""
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        found = ipr.link_lookup(ifname=cfg.ifname)
        if not found:
            raise RuntimeError(f"interface {cfg.ifname!r} vanished before it was configured")
        idx = found[0]
        _disable_ipv6(cfg.ifname)
        ipr.link("set", index=idx, mtu=cfg.mtu, txqlen=cfg.txqueuelen)
        ipr.addr("add", index=idx, local=cfg.local, address=cfg.peer, prefixlen=32)
        ipr.link("set", index=idx, state="up")
        for cidr in cfg.routes:
            ipr.route("add", dst=cidr, oif=idx)


def _disable_ipv6(ifname: str) -> None:
    # The WAN is IPv4 only; without this the kernel sends IPv6 router solicitations and MLD
    # reports over it, stray packets that would show up in the link's counters. /proc/sys/net
    # is per network namespace (that of the thread opening it).
    try:
        with open(f"/proc/sys/net/ipv6/conf/{ifname}/disable_ipv6", "w") as f:
            f.write("1")
    except OSError:
        pass  # no IPv6 in this kernel: nothing to silence


def create_in_netns(ns: str, cfg: TunConfig) -> int:
    """Create and configure a TUN device inside namespace `ns`; returns its non-blocking fd.
    Closing the fd removes the device."""

    def make() -> int:
        fd = open_tun(cfg.ifname)
        try:
            configure(cfg)
        except BaseException:
            os.close(fd)
            raise
        return fd

    return netns.run_in_netns(ns, make)
