"""Choosing and running the WAN between datacenter A and datacenter B for `pdd up`.

`--wan auto` takes, in order: the kernel shell (netem qdiscs on a veth pair between the testbed's
two namespaces) where the kernel has sch_netem; else the packet shell (TUN devices between the
testbed's namespaces, real TCP end to end) when root and /dev/net/tun are there; else the proxy
shell (a TCP proxy on loopback in front of MD). `choose_wan` says which and why.

A `Placement` then tells the launcher where each daemon runs and how peers reach MD:
- proxy: everything on loopback; MD's `dial` address is the proxy, which forwards to MD.
- packet / kernel: MD runs in namespace B and listens on the testbed's B address; router, P and
  RLD run in namespace A and dial MD there, so every MD byte crosses the emulated link. The
  router's HTTP port is forwarded from the host's loopback into namespace A, so users and tests
  reach it at 127.0.0.1 as usual.
- hosts (`pdd up --placement hosts`, packet / kernel shell): one namespace per daemon, as on
  separate machines. The testbed's A and B namespaces become the two datacenters' gateways;
  each daemon's "host" namespace hangs off its datacenter's LAN (a bridge in the gateway:
  10.78.1.0/24 in A for router, P, RLD; 10.78.2.0/24 in B for MD), and the gateways route the
  other datacenter's LAN over the emulated WAN. Every daemon listens on and is dialled at its own
  host address, like `pdd serve` on real hosts (docs/deploy.md); only MD's traffic crosses the WAN.
- none (same-dc): no WAN at all, everything on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from emulation.lifetime import die_with_parent
from pddnet.cluster import forkserver
from pddnet.config import ClusterConfig, ClusterMode, WanSection
from pddnet.device.dilation import tcp_rto_min_ms, wallclock

WAN_CHOICES = ("auto", "kernel", "packet", "proxy")
PLACEMENTS = ("datacenter", "hosts")  # daemons share their datacenter's namespace | one each
LOOPBACK = "127.0.0.1"
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WanUnavailable(RuntimeError):
    """The requested WAN shell cannot run on this machine."""


@dataclass(frozen=True)
class WanChoice:
    shell: str  # kernel | packet | proxy | none
    reason: str


def _testbed_reason() -> str | None:
    from emulation.testbed import unavailable_reason

    return unavailable_reason()


def _netem_reason() -> str | None:
    if _testbed_reason() is not None:
        return _testbed_reason()
    from emulation.kernel_shell import netem_unavailable_reason

    return netem_unavailable_reason()


def choose_wan(requested: str, mode: ClusterMode) -> WanChoice:
    """Which shell carries the WAN, and why (raises WanUnavailable for an impossible request)."""
    if requested not in WAN_CHOICES:
        raise ValueError(f"--wan must be one of {', '.join(WAN_CHOICES)}, got {requested!r}")
    if mode == ClusterMode.SAME_DC:
        return WanChoice(
            "none",
            "same-dc mode: P and the decode instance share datacenter A "
            "over shared memory, there is no WAN",
        )
    if requested == "proxy":
        return WanChoice("proxy", "requested --wan proxy (TCP proxy on loopback in front of MD)")
    if requested == "packet":
        reason = _testbed_reason()
        if reason is not None:
            raise WanUnavailable(f"--wan packet is not available here: {reason}")
        return WanChoice("packet", "requested --wan packet (TUN devices between namespaces)")
    netem = _netem_reason()
    if requested == "kernel":
        if netem is not None:
            raise WanUnavailable(f"--wan kernel is not available here: {netem}")
        return WanChoice("kernel", "requested --wan kernel (netem on a veth pair)")
    if netem is None:
        return WanChoice("kernel", "auto: the kernel has sch_netem")
    packet = _testbed_reason()
    if packet is None:
        return WanChoice(
            "packet",
            f"auto: no kernel shell ({netem}); root and /dev/net/tun are "
            f"there, so the packet shell between namespaces",
        )
    return WanChoice(
        "proxy",
        f"auto: no kernel shell ({netem}); no packet shell ({packet}); "
        f"so the proxy shell on loopback",
    )


_HANDED_OUT: set[int] = set()  # ports this process gave out: never the same one twice


def _below_ephemeral() -> tuple[int, int] | None:
    """A range of ports just below the kernel's ephemeral range, or None if there is none."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (low - 12000, low) if low - 12000 >= 1024 else None


def free_port(host: str = LOOPBACK) -> int:
    """A port free right now on `host`, for a daemon to bind a moment later.

    Not from bind-to-0: that hands out an ephemeral port, and between our probe and the daemon's
    bind any outgoing connection on the machine may take the same number (CI saw the router fail
    with EADDRINUSE that way). Ports just below the ephemeral range are never picked by the
    kernel for outgoing connections; we take a random free one there (random, so two launchers
    at once rarely meet), never twice in one process."""
    span = _below_ephemeral()
    if span is not None:
        rng = random.SystemRandom()
        for _ in range(200):
            port = rng.randrange(*span)
            if port in _HANDED_OUT:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _HANDED_OUT.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no such range: the old way
        s.bind((host, 0))
        port = s.getsockname()[1]
    _HANDED_OUT.add(port)
    return port


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def queue_bytes(wan: WanSection) -> int | None:
    """The emulator's bottleneck queue: ``wan.queue_ms`` of the line's (wall-clock) rate, at
    least one packet; None (the emulator's default) when either is unset."""
    if wan.queue_ms is None or wan.bw_mbit is None:
        return None
    return max(1500, int(wan.bw_mbit * 1e6 / 8 * wan.queue_ms / 1e3))


def proxy_argv(listen: str, upstream: str, control: str) -> list[str]:
    """The command line of a proxy-shell WAN process (`pdd wan proxy`), without its effects."""
    return [
        sys.executable,
        "-m",
        "pddnet",
        "wan",
        "proxy",
        "--listen",
        listen,
        "--upstream",
        upstream,
        "--control",
        control,
    ]


def popen(argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
    """Start a daemon: its own session (a terminal's Ctrl-C reaches only the launcher, which
    stops everything in order) and tied to the launcher's life."""
    return subprocess.Popen(
        list(argv),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent(),
        **kwargs,
    )


class Placement:
    """Where daemons run and how MD is reached; the base class is `none` (all on loopback)."""

    shell = "none"

    def __init__(self, choice: WanChoice, config: ClusterConfig) -> None:
        self.choice = choice
        self.config = config
        self.control_url: str | None = None
        self.testbed_name: str | None = None
        self.emulator_pid: int | None = None

    def prepare(self, config: ClusterConfig) -> None:
        """Fill in hosts and MD's dial address (ports are already chosen)."""
        for sec in (config.prefill, config.relay, config.main_decode):
            sec.host = LOOPBACK
            sec.dial = None
        config.router.host = LOOPBACK

    async def start(self) -> None:
        """Bring the WAN up (before the daemons start)."""

    def namespace(self, role: str) -> str | None:
        return None

    def spawn(self, role: str, argv: Sequence[str], **kwargs: Any) -> Any:
        """A fork of a server that imported the daemon's modules already (~3.5 s of CPU less
        for P / RLD / MD, ~1 s for the router, which is forked from one without torch):
        pddnet.cluster.forkserver; a Popen for a command line it does not run."""
        if forkserver.forkable(argv) and kwargs["stdout"] is kwargs["stderr"]:
            preload = forkserver.NO_TORCH if role == "router" else forkserver.TORCH_DAEMONS
            return forkserver.spawn(argv, kwargs["env"], kwargs["cwd"], kwargs["stdout"], preload)
        return popen(argv, **kwargs)

    async def expose_router(self, port: int) -> str:
        """The router URL users reach from the host."""
        return f"http://{LOOPBACK}:{port}"

    async def close(self) -> None:
        """Take the WAN down (after the daemons stopped)."""

    def describe(self) -> dict[str, Any]:
        return {
            "shell": self.choice.shell,
            "reason": self.choice.reason,
            "control_url": self.control_url,
            "testbed": self.testbed_name,
            "emulator_pid": self.emulator_pid,
        }


class ProxyPlacement(Placement):
    """The proxy shell: `pdd wan proxy` in front of MD on loopback."""

    shell = "proxy"

    def __init__(self, choice: WanChoice, config: ClusterConfig) -> None:
        super().__init__(choice, config)
        self.proc: Any = None  # a forkserver.ForkedProcess
        self.listen_port = free_port()
        self.control_port = free_port()
        self.log_path: str | None = None

    def prepare(self, config: ClusterConfig) -> None:
        super().prepare(config)
        if config.transport.wan == "mooncake" and config.mode is not ClusterMode.SAME_DC:
            raise WanUnavailable(
                'transport.wan = "mooncake" needs --wan packet or kernel: the '
                "proxy shell forwards only MD's control port, so Mooncake's own "
                "connections would bypass the emulated WAN"
            )
        if config.wan.loss_pct:
            raise WanUnavailable(
                "the proxy shell carries TCP byte streams and cannot lose "
                f"packets (wan.loss_pct={config.wan.loss_pct}); use --wan packet"
            )
        config.main_decode.dial = f"{LOOPBACK}:{self.listen_port}"
        config.wan.control = f"{LOOPBACK}:{self.control_port}"
        self.control_url = f"http://{LOOPBACK}:{self.control_port}"

    async def start(self) -> None:
        wan = wallclock(self.config).wan  # an emulated cluster's line, dilated and byte-scaled
        argv = [
            *proxy_argv(
                f"{LOOPBACK}:{self.listen_port}",
                f"{LOOPBACK}:{self.config.main_decode.port}",
                f"{LOOPBACK}:{self.control_port}",
            ),
            "--rtt-ms",
            repr(wan.rtt_ms),
            "--jitter-ms",
            repr(wan.jitter_ms),
            "--seed",
            str(self.config.model.seed),
        ]
        if wan.bw_mbit is not None:
            argv += ["--bw-mbit", repr(wan.bw_mbit)]
        queue = queue_bytes(wan)
        if queue is not None:
            argv += ["--queue-bytes", str(queue)]
        log = open(self.log_path or os.devnull, "ab")  # noqa: SIM115 - handed to the child
        try:  # a fork of the server without torch (pddnet.cluster.forkserver): ~1 s of CPU less
            self.proc = forkserver.spawn(argv, child_env(1), os.getcwd(), log, forkserver.NO_TORCH)
        finally:
            log.close()
        self.emulator_pid = self.proc.pid
        await _wait_http(self.control_url + "/link", self.proc, 20.0, "the WAN proxy")

    async def close(self) -> None:
        if self.proc is not None:
            await asyncio.to_thread(stop_processes, [self.proc])
            self.proc = None


class TestbedPlacement(Placement):
    """The packet or kernel shell: MD in namespace B, everything else in namespace A."""

    __test__ = False

    def __init__(self, choice: WanChoice, config: ClusterConfig) -> None:
        super().__init__(choice, config)
        from emulation.testbed import Testbed

        self.shell = choice.shell
        self.testbed_name = f"pdd{os.getpid()}{secrets.token_hex(2)}"
        wan = wallclock(config).wan  # an emulated cluster's line, dilated and byte-scaled
        emulation = config.emulation()
        self.testbed = Testbed(
            name=self.testbed_name,
            rtt_ms=wan.rtt_ms,
            jitter_ms=wan.jitter_ms,
            bw_mbit=wan.bw_mbit,
            loss_pct=wan.loss_pct,
            queue_bytes=queue_bytes(wan),
            shell=choice.shell,
            seed=config.model.seed,
            die_with_parent=True,
            tcp_rto_min_ms=tcp_rto_min_ms(emulation.dilation if emulation else 1.0),
        )
        self.forwarder: NamespaceForwarder | None = None

    def prepare(self, config: ClusterConfig) -> None:
        super().prepare(config)
        config.main_decode.host = self.testbed.addr_b
        config.main_decode.dial = f"{self.testbed.addr_b}:{config.main_decode.port}"

    async def start(self) -> None:
        await self.testbed.start()
        self.control_url = self.testbed.control_url
        self.emulator_pid = self.testbed.emulator_pid
        if self.control_url:
            self.config.wan.control = self.control_url.removeprefix("http://")

    def namespace(self, role: str) -> str | None:
        return self.testbed.ns("b" if role == "main_decode" else "a")

    def spawn(self, role: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        side = "b" if role == "main_decode" else "a"
        return self.testbed.exec(
            side,
            list(argv),
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent(),
            **kwargs,
        )

    def router_endpoint(self) -> tuple[str, str]:
        """(namespace, address) the router listens on."""
        return self.testbed.ns_a, LOOPBACK

    async def expose_router(self, port: int) -> str:
        ns, address = self.router_endpoint()
        self.forwarder = NamespaceForwarder(ns, address, port)
        public = await self.forwarder.start(LOOPBACK, port)
        return f"http://{LOOPBACK}:{public}"

    async def remove_extra_namespaces(self) -> None:
        """Before the testbed goes: namespaces a subclass made around it."""

    def describe(self) -> dict[str, Any]:
        # None: the kernel's (an undilated cluster)
        return {**super().describe(), "tcp_rto_min_ms": self.testbed.tcp_rto_min_ms}

    async def close(self) -> None:
        if self.forwarder is not None:
            await self.forwarder.close()
            self.forwarder = None
        await self.remove_extra_namespaces()
        await self.testbed.close()


class HostsPlacement(TestbedPlacement):
    """One namespace per daemon ("host"), on its datacenter's LAN behind the testbed's A or B
    namespace, which route between the two LANs over the emulated WAN (see the module doc)."""

    __test__ = False
    LANS = {"a": "10.78.1", "b": "10.78.2"}
    HOSTS = {
        "router": ("a", 10, "r"),
        "prefill": ("a", 11, "p"),
        "relay": ("a", 12, "l"),
        "main_decode": ("b", 11, "m"),
    }

    def __init__(self, choice: WanChoice, config: ClusterConfig) -> None:
        super().__init__(choice, config)
        self.hosts = {
            role: f"{self.testbed_name}-{short}" for role, (_, _, short) in self.HOSTS.items()
        }
        self._made: list[str] = []

    def address(self, role: str) -> str:
        side, host, _ = self.HOSTS[role]
        return f"{self.LANS[side]}.{host}"

    def prepare(self, config: ClusterConfig) -> None:
        Placement.prepare(self, config)
        for role in ("prefill", "relay", "main_decode"):
            getattr(config, role).host = self.address(role)
        config.router.host = self.address("router")

    async def start(self) -> None:
        await super().start()
        await asyncio.to_thread(self._make_hosts)

    def _make_hosts(self) -> None:
        from emulation import netns

        tb = self.testbed
        for side, gw in (("a", tb.ns_a), ("b", tb.ns_b)):
            lan = self.LANS[side]
            other = self.LANS["b" if side == "a" else "a"]
            peer = tb.addr_b if side == "a" else tb.addr_a
            _ip("-n", gw, "link", "add", "lan0", "type", "bridge")
            _ip("-n", gw, "addr", "add", f"{lan}.1/24", "dev", "lan0")
            _ip("-n", gw, "link", "set", "lan0", "up")
            _ip("-n", gw, "route", "add", f"{other}.0/24", "via", peer, "dev", "wan0")
            netns.run_in_netns(gw, _enable_forwarding)
        for role, host_ns in self.hosts.items():
            side, _, short = self.HOSTS[role]
            gw = tb.ns(side)
            tb.adopt_namespace(host_ns)  # recorded first: a crash from here on leaves no trace
            netns.create(host_ns)
            self._made.append(host_ns)
            tb.configure_tcp(host_ns)  # the daemon's TCP endpoints are here
            _ip(
                "link",
                "add",
                "name",
                "eth0",
                "netns",
                host_ns,
                "type",
                "veth",
                "peer",
                "name",
                f"h-{short}",
                "netns",
                gw,
            )
            _ip("-n", gw, "link", "set", f"h-{short}", "master", "lan0", "up")
            _ip("-n", host_ns, "addr", "add", f"{self.address(role)}/24", "dev", "eth0")
            _ip("-n", host_ns, "link", "set", "eth0", "up")
            _ip("-n", host_ns, "route", "add", "default", "via", f"{self.LANS[side]}.1")

    def namespace(self, role: str) -> str | None:
        return self.hosts[role]

    def spawn(self, role: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        from emulation import netns

        return popen(netns.exec_argv(self.hosts[role], [str(a) for a in argv]), **kwargs)

    def router_endpoint(self) -> tuple[str, str]:
        return self.hosts["router"], self.address("router")

    async def remove_extra_namespaces(self) -> None:
        from emulation import netns

        for host_ns in self._made:  # the launcher stopped the daemons; anything left goes too
            if netns.exists(host_ns):
                await asyncio.to_thread(netns.kill_all_in, host_ns)
                netns.delete(host_ns)
        self._made.clear()

    def describe(self) -> dict[str, Any]:
        return {
            **super().describe(),
            "placement": "hosts",
            "hosts": {
                role: {"namespace": ns, "address": self.address(role)}
                for role, ns in self.hosts.items()
            },
        }


def _ip(*args: str) -> None:
    """One iproute2 command; its stderr in the error when it fails."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _enable_forwarding() -> None:
    # /proc/sys/net is the calling thread's namespace's (run_in_netns moved this thread).
    with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
        f.write("1")


def make_placement(
    choice: WanChoice, config: ClusterConfig, placement: str = "datacenter"
) -> Placement:
    if placement not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if placement == "hosts":
        if choice.shell not in ("packet", "kernel"):
            raise WanUnavailable(
                f"--placement hosts needs the testbed (--wan packet or kernel), "
                f"not the {choice.shell} shell: {choice.reason}"
            )
        return HostsPlacement(choice, config)
    if choice.shell == "proxy":
        return ProxyPlacement(choice, config)
    if choice.shell in ("packet", "kernel"):
        return TestbedPlacement(choice, config)
    return Placement(choice, config)


class NamespaceForwarder:
    """Host loopback port -> a port inside a network namespace (for the router's HTTP): each
    accepted connection gets a socket made inside the namespace, and bytes are piped both ways."""

    def __init__(self, ns: str, target_host: str, target_port: int) -> None:
        self.ns = ns
        self.target = (target_host, target_port)
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._accept, host, port)
        return self._server.sockets[0].getsockname()[1]

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        from emulation import netns

        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            sock = await asyncio.to_thread(netns.socket_in, self.ns)
            sock.setblocking(False)
            try:
                await asyncio.get_running_loop().sock_connect(sock, self.target)
            except OSError:
                sock.close()
                writer.close()
                return
            up_reader, up_writer = await asyncio.open_connection(sock=sock)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            if task is not None:
                self._tasks.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _wait_http(url: str, proc: subprocess.Popen, timeout: float, what: str) -> None:
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with code {proc.returncode}")
            try:
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as r:
                    if r.status == 200:
                        return
            except (aiohttp.ClientError, asyncio.TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} did not answer {url} within {timeout:g} s")
            await asyncio.sleep(0.05)


def stop_processes(procs: Sequence[subprocess.Popen], grace_s: float = 5.0) -> list[int]:
    """SIGTERM every process, SIGKILL what is left after `grace_s`; reap all. Returns the PIDs
    that needed SIGKILL."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
    killed = []
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            killed.append(p.pid)
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            p.wait()
    return killed
