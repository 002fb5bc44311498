"""The packet shell: a userspace forwarder that carries real IP packets between two TUN devices
through the link model, so TCP runs end to end over an emulated WAN.

    namespace <name>-a                 emulator process (host namespace)              <name>-b
    app ── 10.77.0.1 wan0(TUN) ══fd══> read ─ Link.a_to_b.offer ... poll ─ write ══fd══> wan0 ── app
                                 <══fd═ write ─ ... Link.b_to_a ... ─ read <══fd══

Reads drain each TUN until EAGAIN (bounded per wake-up so the other direction is served too);
each packet is offered with its length as size; departures are written when the model says.
Wake-ups come from a timerfd armed at the model's next_wakeup() in absolute CLOCK_MONOTONIC
nanoseconds: both asyncio's and uvloop's own timers have millisecond granularity, which would
add up to a millisecond of error to every packet's delay.

Timer wake-ups on a VM arrive ~0.1 ms late; the forwarder learns that lateness, arms the timer
that much early and spins the remainder (at most MAX_LEAD_S per wake-up, and at most SPIN_SHARE of the time).

Rate shaping is the model's (token bucket + byte-limited FIFO), not the kernel's tbf/htb: that
way queueing delay and tail drops are the model's and show up in its counters.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import json
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from emulation.link import Link, earliest

CLOCK_MONOTONIC = 1
TFD_NONBLOCK = os.O_NONBLOCK
TFD_CLOEXEC = os.O_CLOEXEC
TFD_TIMER_ABSTIME = 1
PR_SET_TIMERSLACK = 29
DEFAULT_IFNAME = "wan0"
DEFAULT_MTU = 9000
READ_BATCH = 256
MAX_LEAD_S = 0.0005  # never spin longer than this per wake-up
SPIN_SHARE = 0.03  # at most this share of wall time spent spinning...
SPIN_BURST_S = 0.01  # ...with this much saved up for bursts  # packets per wake-up and direction before yielding to the other direction


def packet_dscp(pkt: bytes) -> int:
    """The DSCP an IP packet is marked with (IPv4's TOS byte, IPv6's traffic class); 0 if it is
    too short to tell."""
    if len(pkt) >= 2 and pkt[0] >> 4 == 4:
        return pkt[1] >> 2
    if len(pkt) >= 2 and pkt[0] >> 4 == 6:
        return ((pkt[0] & 0x0F) << 2) | (pkt[1] >> 6)
    return 0


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_libc = ctypes.CDLL(None, use_errno=True)


class TimerFd:
    """A one-shot CLOCK_MONOTONIC timer with nanosecond resolution that an event loop can wait
    on as a readable fd. Deadlines are time.monotonic() seconds (same clock)."""

    def __init__(self) -> None:
        fd = _libc.timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC)
        if fd < 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_create failed: {os.strerror(err)}")
        self.fd = fd
        self.deadline: float | None = None

    def arm_at(self, deadline: float | None) -> None:
        """Fire once at `deadline` (a deadline in the past fires at once); None disarms."""
        if deadline == self.deadline:
            return
        spec = _Itimerspec()
        if deadline is not None:
            ns = max(1, int(deadline * 1e9))  # 0 would disarm
            spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        if _libc.timerfd_settime(self.fd, TFD_TIMER_ABSTIME, ctypes.byref(spec), None) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"timerfd_settime failed: {os.strerror(err)}")
        self.deadline = deadline

    def ack(self) -> None:
        try:
            os.read(self.fd, 8)
        except BlockingIOError:
            pass
        self.deadline = None

    def close(self) -> None:
        os.close(self.fd)


class PacketForwarder:
    """Moves packets between TUN fds `fd_a` and `fd_b` through `link` on a running event loop."""

    def __init__(
        self,
        link: Link,
        fd_a: int,
        fd_b: int,
        clock: Callable[[], float] = time.monotonic,
        read_batch: int = READ_BATCH,
    ) -> None:
        self.link = link
        self.clock = clock
        self._fd = {"a": fd_a, "b": fd_b}
        self._routes = ((link.a_to_b, fd_b), (link.b_to_a, fd_a))
        self._batch = read_batch
        self._timer: TimerFd | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.stats = {
            "read_packets": 0,
            "written_packets": 0,
            "write_errors": 0,
            "wakeups": 0,
            "spins": 0,
        }
        self._wake_latency = 0.0  # EWMA of timer wake-up lateness (s)
        self._lead = 0.0  # wake this much before a departure and spin the rest
        self._spin_budget = SPIN_BURST_S
        self._spin_at = clock()

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._timer = TimerFd()
        self._loop.add_reader(self._fd["a"], self._on_readable, self._fd["a"], self.link.a_to_b)
        self._loop.add_reader(self._fd["b"], self._on_readable, self._fd["b"], self.link.b_to_a)
        self._loop.add_reader(self._timer.fd, self._on_timer)
        self.link.subscribe(self.kick)  # control changes can move the next departure earlier

    def stop(self) -> None:
        if self._loop is None or self._timer is None:
            return
        for fd in (self._fd["a"], self._fd["b"], self._timer.fd):
            self._loop.remove_reader(fd)
        self._timer.close()
        self._timer = None

    def kick(self) -> None:
        """Deliver what is due and re-arm: call after changing the link out of band (control API),
        since a rate change or heal can move the next departure earlier."""
        if self._timer is not None:
            self._service()

    def _on_readable(self, fd: int, direction: Any) -> None:
        now = self.clock()
        offer = direction.offer
        n = 0
        try:
            while n < self._batch:
                pkt = os.read(fd, 65536)
                offer(now, len(pkt), pkt, packet_dscp(pkt))
                n += 1
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EINTR):
                raise
        self.stats["read_packets"] += n
        self._service()

    def _on_timer(self) -> None:
        assert self._timer is not None
        armed = self._timer.deadline
        self._timer.ack()
        if armed is not None:
            # How late the kernel woke us (VM timer wake-ups take ~0.1 ms): learn it and wake
            # that much early next time, spinning the rest, so departures leave on time.
            latency = max(0.0, self.clock() - armed)
            self._wake_latency += 0.1 * (latency - self._wake_latency)
            self._lead = min(MAX_LEAD_S, 1.5 * self._wake_latency)
        self.stats["wakeups"] += 1
        self._service()

    def _service(self) -> None:
        write = os.write
        clock = self.clock
        lead = self._lead
        for _ in range(64):  # departures that fall due meanwhile are sent in the same turn
            now = clock()
            for direction, out_fd in self._routes:
                for pkt in direction.poll(now):
                    try:
                        write(out_fd, pkt)
                        self.stats["written_packets"] += 1
                    except OSError:
                        # The receiving device is down or its queue is full: the packet is lost
                        # like on a real NIC; counted here, outside the model.
                        self.stats["write_errors"] += 1
            wake = earliest(self.link.a_to_b.next_wakeup(), self.link.b_to_a.next_wakeup())
            if wake is None:
                break
            now = clock()
            ahead = wake - now
            if ahead > lead:
                break
            if ahead > 0:
                if not self._may_spin(now, ahead):
                    lead = 0.0  # out of spin budget: wake exactly at the departure instead
                    break
                self.stats["spins"] += 1
                while clock() < wake:  # bounded by the lead (<= MAX_LEAD_S)
                    pass
        assert self._timer is not None
        self._timer.arm_at(None if wake is None else wake - lead)

    def _may_spin(self, now: float, ahead: float) -> bool:
        """Spinning buys precise departures for sparse traffic (delay probes); under a steady
        packet stream it would burn a core, so it is rationed to SPIN_SHARE of the time."""
        budget = min(SPIN_BURST_S, self._spin_budget + (now - self._spin_at) * SPIN_SHARE)
        self._spin_at = now
        if budget < ahead:
            self._spin_budget = budget
            return False
        self._spin_budget = budget - ahead
        return True


# ---------------------------------------------------------------------------------------------
# The emulator process: TUN devices + forwarder + control API, until SIGTERM/SIGINT.


@dataclass(frozen=True)
class PacketShellConfig:
    ns_a: str
    ns_b: str
    addr_a: str = "10.77.0.1"
    addr_b: str = "10.77.0.2"
    mtu: int = DEFAULT_MTU
    ifname: str = DEFAULT_IFNAME
    control_host: str = "127.0.0.1"
    control_port: int = 0
    seed: int = 0


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


async def serve(
    cfg: PacketShellConfig,
    effects: dict[str, Any],
    ready_file: str | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run the packet shell until `stop` is set (or SIGTERM/SIGINT)."""
    from emulation import netns, tun
    from emulation.control import make_control_app, start_control_server

    for ns in (cfg.ns_a, cfg.ns_b):
        if not netns.exists(ns):
            raise FileNotFoundError(f"network namespace {ns!r} does not exist")
    link = Link(seed=cfg.seed, **effects)
    # Timer slack (50 us by default) delays timerfd wake-ups; ask for 1 us.
    _libc.prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    fd_a = tun.create_in_netns(cfg.ns_a, tun.TunConfig(cfg.ifname, cfg.addr_a, cfg.addr_b, cfg.mtu))
    fds = [fd_a]
    runner = None
    fwd = None
    try:
        fds.append(
            tun.create_in_netns(
                cfg.ns_b, tun.TunConfig(cfg.ifname, cfg.addr_b, cfg.addr_a, cfg.mtu)
            )
        )
        loop = asyncio.get_running_loop()
        fwd = PacketForwarder(link, fds[0], fds[1])
        fwd.start(loop)
        app = make_control_app(link, clock=time.monotonic)
        app.router.add_get("/emulator", lambda request: _emulator_info(request, fwd, cfg))
        runner, port = await start_control_server(app, cfg.control_host, cfg.control_port)
        stop = stop or asyncio.Event()
        announce(
            ready_file,
            stop,
            {
                "shell": "packet",
                "control_url": f"http://{cfg.control_host}:{port}",
                "ifname": cfg.ifname,
                "mtu": cfg.mtu,
                "addr_a": cfg.addr_a,
                "addr_b": cfg.addr_b,
            },
        )
        await stop.wait()
    finally:
        if fwd is not None:
            fwd.stop()
        if runner is not None:
            await runner.cleanup()
        for fd in fds:
            os.close(fd)  # closing the last fd removes the TUN device


async def _emulator_info(request: Any, fwd: PacketForwarder, cfg: PacketShellConfig) -> Any:
    from aiohttp import web

    return web.json_response(
        {
            "shell": "packet",
            "pid": os.getpid(),
            "ns_a": cfg.ns_a,
            "ns_b": cfg.ns_b,
            "mtu": cfg.mtu,
            "forwarder": dict(fwd.stats),
            "cpu_s": _cpu_seconds(),
        }
    )


def announce(ready_file: str | None, stop: asyncio.Event, info: dict[str, Any]) -> None:
    """An emulator process is up: SIGTERM/SIGINT set `stop`, and the ready file (if any) tells
    the parent waiting for it the pid, the control URL and the link (`info`)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if ready_file:
        write_json_atomic(ready_file, {"pid": os.getpid(), **info})


def write_json_atomic(path: str, data: dict[str, Any]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)
