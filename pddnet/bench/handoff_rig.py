"""handoff bench: the rig, started in order and closed in reverse: the emulated WAN and MD's
server behind it (`--wan proxy`: `pdd wan proxy` in its own process on loopback; `--wan packet`:
the packet shell between two namespaces, MD's sockets in B and RLD's in A; either changed at run
time through its control API), RLD's lanes through it, and the competing bulk traffic; then one
handoff, and one link condition's handoffs, run on it.

With emulated devices (`HandoffDevices`) the link and the traffic are the modelled world's as
this box must run them (pddnet/device/dilation.py): the rate x wire scale / k (the target
model's KV volume carried by the small model's bytes), delay, jitter and the buffer's time x k,
the bulk transfers' sizes in real bytes of the same scale, the pauses x k; every time a trial
records is wall / k."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import secrets
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from pddnet.bench.devices import UNPACED, DeviceSetup
from pddnet.bench.handoff_devices import HandoffDevices
from pddnet.bench.handoff_setup import PATHS, Prepared
from pddnet.bench.handoff_sides import (
    BULK_PREFIX,
    HOST,
    MainSide,
    MainTrial,
    RelaySide,
    relay_machine,
)

# Link conditions: which of the two disturbances each one turns on, and whether the line serves
# the latency lanes' DSCP (pddnet.transport.LATENCY_DSCP: HANDOFF, TAKEOVER) in a priority class
# ahead of bulk KV, as QoS on a datacenter interconnect would; otherwise one FIFO carries all.
CONDITIONS: dict[str, dict[str, bool]] = {
    "quiet": {"jitter": False, "bulk": False, "priority": False},
    "jitter": {"jitter": True, "bulk": False, "priority": False},
    "bulk": {"jitter": False, "bulk": True, "priority": False},
    "jitter+bulk": {"jitter": True, "bulk": True, "priority": False},
    "jitter+bulk+priority": {"jitter": True, "bulk": True, "priority": True},
}
TRIAL_TIMEOUT_S = 60.0

# -- competing traffic ----------------------------------------------------------------------------


@dataclass
class BulkStats:
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0


class BulkSender:
    """Other requests' KV crossing to MD on P's bulk lanes (`conn`: one, or a StripedSender
    over several, as P's pddnet.transport.stripes): transfers of 1..2m-1 chunks
    (mean `mean_bytes`, real bytes) arriving as a Poisson process whose offered load is `load`
    of the link rate (`rate_mbit`, the emulator's). Bounded: it stops when `stop` is set or
    after `max_seconds`."""

    def __init__(
        self,
        conn: Any,
        spec: Any,
        mean_bytes: float,
        load: float,
        rate_mbit: float,
        seed: int,
        max_seconds: float,
    ) -> None:
        import torch

        from pddnet.protocol import payload_from_tensor

        self.conn = conn
        self.rng = random.Random(seed)
        self.max_seconds = max_seconds
        # chunks of up to 64 tokens, fewer when a whole transfer is smaller than that
        tokens = max(1, min(64, round(mean_bytes / spec.bytes_per_token)))
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn(
            (spec.num_layers, 2, tokens, spec.num_kv_heads, spec.head_dim), generator=g
        ).to(spec.torch_dtype)
        self.payload, self.dtype, self.shape = payload_from_tensor(kv)
        self.tokens = tokens
        self.mean_chunks = max(1, round(mean_bytes / self.payload.nbytes))
        mean_transfer = self.mean_chunks * self.payload.nbytes
        self.mean_gap_s = mean_transfer * 8 / (load * rate_mbit * 1e6)
        self.stats = BulkStats()

    async def run(self, stop: asyncio.Event) -> BulkStats:
        from pddnet.protocol import KvChunk

        t0 = time.perf_counter()
        next_at = t0 + self.rng.expovariate(1 / self.mean_gap_s)
        while not stop.is_set() and time.perf_counter() - t0 < self.max_seconds:
            wait = next_at - time.perf_counter()
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
                continue
            rid = f"{BULK_PREFIX}{self.stats.transfers}"
            for j in range(self.rng.randint(1, 2 * self.mean_chunks - 1)):
                await self.conn.send(
                    KvChunk(
                        request_id=rid,
                        chunk_index=j,
                        token_start=j * self.tokens,
                        token_end=(j + 1) * self.tokens,
                        layer_start=0,
                        layer_end=self.shape[0],
                        dtype=self.dtype,
                        shape=self.shape,
                        payload=self.payload,
                    )
                )
                self.stats.bytes += self.payload.nbytes
            self.stats.transfers += 1
            next_at += self.rng.expovariate(1 / self.mean_gap_s)
        self.stats.seconds = time.perf_counter() - t0
        return self.stats


# -- the emulated WAN: a proxy on loopback, or TUN devices between two namespaces ----------------

_PROXY_LINE = re.compile(r"wan proxy: (\S+):(\d+) -> .*; control (http://\S+)")
WAN_SHELLS = ("proxy", "packet")
# The packet shell's MTU unless --mtu says otherwise: an Ethernet WAN's, not the cluster
# testbed's jumbo frames, so that a transfer is as many packets (and losses) as its bytes make on
# such a WAN.
DEFAULT_MTU = 1500
# Its TCP, unless --tcp-cc says otherwise: Linux's default (this box's own default may differ;
# BBR, for one, does not back off on the tail drops competing traffic causes).
DEFAULT_TCP_CC = "cubic"


class WanLink:
    """The emulated WAN between RLD (dc-a) and MD (dc-b), and its control API (emulation.control,
    the same for every shell). A shell says how MD's server is reached (`serve`) and where RLD's
    sockets are made (`make_socket`)."""

    shell = ""

    def __init__(self, args: argparse.Namespace, devices: DeviceSetup = UNPACED) -> None:
        self.args = args
        self.devices = devices
        self.control_url: str | None = None

    @property
    def rate_mbit(self) -> float:
        """The emulator's rate: the modelled --bw-mbit x wire scale / k."""
        return self.devices.wall_rate_mbit(self.args.bw_mbit)

    @property
    def initial_effects(self) -> dict[str, Any]:
        """The emulator's settings (wall clock, real bytes)."""
        a, k = self.args, self.devices.dilation
        queue = max(1500, int(self.rate_mbit * 1e6 / 8 * a.queue_ms * k / 1e3))
        return {"delay_ms": a.rtt_ms * k / 2, "rate_mbit": self.rate_mbit, "queue_bytes": queue}

    def describe(self) -> dict[str, Any]:
        """For the result JSON: the shell and what it adds."""
        return {"shell": self.shell}

    async def serve(self, server: Any) -> tuple[str, int]:
        """Start the emulator and MD's `server` behind it; the address RLD dials."""
        raise NotImplementedError

    def make_socket(self, family: int, kind: int, proto: int) -> socket.socket:
        """A socket of RLD's machine (pddnet.transport.dial's `make_socket`)."""
        return socket.socket(family, kind, proto)

    def client(self) -> Any:
        from emulation.control import ControlClient

        assert self.control_url is not None
        return ControlClient(self.control_url)

    async def set_condition(self, name: str) -> dict[str, Any]:
        """Back to the initial link, then the condition's jitter; returns a_to_b's effects."""
        client = self.client()
        await client.clear()
        if CONDITIONS[name]["jitter"] and self.args.jitter_ms > 0:
            jitter_ms = self.args.jitter_ms * self.devices.dilation
            await client.set("both", jitter_ms=jitter_ms, jitter_dist="normal")
        if CONDITIONS[name]["priority"]:
            from pddnet.transport import LATENCY_DSCP

            await client.set("both", priority_dscp=LATENCY_DSCP)
        return (await client.show("a_to_b"))["a_to_b"]["effects"]

    async def counters(self) -> dict[str, Any]:
        return (await self.client().show("a_to_b"))["a_to_b"]["counters"]

    async def close(self) -> None:
        raise NotImplementedError


class ProxyWan(WanLink):
    """`pdd wan proxy` in its own process on loopback, in front of MD: one TCP connection from
    RLD to the proxy and one from the proxy to MD, the bytes between them paced by the link
    model. Lossless: a full buffer holds the sender back instead of dropping."""

    shell = "proxy"

    def __init__(self, args: argparse.Namespace, devices: DeviceSetup = UNPACED) -> None:
        super().__init__(args, devices)
        self.proc: Any = None
        self._log: Any = None

    async def serve(self, server: Any) -> tuple[str, int]:
        from pddnet.cluster.wan_setup import child_env, popen, proxy_argv

        md_port = await server.start()
        fx = self.initial_effects
        argv = [
            *proxy_argv(f"{HOST}:0", f"{HOST}:{md_port}", f"{HOST}:0"),
            "--rtt-ms",
            repr(fx["delay_ms"] * 2),
            "--bw-mbit",
            repr(fx["rate_mbit"]),
            "--queue-bytes",
            str(fx["queue_bytes"]),
            "--seed",
            str(self.args.seed),
        ]
        self._log = tempfile.TemporaryFile()  # not a pipe: a full pipe would stall the proxy
        self.proc = popen(argv, stdout=self._log, stderr=self._log, env=child_env(1))
        deadline = time.monotonic() + 30.0
        while True:
            self._log.seek(0)
            text = self._log.read().decode(errors="replace")
            m = _PROXY_LINE.search(text)
            if m:
                self.control_url = m.group(3)
                return HOST, int(m.group(2))
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the WAN proxy did not start (exit {self.proc.poll()}): "
                    f"{text.strip()[-400:]!r}"
                )
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        from pddnet.cluster.wan_setup import stop_processes

        if self.proc is not None:
            await asyncio.to_thread(stop_processes, [self.proc])
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


class PacketWan(WanLink):
    """The packet shell (emulation.testbed): RLD's sockets in namespace A, MD's in namespace B,
    real TCP end to end through TUN devices and the link model. Its buffer drops what does not
    fit (tail drop), so competing traffic costs a transfer TCP's loss recovery, as on a real
    line. Needs root and /dev/net/tun."""

    shell = "packet"

    def __init__(self, args: argparse.Namespace, devices: DeviceSetup = UNPACED) -> None:
        super().__init__(args, devices)
        self.testbed: Any = None
        self.rto_min_ms: float | None = None  # TCP's, in the testbed's namespaces

    @property
    def tcp_cc(self) -> str:
        return self.args.tcp_cc or DEFAULT_TCP_CC

    @property
    def mtu(self) -> int:
        return self.args.mtu or DEFAULT_MTU

    def describe(self) -> dict[str, Any]:
        return {
            "shell": self.shell,
            "mtu": self.mtu,
            "tcp_congestion_control": self.tcp_cc,
            "tcp_rto_min_ms": self.rto_min_ms,  # as read back from namespace A
        }

    def _socket_in(self, side: str, family: int, kind: int, proto: int) -> socket.socket:
        """A socket in namespace `side` with the chosen congestion control: set per socket,
        since a namespace other than the host's may only default to the unrestricted ones (and
        MD's accepted connections inherit their listener's)."""
        from emulation import netns

        assert self.testbed is not None
        sock = netns.socket_in(self.testbed.ns(side), family, kind, proto)
        try:
            if kind == socket.SOCK_STREAM:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, self.tcp_cc.encode())
        except BaseException:
            sock.close()
            raise
        return sock

    async def serve(self, server: Any) -> tuple[str, int]:
        from emulation import netns
        from emulation.testbed import Testbed, unavailable_reason
        from pddnet.device.dilation import tcp_rto_min_ms

        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"--wan packet is not available here: {reason}")
        fx = self.initial_effects
        self.testbed = Testbed(
            name=f"pddho{os.getpid()}{secrets.token_hex(2)}",
            rtt_ms=fx["delay_ms"] * 2,
            bw_mbit=fx["rate_mbit"],
            queue_bytes=fx["queue_bytes"],
            mtu=self.mtu,
            shell="packet",
            seed=self.args.seed,
            die_with_parent=True,
            tcp_rto_min_ms=tcp_rto_min_ms(self.devices.dilation),
        )
        await self.testbed.start()
        self.control_url = self.testbed.control_url
        rto_us = netns.read_sysctl(self.testbed.ns("a"), "net.ipv4.tcp_rto_min_us")
        self.rto_min_ms = float(rto_us) / 1e3
        listener = self._socket_in("b", socket.AF_INET, socket.SOCK_STREAM, 0)
        try:
            listener.bind((self.testbed.addr_b, 0))
        except BaseException:
            listener.close()
            raise
        port = await server.start(sock=listener)
        return self.testbed.addr_b, port

    def make_socket(self, family: int, kind: int, proto: int) -> socket.socket:
        return self._socket_in("a", family, kind, proto)

    async def close(self) -> None:
        if self.testbed is not None:
            await self.testbed.close()
            self.testbed = None


def tcp_congestion_controls() -> list[str]:
    """The congestion controls this kernel offers (built in or loaded)."""
    with open("/proc/sys/net/ipv4/tcp_available_congestion_control") as f:
        return f.read().split()


def make_wan(args: argparse.Namespace, devices: DeviceSetup = UNPACED) -> WanLink:
    """The `--wan` shell's link."""
    shells = {"proxy": ProxyWan, "packet": PacketWan}
    if args.wan not in shells:
        raise ValueError(f"--wan must be one of {', '.join(shells)}, got {args.wan!r}")
    return shells[args.wan](args, devices)


# -- one run --------------------------------------------------------------------------------------


@dataclass
class Rig:
    """Everything a handoff needs, started in order and closed in reverse. `md_engine`: MD's
    engine, warm for the whole run (handoff_sides.MainTrial empties it after each trial)."""

    md_engine: Any
    md_executor: ThreadPoolExecutor
    rld_executor: ThreadPoolExecutor
    devices: HandoffDevices = field(default_factory=HandoffDevices)
    main: MainSide | None = None
    wan: WanLink | None = None
    relay: RelaySide | None = None
    bulk_conn: Any = None  # a StripedSender over P's bulk lanes to MD
    conns: list[Any] = field(default_factory=list)

    async def start(self, args: argparse.Namespace) -> None:
        from pddnet.transport import dial

        secret = secrets.token_bytes(32)
        self.main = MainSide(secret)
        self.wan = make_wan(args, self.devices.setup)
        host, port = await self.wan.serve(self.main.server)

        async def lane(role: str, instance: str, kind: str) -> Any:
            assert self.wan is not None
            conn = await dial(
                host,
                port,
                role=role,
                instance_id=instance,
                lane=kind,
                secret=secret,
                timeout=10.0,
                make_socket=self.wan.make_socket,
            )
            self.conns.append(conn)
            return conn

        control = await lane("relay", "rld-bench", "control")
        bulk = await lane("relay", "rld-bench", "bulk")
        from pddnet.transport.stripes import StripedSender

        # other requests' KV as P sends it to MD: striped over --bulk-stripes lanes
        self.bulk_conn = StripedSender(
            [await lane("prefill", "p-bulk", "bulk") for _ in range(args.bulk_stripes)]
        )
        self.relay = RelaySide(control, bulk, self.rld_executor, args.chunk_tokens)

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close("benchmark done")
        if self.main is not None:
            for trial in list(self.main.trials.values()):
                await trial.close()
            await self.main.server.close()
        if self.wan is not None:
            await self.wan.close()


# -- one handoff, one condition --------------------------------------------------------------------


async def handoff_once(
    rig: Rig, path: str, rid: str, prep: Prepared, n: int, pause_s: float
) -> dict[str, Any]:
    """One handoff: MD's and RLD's state (untimed), a random pause (`pause_s`, modelled), MD's
    TAKEOVER reaching RLD's machine, which cuts; MD's first tokens. Times in the result are
    modelled (wall / k); `forward_modelled_s` is MD's paced forward's modelled time (None
    unpaced)."""
    assert rig.main is not None and rig.relay is not None
    k = rig.devices.k
    pacer = rig.devices.pacer("main_decode")
    trial = MainTrial(path, rid, n, prep, rig.md_engine, rig.md_executor, pacer)
    rig.main.trials[rid] = trial
    try:
        takeover = await trial.setup()
        relay = relay_machine(prep, n)
        await asyncio.sleep(pause_s * k)
        before = rig.relay.bytes_out()
        tcp_before = rig.relay.tcp_counters()
        t_cut = await rig.relay.cut(path, rid, relay, takeover, prep)
        try:
            got = await asyncio.wait_for(asyncio.shield(trial.done), TRIAL_TIMEOUT_S * k)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"handoff {rid}: MD had not sampled {TRIAL_TIMEOUT_S * k:g} s after "
                f"the cut (messages lost on the link?)"
            ) from None
        after = rig.relay.bytes_out()
        tcp = {
            lane: None if now is None or tcp_before[lane] is None else now.since(tcp_before[lane])
            for lane, now in rig.relay.tcp_counters().items()
        }
    finally:
        rig.main.trials.pop(rid, None)
        await trial.close()
    sent = {
        name: after[name] - before.get(name, 0)
        for name in after
        if after[name] > before.get(name, 0)
    }
    expected = prep.reference[n + 1 : n + 3]
    payload = sum(sent.values())
    return {
        "path": path,
        "request_id": rid,
        "relay_tokens": n,
        "prompt": prep.index,
        "dilation": k,
        "latency_s": (got["t_sampled"] - t_cut) / k,
        "wire_s": (got["t_arrived"] - t_cut) / k,
        "md_s": (got["t_sampled"] - got["t_arrived"]) / k,
        "forward_s": got["forward_s"] / k,
        "forward_modelled_s": None if pacer is None else pacer.modelled(trial.forward_chunks),
        "forward_chunks": [list(c) for c in trial.forward_chunks],
        # the engine step alone, before pacing (> forward_modelled_s: it overran)
        "forward_compute_s": trial.forward_compute_s / k,
        "forward_tokens": got["forward_tokens"],
        "import_s": trial.import_s / k,
        "payload_bytes": payload,
        # the KV in the target model's bytes, the ids and framing as they are
        "payload_target_bytes": payload - trial.kv_bytes + rig.devices.target_bytes(trial.kv_bytes),
        "frames_bytes": sent,
        "kv_bytes_received": trial.kv_bytes,
        # RLD's lanes during the handoff: segments retransmitted, and retransmission timeouts
        "tcp": {lane: None if c is None else asdict(c) for lane, c in tcp.items()},
        "tokens": got["tokens"],
        "expected": expected,
        "token_exact": got["tokens"] == expected,
    }


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        return None


async def run_condition(
    rig: Rig,
    args: argparse.Namespace,
    ci: int,
    name: str,
    preps: list[Prepared],
    bar: Any,
    spec: Any,
) -> dict[str, Any]:
    assert rig.wan is not None and rig.main is not None
    k = rig.devices.k
    # The same order and pauses in every condition, as the traffic (seed + 1000 below): two
    # conditions then differ only as named, and a line's handoffs meet the same bulk phases.
    rng = random.Random(args.seed)
    load_before = _loadavg()
    effects = await rig.wan.set_condition(name)
    stop = asyncio.Event()
    bulk_task = None
    sink_before = rig.main.bulk_bytes
    lanes_before = list(rig.bulk_conn.bytes_sent)
    if CONDITIONS[name]["bulk"]:
        sender = BulkSender(
            rig.bulk_conn,
            spec,
            args.bulk_mib * (1 << 20) * rig.devices.setup.wire_scale,  # modelled -> real bytes
            args.bulk_load,
            rig.wan.rate_mbit,
            args.seed + 1000,  # the same traffic in each condition: they differ only as named
            max_seconds=3600.0,
        )
        bulk_task = asyncio.create_task(sender.run(stop), name=f"bulk {name}")
        await asyncio.sleep(min(k, 4 * sender.mean_gap_s))  # let the traffic get going
    trials = []
    try:
        for rep in range(args.repeats):
            prep = preps[rep % len(preps)]
            for n in rng.sample(list(args.relay_tokens), len(args.relay_tokens)):
                for path in rng.sample(PATHS, len(PATHS)):
                    if bulk_task is not None and bulk_task.done():
                        bulk_task.result()  # the sender died: say why
                    rid = f"c{ci}-n{n}-r{rep}-{path}"
                    t = await handoff_once(
                        rig, path, rid, prep, n, rng.uniform(0, args.pause_ms / 1e3)
                    )
                    t["condition"] = name
                    trials.append(t)
                    bar.update(1)
                    bar.set_postfix(cond=name, n=n, ms=f"{t['latency_s'] * 1e3:.0f}")
    finally:
        stop.set()
        bulk = await bulk_task if bulk_task is not None else None
    if bulk is not None:  # drain what is still crossing before the next condition starts
        deadline = time.monotonic() + 60 * k
        while rig.main.bulk_bytes - sink_before < bulk.bytes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    info: dict[str, Any] = {
        "effects": effects,
        "bulk": None,
        "link_a_to_b": await rig.wan.counters(),
        "loadavg_1min": {"before": load_before, "after": _loadavg()},
    }
    if bulk is not None:
        info["bulk"] = {
            "transfers": bulk.transfers,
            "bytes": bulk.bytes,
            "target_bytes": rig.devices.target_bytes(bulk.bytes),
            "seconds": bulk.seconds / k,
            "received_bytes": rig.main.bulk_bytes - sink_before,
            # what each of P's stripes carried
            "lane_bytes": [
                a - b for a, b in zip(rig.bulk_conn.bytes_sent, lanes_before, strict=True)
            ],
            "offered_load": args.bulk_load,
            "measured_load": bulk.bytes * 8 / max(bulk.seconds, 1e-9) / (rig.wan.rate_mbit * 1e6),
        }
    return {"trials": trials, "info": info}
