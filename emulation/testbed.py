"""The multi-namespace testbed: datacenter A and datacenter B as two network namespaces joined by
an emulated WAN, with a state file so it can be inspected and torn down from another process.

    namespace <name>-a  (A: 10.77.0.1)  ── wan0 ═══ emulator process ═══ wan0 ──  namespace <name>-b (B: 10.77.0.2)
                                               (host namespace: packet forwarder or qdisc
                                                keeper + control API on 127.0.0.1:<port>)

Everything a testbed makes is named after it: namespaces `<name>-a` / `<name>-b`, its state
file `<state dir>/testbed-<name>.json` (state dir: $PDD_STATE_DIR, default /run/pddnet) and its
emulator's argv (`--ns-a <name>-a`). Devices live only inside the namespaces, never in the host
namespace. Teardown (`close()`, `pdd testbed down`) works from the state file and, when that is
gone (a crash before it was written), from those names alone: it ends every process inside the
two namespaces and the emulator, by PID, then deletes the namespaces and the state.

Two testbeds with different names never share anything but the machine: their namespaces are
distinct, so both may use the same default addresses; their control APIs get distinct ports.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

from emulation import lifetime, netns
from emulation.faults import ProcessFaults

log = logging.getLogger(__name__)

DEFAULT_STATE_DIR = "/run/pddnet"
SHELLS = ("packet", "kernel", "auto")
SIDES = ("a", "b")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_TIMEOUT_S = 20.0


def current_state_dir() -> str:
    return os.environ.get("PDD_STATE_DIR") or DEFAULT_STATE_DIR


def check_testbed_name(name: str) -> str:
    return netns.check_plain_name(name, "testbed", 40)


def namespaces_of(name: str) -> tuple[str, str]:
    check_testbed_name(name)
    return f"{name}-a", f"{name}-b"


def state_path(name: str, directory: str | None = None) -> str:
    return os.path.join(
        directory or current_state_dir(), f"testbed-{check_testbed_name(name)}.json"
    )


def load_state(name: str, directory: str | None = None) -> dict[str, Any] | None:
    try:
        with open(state_path(name, directory)) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return {"name": name, "corrupt": True}


def list_testbeds(directory: str | None = None) -> list[str]:
    try:
        entries = os.listdir(directory or current_state_dir())
    except FileNotFoundError:
        return []
    return sorted(
        e[len("testbed-") : -len(".json")]
        for e in entries
        if e.startswith("testbed-") and e.endswith(".json")
    )


def _save_state(state: dict[str, Any], directory: str) -> None:
    from emulation.packet_shell import write_json_atomic

    os.makedirs(directory, exist_ok=True)
    write_json_atomic(state_path(state["name"], directory), state)


def proc_start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot): with the PID it identifies a process
    across PID reuse."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


def proc_cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a process, from /proc/<pid>/stat."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _same_process(entry: dict[str, Any]) -> bool:
    ticks = proc_start_ticks(entry["pid"])
    return ticks is not None and ticks == entry.get("start_ticks")


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def find_emulators(name: str) -> list[int]:
    """PIDs of emulator processes serving *this* testbed's namespaces (found by their argv:
    our emulator module and `--ns-a <name>-a` exactly), for cleanup after a lost state file."""
    ns_a, _ = namespaces_of(name)
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        argv = _cmdline(int(entry))
        if not any(a in ("emulation.packet_cli", "emulation.kernel_shell") for a in argv):
            continue
        if any(argv[i] == "--ns-a" and argv[i + 1] == ns_a for i in range(len(argv) - 1)):
            found.append(int(entry))
    return found


def _end_processes(pids: Sequence[int], grace_s: float = 1.0) -> None:
    """SIGTERM (+SIGCONT for stopped ones), then SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGCONT):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
    for deadline, last in ((grace_s, False), (5.0, True)):
        end = time.monotonic() + deadline
        while time.monotonic() < end and any(proc_start_ticks(p) is not None for p in pids):
            time.sleep(0.02)
        if last:
            break
        for pid in pids:
            if proc_start_ticks(pid) is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass


def teardown(name: str, directory: str | None = None) -> dict[str, Any]:
    """Remove everything testbed `name` made, with or without its state file. Idempotent."""
    directory = directory or current_state_dir()
    ns_a, ns_b = namespaces_of(name)
    state = load_state(name, directory) or {}
    report: dict[str, Any] = {
        "name": name,
        "processes": [],
        "emulators": [],
        "namespaces": [],
        "state_file": False,
    }
    recorded = [p for p in state.get("processes", []) if _same_process(p)]
    _end_processes([p["pid"] for p in recorded])
    report["processes"] += [p["pid"] for p in recorded]
    adopted = [ns for ns in state.get("adopted_namespaces", []) if isinstance(ns, str)]
    for ns in (*adopted, ns_a, ns_b):
        if netns.exists(ns):
            report["processes"] += netns.kill_all_in(ns)
    emulators = set(find_emulators(name))
    emulator = state.get("emulator")
    if emulator and _same_process(emulator):
        emulators.add(emulator["pid"])
    _end_processes(sorted(emulators), grace_s=2.0)
    report["emulators"] = sorted(emulators)
    for ns in (*adopted, ns_a, ns_b):
        if netns.delete(ns):
            report["namespaces"].append(ns)
    for path in (
        state_path(name, directory),
        _ready_path(name, directory),
        _log_path(name, directory),
    ):
        try:
            os.unlink(path)
            if path.endswith(".json") and path == state_path(name, directory):
                report["state_file"] = True
        except FileNotFoundError:
            pass
    return report


def reap_orphans(directory: str | None = None) -> list[str]:
    """Tear down testbeds whose owner (a process that held one for its own life, e.g. a
    LocalCluster) died without closing them -- killed by a signal, so its cleanup never ran.
    Testbeds without an owner (`pdd testbed up`) are left alone. Returns the names reaped."""
    reaped = []
    for name in list_testbeds(directory):
        state = load_state(name, directory) or {}
        owner = state.get("owned_by")
        if isinstance(owner, dict) and not _same_process(owner):
            teardown(name, directory)
            reaped.append(name)
    return reaped


def _ready_path(name: str, directory: str) -> str:
    return os.path.join(directory, f"testbed-{name}.ready")


def _log_path(name: str, directory: str) -> str:
    return os.path.join(directory, f"testbed-{name}.log")


def initial_effects(
    rtt_ms: float = 0.0,
    jitter_ms: float = 0.0,
    jitter_dist: str | None = None,
    bw_mbit: float | None = None,
    loss_pct: float = 0.0,
    queue_bytes: int | None = None,
) -> dict[str, Any]:
    """Per-direction link effects for a testbed: the RTT is split evenly between directions;
    jitter, rate and loss apply to each direction."""
    from emulation.effects import validate_effects

    fx: dict[str, Any] = {
        "delay_ms": rtt_ms / 2.0,
        "jitter_ms": jitter_ms,
        "loss_pct": loss_pct,
        "rate_mbit": bw_mbit,
    }
    if jitter_dist is not None:
        fx["jitter_dist"] = jitter_dist
    if queue_bytes is not None:
        fx["queue_bytes"] = queue_bytes
    return validate_effects(fx)


def _effect_args(fx: dict[str, Any]) -> list[str]:
    args = [
        "--delay-ms",
        repr(fx["delay_ms"]),
        "--jitter-ms",
        repr(fx["jitter_ms"]),
        "--loss-pct",
        repr(fx["loss_pct"]),
    ]
    if fx.get("rate_mbit") is not None:
        args += ["--rate-mbit", repr(fx["rate_mbit"])]
    if "jitter_dist" in fx:
        args += ["--jitter-dist", fx["jitter_dist"]]
    if "queue_bytes" in fx:
        args += ["--queue-bytes", str(fx["queue_bytes"])]
    return args


def resolve_shell(shell: str) -> str:
    if shell not in SHELLS:
        raise ValueError(f"unknown shell {shell!r} (known: {', '.join(SHELLS)})")
    if shell != "auto":
        return shell
    from emulation.kernel_shell import netem_available

    return "kernel" if netem_available() else "packet"


class LinkHandle:
    """The testbed's WAN, through the emulator's control API (emulation.control)."""

    def __init__(self, control_url: str) -> None:
        from emulation.control import ControlClient

        self.url = control_url
        self.client = ControlClient(control_url)

    async def show(self, direction: str = "both") -> dict:
        return await self.client.show(direction)

    async def set(
        self, direction: str = "both", duration: float | None = None, **effects: Any
    ) -> dict:
        return await self.client.set(direction, duration, **effects)

    async def clear(self, direction: str = "both") -> dict:
        return await self.client.clear(direction)

    async def partition(self, duration: float | None = None) -> dict:
        """Both directions drop everything, until heal() or for `duration` seconds."""
        if duration is None:
            return await self.client.set("both", None, partition=True)
        return await self.client.chaos("partition", duration)

    async def heal(self) -> dict:
        return await self.client.heal()

    async def chaos(self, kind: str, duration: float, **params: Any) -> dict:
        return await self.client.chaos(kind, duration, **params)

    async def schedule(self, steps: list[dict] | None = None, **options: Any) -> dict:
        """Load a schedule: steps, or trace=; loop=, period= (ControlClient.load_schedule)."""
        return await self.client.load_schedule(steps, **options)

    async def reset_connections(self) -> dict:
        return await self.client.reset_connections()


class Testbed:
    __test__ = False  # not a pytest test class, despite the name
    """`async with Testbed(name="t1", rtt_ms=30) as tb:` two namespaces and the WAN between them.

    tb.exec("a", argv) starts a process in A (tracked by PID, ended on exit); tb.link changes the
    WAN at runtime; tb.faults kills or hangs processes it started. Any exception inside the
    block (or during start) still removes everything (see teardown())."""

    def __init__(
        self,
        name: str = "pdd",
        rtt_ms: float = 0.0,
        jitter_ms: float = 0.0,
        bw_mbit: float | None = None,
        loss_pct: float = 0.0,
        mtu: int = 9000,
        shell: str = "auto",
        addr_a: str = "10.77.0.1",
        addr_b: str = "10.77.0.2",
        jitter_dist: str | None = None,
        queue_bytes: int | None = None,
        seed: int = 0,
        state_dir: str | None = None,
        die_with_parent: bool = False,
        tcp_rto_min_ms: float | None = None,
    ) -> None:
        from emulation.tun import TunConfig

        self.name = check_testbed_name(name)
        self.ns_a, self.ns_b = namespaces_of(name)
        TunConfig("wan0", addr_a, addr_b, mtu)  # validates addresses and MTU
        if shell not in SHELLS:
            raise ValueError(f"unknown shell {shell!r} (known: {', '.join(SHELLS)})")
        if bw_mbit is not None and bw_mbit <= 0:
            raise ValueError(f"bw_mbit must be > 0 Mbit/s (or None for unlimited), got {bw_mbit}")
        self.effects = initial_effects(
            rtt_ms, jitter_ms, jitter_dist, bw_mbit, loss_pct, queue_bytes
        )
        if tcp_rto_min_ms is not None and not 0 < tcp_rto_min_ms < math.inf:
            raise ValueError(f"tcp_rto_min_ms must be > 0 ms (or None), got {tcp_rto_min_ms}")
        # TCP's minimum retransmission timeout in the testbed's namespaces (None: the kernel's,
        # 200 ms). A host running daemons dilated by k wants k x 200 ms, so that a timeout lasts
        # in their modelled time what it lasts on a real host (pddnet/device/dilation.py).
        self.tcp_rto_min_ms = tcp_rto_min_ms
        self.requested_shell = shell
        self.shell: str | None = None
        self.addr_a, self.addr_b, self.mtu, self.seed = addr_a, addr_b, mtu, seed
        self.state_dir = state_dir or current_state_dir()
        # An owner that holds the testbed only for its own life (a LocalCluster) wants the
        # emulator gone with it even when it is killed; `pdd testbed up` wants it to stay.
        self.die_with_parent = die_with_parent
        self.control_url: str | None = None
        self.emulator_pid: int | None = None
        self._emulator: subprocess.Popen | None = None
        self._children: dict[int, subprocess.Popen] = {}
        self._state: dict[str, Any] = {}
        self._link: LinkHandle | None = None
        self.faults = ProcessFaults(lambda: self._children.keys(), f"testbed {name!r}")

    # --- lifecycle -------------------------------------------------------------------------

    async def __aenter__(self) -> Testbed:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Create the namespaces, start the emulator and wait until its control API serves."""
        reason = unavailable_reason()
        if reason is not None:
            raise PermissionError(f"cannot start testbed {self.name!r}: {reason}")
        for name in await asyncio.to_thread(reap_orphans, self.state_dir):
            log.warning("removed testbed %s: its owner died without closing it", name)
        self._refuse_if_present()
        try:
            await asyncio.to_thread(self._start_sync)
        except BaseException:
            await self.close()
            raise
        self._link = LinkHandle(self.control_url or "")

    def _refuse_if_present(self) -> None:
        state = load_state(self.name, self.state_dir)
        leftovers = [ns for ns in (self.ns_a, self.ns_b) if netns.exists(ns)]
        if state is not None or leftovers:
            what = "its state file" if state is not None else f"namespaces {', '.join(leftovers)}"
            raise FileExistsError(
                f"testbed {self.name!r} is already up or left over ({what} "
                f"exists); run `pdd testbed down --name {self.name}` first"
            )

    def _start_sync(self) -> None:
        self.shell = resolve_shell(self.requested_shell)
        self._state = {
            "name": self.name,
            "phase": "creating",
            "shell": self.shell,
            "namespaces": {"a": self.ns_a, "b": self.ns_b},
            "addr_a": self.addr_a,
            "addr_b": self.addr_b,
            "mtu": self.mtu,
            "effects": self.effects,
            "created_at": time.time(),
            "creator_pid": os.getpid(),
            "control_url": None,
            "emulator": None,
            "processes": [],
            "adopted_namespaces": [],
            "tcp_rto_min_ms": self.tcp_rto_min_ms,
        }
        if self.die_with_parent:  # see reap_orphans
            self._state["owned_by"] = {
                "pid": os.getpid(),
                "start_ticks": proc_start_ticks(os.getpid()),
            }
        # Written before anything is made, so a crash at any point leaves a record for `down`.
        _save_state(self._state, self.state_dir)
        netns.create(self.ns_a)
        netns.create(self.ns_b)
        self.configure_tcp(self.ns_a)
        self.configure_tcp(self.ns_b)
        self._start_emulator()
        self._state["phase"] = "up"
        _save_state(self._state, self.state_dir)

    def _start_emulator(self) -> None:
        ready = _ready_path(self.name, self.state_dir)
        if os.path.exists(ready):
            os.unlink(ready)
        module = "emulation.packet_cli" if self.shell == "packet" else "emulation.kernel_shell"
        argv = [sys.executable, "-m", module]
        if self.shell == "kernel":
            argv.append("serve")
        argv += [
            "--ns-a",
            self.ns_a,
            "--ns-b",
            self.ns_b,
            "--addr-a",
            self.addr_a,
            "--addr-b",
            self.addr_b,
            "--mtu",
            str(self.mtu),
            "--ready-file",
            ready,
            "--seed",
            str(self.seed),
            *_effect_args(self.effects),
        ]
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
        with open(_log_path(self.name, self.state_dir), "ab") as log:
            # Its own session: `pdd testbed up` returns while the emulator keeps running, and a
            # Ctrl-C in the terminal that started it does not reach it.
            self._emulator = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=env,
                start_new_session=True,
                preexec_fn=lifetime.die_with_parent() if self.die_with_parent else None,
            )
        self.emulator_pid = self._emulator.pid
        self._state["emulator"] = {
            "pid": self._emulator.pid,
            "argv": argv,
            "start_ticks": proc_start_ticks(self._emulator.pid),
        }
        _save_state(self._state, self.state_dir)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not os.path.exists(ready):
            if self._emulator.poll() is not None:
                raise RuntimeError(
                    f"the {self.shell} emulator exited with code "
                    f"{self._emulator.returncode}: {self._log_tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the {self.shell} emulator did not become ready within "
                    f"{READY_TIMEOUT_S:.0f} s: {self._log_tail()}"
                )
            time.sleep(0.02)
        with open(ready) as f:
            info = json.load(f)
        self.control_url = info["control_url"]
        self._state["control_url"] = self.control_url

    def _log_tail(self) -> str:
        try:
            with open(_log_path(self.name, self.state_dir), errors="replace") as f:
                return f.read()[-800:].strip() or "(no output)"
        except FileNotFoundError:
            return "(no log)"

    async def close(self) -> dict[str, Any]:
        """End everything this testbed started and remove what it made. Safe to call twice."""
        self.faults.resume_all()
        report = await asyncio.to_thread(teardown, self.name, self.state_dir)
        for proc in [*self._children.values(), *([self._emulator] if self._emulator else [])]:
            try:
                proc.wait(timeout=5)  # reap: no zombies left behind
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._link = None
        return report

    # --- using it --------------------------------------------------------------------------

    def ns(self, side: str) -> str:
        if side not in SIDES:
            raise ValueError(f"side must be 'a' or 'b', got {side!r}")
        return self.ns_a if side == "a" else self.ns_b

    def addr(self, side: str) -> str:
        return self.addr_a if self.ns(side) == self.ns_a else self.addr_b

    def adopt_namespace(self, ns: str) -> None:
        """Record a namespace its owner made around the testbed (e.g. one per host), so that
        teardown removes it with the testbed's own, even after the owner died."""
        self._state.setdefault("adopted_namespaces", []).append(ns)
        _save_state(self._state, self.state_dir)

    def configure_tcp(self, ns: str) -> None:
        """The testbed's TCP settings (`tcp_rto_min_ms`) in namespace `ns`: its own two, and
        any its owner made around it (where the TCP endpoints are then)."""
        if self.tcp_rto_min_ms is not None:
            us = round(self.tcp_rto_min_ms * 1e3)
            netns.write_sysctl(ns, "net.ipv4.tcp_rto_min_us", str(us))

    def exec(self, side: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start argv inside namespace `side` ('a' or 'b'); the process is tracked by PID and
        ended when the testbed closes. popen_kwargs go to subprocess.Popen."""
        ns = self.ns(side)
        if isinstance(argv, (str, bytes)) or not argv:
            raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}")
        if self._state.get("phase") != "up":
            raise RuntimeError(f"testbed {self.name!r} is not up")
        proc = subprocess.Popen(netns.exec_argv(ns, [str(a) for a in argv]), **popen_kwargs)
        self._children[proc.pid] = proc
        self._state["processes"].append(
            {
                "pid": proc.pid,
                "side": side,
                "argv": list(argv),
                "start_ticks": proc_start_ticks(proc.pid),
            }
        )
        _save_state(self._state, self.state_dir)
        return proc

    def socket(
        self, side: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM
    ) -> socket.socket:
        """A socket in namespace `side` (for tests and benchmarks that run in this process)."""
        return netns.socket_in(self.ns(side), family, type)

    @property
    def link(self) -> LinkHandle:
        if self._link is None:
            raise RuntimeError(f"testbed {self.name!r} is not up")
        return self._link

    def processes(self) -> list[dict[str, Any]]:
        return status_processes(self.name)

    def detach(self) -> None:
        """Leave the testbed running after this object goes away (what `pdd testbed up` does):
        `pdd testbed down` removes it later."""
        self._emulator = None
        self._children.clear()


def unavailable_reason() -> str | None:
    """Why a testbed cannot run here (None when it can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    return None


def status_processes(name: str) -> list[dict[str, Any]]:
    """Processes inside the testbed's namespaces, and its emulator."""
    out = []
    for side, ns in zip(SIDES, namespaces_of(name), strict=True):
        if netns.exists(ns):
            out += [
                {"pid": pid, "where": side, "cmdline": " ".join(_cmdline(pid))}
                for pid in netns.pids_in(ns)
            ]
    out += [
        {"pid": pid, "where": "emulator", "cmdline": " ".join(_cmdline(pid))}
        for pid in find_emulators(name)
    ]
    return out


async def status(name: str, directory: str | None = None) -> dict[str, Any]:
    """What `pdd testbed status` shows: the state file, the link (effects and counters from the
    control API) and the processes."""
    from emulation.control import ControlClient

    state = load_state(name, directory)
    ns_present = [ns for ns in namespaces_of(name) if netns.exists(ns)]
    out: dict[str, Any] = {
        "name": name,
        "up": False,
        "state": state,
        "namespaces": ns_present,
        "processes": status_processes(name),
        "link": None,
    }
    emulator = (state or {}).get("emulator")
    out["emulator_alive"] = bool(emulator and _same_process(emulator))
    url = (state or {}).get("control_url")
    if url and out["emulator_alive"]:
        try:
            out["link"] = await ControlClient(url, timeout=3.0).show()
        except Exception as exc:  # report, do not fail: status is for diagnosing
            out["link_error"] = f"{type(exc).__name__}: {exc}"
    out["up"] = bool(out["emulator_alive"] and len(ns_present) == 2 and out["link"] is not None)
    return out
