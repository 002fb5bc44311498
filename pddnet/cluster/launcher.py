"""Start, find and stop a whole cluster: the daemons as separate OS processes plus the WAN.

`ClusterLauncher(config, run_dir)`:
  1. chooses the WAN shell (wan_setup.choose_wan) and where each daemon runs,
  2. picks free ports for daemons whose port is 0, fills in MD's dial address (the proxy, or the
     testbed's B address) and a fresh shared secret, and writes the effective config to
     `<run_dir>/cluster.toml`,
  3. brings the WAN up, starts `python -m pddnet serve ROLE --config ... --stats-file ...` for
     every daemon of the mode, and waits until each reports "serving" and the router's /health
     is ok,
  4. writes the run file `<run_dir>/run.json` (each daemon's role, PID, address, port, the router
     URL, the WAN control URL and shell) -- tests and `pdd status` find daemons there.
`stop()` ends every daemon by PID (SIGTERM, SIGKILL after a grace period), takes the WAN down
(removing testbed namespaces it made) and checks that no /dev/shm/pdd-* segment of its daemons
is left.

Daemon stats: each daemon process writes `daemon.stats()` into its stats file when it starts,
on SIGUSR1 and when it stops; `stats(role)` signals it and waits for the fresh copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import secrets
import signal
import sys
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from pddnet.cluster.wan_setup import (
    Placement,
    WanChoice,
    child_env,
    choose_wan,
    free_port,
    make_placement,
    stop_processes,
)
from pddnet.config import ClusterConfig, ClusterMode
from pddnet.kv.shm import segments_of, unlink_segment

ROLES_BY_MODE: dict[ClusterMode, tuple[str, ...]] = {
    # Start order: MD never dials anyone, the router dials everyone.
    ClusterMode.PDD: ("main_decode", "relay", "prefill", "router"),
    ClusterMode.SAME_DC: ("relay", "prefill", "router"),
    ClusterMode.CROSS_DC: ("main_decode", "prefill", "router"),
}
CLI_ROLE = {
    "prefill": "prefill",
    "relay": "relay",
    "main_decode": "main-decode",
    "router": "router",
}
RUN_FILE = "run.json"
CONFIG_FILE = "cluster.toml"


class ClusterStartError(RuntimeError):
    """A daemon or the WAN did not come up; the message carries its log tail."""


@dataclass
class Daemon:
    role: str
    pid: int
    host: str
    port: int
    address: str  # how peers reach it ("HOST:PORT"; MD: through the WAN)
    namespace: str | None
    threads: int
    log: str
    stats_file: str
    proc: Any = field(repr=False, default=None)
    metrics_port: int | None = None  # the router serves /metrics on its own port

    def describe(self) -> dict[str, Any]:
        """What the run file says of the daemon: every field but the process handle."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "proc"}


@dataclass
class StopReport:
    killed: list[int]  # PIDs that needed SIGKILL
    leftover_shm: list[str]  # pdd-* segments of our daemons found after they stopped
    exit_codes: dict[str, int | None]


def read_run_file(run_dir: str | Path) -> dict[str, Any]:
    path = Path(run_dir) / RUN_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(
            f"no run file at {path}: is a cluster up with --run-dir {run_dir}?"
        ) from None


class ClusterLauncher:
    def __init__(
        self,
        config: ClusterConfig,
        run_dir: str | Path | None = None,
        wan: str | None = None,
        python: str = sys.executable,
        placement: str = "datacenter",
    ) -> None:
        self.config = config
        self.placement_name = placement
        self.run_dir = Path(run_dir or config.run_dir).resolve()
        self.requested_wan = wan or config.wan.shell
        self.python = python
        self.choice: WanChoice | None = None
        self.placement: Placement | None = None
        self.daemons: dict[str, Daemon] = {}
        self.router_url: str | None = None
        self.stop_report: StopReport | None = None
        self._stats_seq: dict[str, int] = {}
        self._not_ready: list[str] = []  # what the router's /health last said it waits for

    @property
    def roles(self) -> tuple[str, ...]:
        return ROLES_BY_MODE[self.config.mode]

    @property
    def run_file(self) -> Path:
        return self.run_dir / RUN_FILE

    @property
    def config_file(self) -> Path:
        return self.run_dir / CONFIG_FILE

    # -- start ------------------------------------------------------------------------------------

    async def start(self, timeout: float = 120.0) -> dict[str, Any]:
        """Bring the cluster up; returns the run file's content. On failure everything already
        started is stopped again before the error propagates."""
        try:
            return await self._start(timeout)
        except BaseException:
            await self.stop(grace_s=2.0)
            raise

    async def _start(self, timeout: float) -> dict[str, Any]:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(exist_ok=True)
        self.choice = choose_wan(self.requested_wan, cfg.mode)
        cfg.wan.shell = self.choice.shell if self.choice.shell != "none" else cfg.wan.shell
        cfg.run_dir = str(self.run_dir)
        if not cfg.secret:
            cfg.secret = secrets.token_hex(16)
        for role in self.roles:
            sec = getattr(cfg, role)
            if sec.port == 0:
                sec.port = free_port()
            if role != "router" and not sec.metrics_port:  # pdd up: /metrics on every daemon
                sec.metrics_port = free_port()
        self.placement = make_placement(self.choice, cfg, self.placement_name)
        self.placement.prepare(cfg)
        if hasattr(self.placement, "log_path"):
            self.placement.log_path = str(self.run_dir / "logs" / "wan.log")
        self._write_config()
        await self.placement.start()
        self._write_config()  # the WAN control address is known now
        for role in self.roles:  # all at once: each dialler retries until its peer listens
            self._spawn(role)
        self.router_url = await self.placement.expose_router(cfg.router.port)
        self._write_run_file(state="starting")
        await self._wait_ready(timeout)
        self._write_run_file(state="up")
        return self.run_info()

    def _write_config(self) -> None:
        path = self.config_file
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the secret
        with os.fdopen(fd, "w") as f:
            f.write(self.config.to_toml())

    def _spawn(self, role: str) -> None:
        assert self.placement is not None
        cfg = self.config
        logs = self.run_dir / "logs"
        stats_file = str(self.run_dir / f"stats-{role}.json")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(stats_file)
        argv = [
            self.python,
            "-m",
            "pddnet",
            "serve",
            CLI_ROLE[role],
            "--config",
            str(self.config_file),
            "--stats-file",
            stats_file,
        ]
        log_path = str(logs / f"{role}.log")
        with open(log_path, "ab") as log:
            proc = self.placement.spawn(
                role,
                argv,
                stdout=log,
                stderr=log,
                env=child_env(cfg.model.threads),
                cwd=str(self.run_dir),
            )
        sec = getattr(cfg, role)
        if role == "router":
            address = f"{sec.host}:{sec.port}"
        else:
            host, port = sec.dial_address()
            address = f"{host}:{port}"
        self.daemons[role] = Daemon(
            role=role,
            pid=proc.pid,
            host=sec.host,
            port=sec.port,
            address=address,
            namespace=self.placement.namespace(role),
            threads=cfg.model.threads,
            log=log_path,
            stats_file=stats_file,
            proc=proc,
            metrics_port=getattr(sec, "metrics_port", None),
        )

    async def _wait_ready(
        self, timeout: float, roles: set[str] | None = None, health: bool = True
    ) -> None:
        import aiohttp

        deadline = time.monotonic() + timeout
        pending = set(roles or self.daemons)
        async with aiohttp.ClientSession() as session:
            while True:
                self._check_alive()
                for role in list(pending):
                    info = self._read_stats(role)
                    if info and info.get("state") == "serving":
                        pending.discard(role)
                if not pending and (not health or await self._healthy(session)):
                    return
                if time.monotonic() > deadline:
                    what = ", ".join(sorted(pending)) or "; ".join(
                        ["the router's /health", *self._not_ready]
                    )
                    raise ClusterStartError(
                        f"cluster not ready within {timeout:g} s (waiting "
                        f"for {what})\n{self._log_tails(pending or {'router'})}"
                    )
                await asyncio.sleep(0.1)

    async def _healthy(self, session: Any) -> bool:
        import aiohttp

        try:
            async with session.get(
                f"{self.router_url}/health", timeout=aiohttp.ClientTimeout(total=3)
            ) as r:
                if r.status != 200:  # what it waits for, for the error if it never comes
                    with contextlib.suppress(ValueError, aiohttp.ClientError):
                        self._not_ready = (await r.json()).get("waiting_for") or []
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            self._not_ready = [f"the router's /health did not answer: {exc or type(exc).__name__}"]
            return False

    def _check_alive(self) -> None:
        dead = {r: d.proc.returncode for r, d in self.daemons.items() if d.proc.poll() is not None}
        if dead:
            which = ", ".join(f"{r} (exit code {c})" for r, c in dead.items())
            raise ClusterStartError(f"daemon exited during start: {which}\n{self._log_tails(dead)}")

    def _log_tails(self, roles: Any, chars: int = 2000) -> str:
        out = []
        for role in sorted(roles):
            d = self.daemons.get(role)
            if d is None:
                continue
            try:
                text = Path(d.log).read_text(errors="replace")[-chars:]
            except FileNotFoundError:
                text = "(no log)"
            out.append(f"--- {role} log ({d.log}) ---\n{text.strip()}")
        return "\n".join(out)

    def run_info(self, state: str = "up") -> dict[str, Any]:
        assert self.placement is not None
        return {
            "name": self.config.name,
            "mode": self.config.mode.value,
            "state": state,
            "launcher_pid": os.getpid(),
            "started_at": time.time(),
            "run_dir": str(self.run_dir),
            "config": str(self.config_file),
            "router_url": self.router_url,
            "wan": self.placement.describe(),
            "model": self.config.model.name,
            "transport": self.transport(),
            "emulation": (e.describe() if (e := self.config.emulation()) else None),
            "daemons": [d.describe() for d in self.daemons.values()],
        }

    def transport(self) -> dict[str, str]:
        """The KV backend of each path this mode uses (P -> RLD: intra_dc, P -> MD: wan)."""
        t = self.config.transport
        paths = {
            ClusterMode.PDD: ("intra_dc", "wan"),
            ClusterMode.SAME_DC: ("intra_dc",),
            ClusterMode.CROSS_DC: ("wan",),
        }[self.config.mode]
        return {path: t.backend_of(path) for path in paths}

    def _write_run_file(self, state: str) -> None:
        tmp = self.run_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.run_info(state), indent=2) + "\n")
        os.replace(tmp, self.run_file)

    # -- while it runs ----------------------------------------------------------------------------

    def _read_stats(self, role: str) -> dict[str, Any] | None:
        try:
            return json.loads(Path(self.daemons[role].stats_file).read_text())
        except (FileNotFoundError, ValueError):
            return None

    async def stats(self, role: str, timeout: float = 10.0) -> dict[str, Any]:
        """A fresh `stats()` of one daemon: SIGUSR1, then wait for its stats file to update."""
        d = self.daemons[role]
        before = (self._read_stats(role) or {}).get("seq", -1)
        os.kill(d.pid, signal.SIGUSR1)
        deadline = time.monotonic() + timeout
        while True:
            info = self._read_stats(role)
            if info is not None and info.get("seq", -1) > before:
                return info["stats"]
            if d.proc.poll() is not None:
                raise RuntimeError(f"{role} is not running (exit code {d.proc.returncode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{role} did not refresh its stats within {timeout:g} s")
            await asyncio.sleep(0.02)

    def alive(self) -> dict[str, bool]:
        return {r: d.proc.poll() is None for r, d in self.daemons.items()}

    # -- stop -------------------------------------------------------------------------------------

    async def restart(self, role: str, timeout: float = 60.0) -> Daemon:
        """Start a daemon that died (or was killed) again, same config, ports and namespace,
        and wait until it serves; the others are not touched (they redial it)."""
        if role not in self.daemons:
            raise ValueError(f"no daemon {role!r} in this cluster ({', '.join(self.daemons)})")
        old = self.daemons[role]
        if old.proc is not None and old.proc.poll() is None:
            raise RuntimeError(f"{role} (pid {old.pid}) is still running: stop it first")
        for name in segments_of([old.pid]):  # a killed RLD's pool: its owner is dead
            unlink_segment(name)
        self._spawn(role)
        await self._wait_ready(timeout, roles={role}, health=False)
        self._write_run_file(state="up")  # the new pid
        return self.daemons[role]

    async def stop(self, grace_s: float = 5.0) -> StopReport:
        """Stop every daemon (router first), then the WAN; idempotent."""
        order = [r for r in ("router", "prefill", "relay", "main_decode") if r in self.daemons]
        procs = [self.daemons[r].proc for r in order]
        killed = await asyncio.to_thread(stop_processes, procs, grace_s) if procs else []
        if self.placement is not None:
            with contextlib.suppress(Exception):
                await self.placement.close()
        pids = [d.pid for d in self.daemons.values()]
        leftovers = segments_of(pids)
        for name in leftovers:  # the owners are dead: nobody else will ever unlink these
            unlink_segment(name)
        report = StopReport(
            killed=killed,
            leftover_shm=leftovers,
            exit_codes={r: d.proc.returncode for r, d in self.daemons.items()},
        )
        self.stop_report = report
        if self.run_file.exists() and self.placement is not None:
            info = self.run_info(state="stopped")
            info["stopped_at"] = time.time()
            info["stop"] = {
                "killed": killed,
                "leftover_shm": leftovers,
                "exit_codes": report.exit_codes,
            }
            with contextlib.suppress(OSError):
                self.run_file.write_text(json.dumps(info, indent=2) + "\n")
        return report
