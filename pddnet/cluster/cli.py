"""`pdd up`, `pdd serve ROLE`, `pdd status`: a whole local cluster, one daemon, what is running.

Importing this module imports nothing heavy; handlers import what they need when they run.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any, NoReturn

from pddnet.device import flags as device_flags
from pddnet.model.cli import MODEL_HELP, MODEL_METAVAR

SERVE_ROLES = {
    "prefill": "prefill",
    "relay": "relay",
    "main-decode": "main_decode",
    "router": "router",
}


MODES = ("pdd", "cross-dc", "same-dc")
WAN_SHELLS = ("auto", "kernel", "packet", "proxy")
SHM_OR_MC, TCP_OR_MC = ("shm", "mooncake"), ("tcp", "mooncake")  # KV backends in / across DCs


def _config_option(
    p: argparse.ArgumentParser,
    flag: str,
    what: str,
    otherwise: str,
    key: str = "",
    **kwargs: Any,
) -> None:
    """An option of `pdd up` that overrides the cluster TOML: unset (None), the value is
    --config's (its `key`, named in the help when it is not obvious), else `otherwise`."""
    source = f"--config's {key}".strip()
    p.add_argument(
        flag, default=None, help=f"{what} (default: {source}, else {otherwise})", **kwargs
    )


def register(sub: argparse._SubParsersAction) -> None:
    up = sub.add_parser(
        "up",
        help="start a whole local cluster (router, P, RLD, MD, the WAN between them)",
        description="Start router, P, RLD (not in cross-dc) and MD as separate processes, joined "
        "by the emulated WAN; print the endpoint; stop everything on Ctrl-C/SIGTERM.",
    )
    up.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="cluster TOML; the flags below override it (default: none, built-in defaults)",
    )
    option = functools.partial(_config_option, up)
    option("--mode", "PDD or one of its two baselines", "pdd", "mode", choices=MODES)
    option("--model", MODEL_HELP, "tiny", "[model] name", metavar=MODEL_METAVAR)
    option("--rtt-ms", "WAN round trip", "30", type=float)
    option("--jitter-ms", "WAN jitter per direction", "0", type=float)
    option("--bw-mbit", "WAN rate per direction", "1000", type=float)
    option("--port", "router HTTP port", "8000", type=int)
    option("--wan", "WAN shell", "auto: kernel, else packet, else proxy", choices=WAN_SHELLS)
    run_dir = "where the run file, config and logs go"
    option("--run-dir", run_dir, "runs/<name>", "run_dir", metavar="DIR")
    option("--threads", "torch threads per daemon", "1", type=int)
    to_rld = "KV backend P -> RLD"
    option("--intra-dc-transport", to_rld, "shm", "[transport] intra_dc", choices=SHM_OR_MC)
    option("--wan-transport", "KV backend P -> MD", "tcp", "[transport] wan", choices=TCP_OR_MC)
    up.add_argument(
        "--placement",
        choices=["datacenter", "hosts"],
        default="datacenter",
        help="datacenter: daemons share their datacenter's namespace; hosts: one "
        "namespace per daemon, as on separate machines (needs --wan packet|"
        "kernel)",
    )
    device_flags.add_arguments(up)
    up.set_defaults(handler=_up)

    serve = sub.add_parser(
        "serve",
        help="run one daemon (prefill|relay|main-decode|router)",
        description="Run one pddnet daemon until SIGTERM/SIGINT.",
    )
    serve.add_argument("role", choices=sorted(SERVE_ROLES), help="the daemon to run")
    serve.add_argument(
        "--config",
        required=True,
        metavar="FILE",
        help="cluster TOML (the same file on every host; docs/deploy.md)",
    )
    serve.add_argument(
        "--stats-file",
        default=None,
        metavar="PATH",
        help="write the daemon's stats here at start, on SIGUSR1 and at exit (default: none)",
    )
    serve.set_defaults(handler=_serve)

    status = sub.add_parser(
        "status",
        help="show the daemons of a cluster (`pdd up`'s run file, or any cluster from its config)",
    )
    status.add_argument(
        "--run-dir",
        default="runs/pdd",
        metavar="DIR",
        help="the run folder `pdd up` printed (its run.json)",
    )
    status.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="ask the cluster this file describes (from any host that reaches "
        "it): the router's /health and each daemon's port (default: none, "
        "read --run-dir)",
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.set_defaults(handler=_status)


# -- pdd up ---------------------------------------------------------------------------------------


def up_overrides(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "mode": args.mode,
        "model.name": args.model,
        "wan.rtt_ms": args.rtt_ms,
        "wan.jitter_ms": args.jitter_ms,
        "wan.bw_mbit": args.bw_mbit,
        "router.port": args.port,
        "wan.shell": args.wan,
        "run_dir": args.run_dir,
        "model.threads": args.threads,
        "transport.intra_dc": args.intra_dc_transport,
        "transport.wan": args.wan_transport,
        **device_flags.overrides(args),
    }


def _up(args: argparse.Namespace) -> int:

    from pddnet.config import ConfigError, load_config

    try:
        config = load_config(args.config, up_overrides(args))
        device_flags.resolve_auto(config, args)
    except (ConfigError, argparse.ArgumentTypeError) as exc:
        print(f"pdd up: {exc}", file=sys.stderr)
        return 2
    if args.run_dir is None and args.config is None:
        config.run_dir = os.path.join("runs", config.name)
    return _run_loop(_up_async(config, args.placement))


def _run_loop(coro: Any) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover
        import asyncio

        return asyncio.run(coro)
    return uvloop.run(coro)


async def _up_async(config: Any, placement: str = "datacenter") -> int:
    import asyncio
    import signal

    from pddnet.cluster.launcher import ClusterLauncher, ClusterStartError
    from pddnet.cluster.wan_setup import WanUnavailable

    launcher = ClusterLauncher(config, config.run_dir, placement=placement)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    start = asyncio.create_task(launcher.start())
    waiter = asyncio.create_task(stop.wait())
    await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if not start.done():  # signalled while starting
        start.cancel()
        await asyncio.gather(start, return_exceptions=True)
        await launcher.stop()
        print("pdd up: interrupted while starting; everything stopped", file=sys.stderr)
        return 130
    try:
        info = start.result()
    except (
        ClusterStartError,
        WanUnavailable,
        TimeoutError,
        OSError,
        ValueError,
        RuntimeError,
    ) as exc:
        print(f"pdd up: {exc}", file=sys.stderr)
        return 1
    _print_up(info)
    await waiter
    print("pdd up: stopping ...", flush=True)
    report = await launcher.stop()
    if report.killed:
        roles = {d.pid: r for r, d in launcher.daemons.items()}
        named = ", ".join(f"{roles.get(pid, '?')} (pid {pid})" for pid in report.killed)
        print(
            f"pdd up: had to SIGKILL {named}: it did not stop within the grace period "
            f"after SIGTERM (its log is in {launcher.run_dir})",
            file=sys.stderr,
        )
    if report.leftover_shm:
        print(
            f"pdd up: removed shared-memory segments the daemons left: "
            f"{', '.join(report.leftover_shm)}",
            file=sys.stderr,
        )
    print("pdd up: stopped (no daemon left running)", flush=True)
    return 0


def describe_emulation(emu: dict[str, Any]) -> str:
    """One line naming the device profiles and k behind every time a cluster reports."""
    devices = ", ".join(f"{r} {d}" for r, d in emu["devices"].items())
    return (
        f"emulated {emu['target_model']} on {devices}; dilation k = {emu['dilation']:g} "
        f"(times reported / k)"
    )


def _print_up(info: dict[str, Any]) -> None:
    wan = info["wan"]
    print(f"pddnet cluster {info['name']!r} up, mode {info['mode']}, model {info['model']}")
    print(f"  endpoint:  {info['router_url']}/v1/completions   (OpenAI-compatible)")
    print(f"  WAN shell: {wan['shell']} -- {wan['reason']}")
    transport = ", ".join(f"{path} {name}" for path, name in info.get("transport", {}).items())
    print(f"  KV transport: {transport}")
    emu = info.get("emulation")
    print(
        "  devices:   "
        + (
            describe_emulation(emu)
            if emu
            else "unpaced: every time is this box's own (no --target-model)"
        )
    )
    if wan.get("control_url"):
        print(
            f"  WAN control: {wan['control_url']}   (pdd wan show --control {wan['control_url']})"
        )
    for d in info["daemons"]:
        where = f" in netns {d['namespace']}" if d.get("namespace") else ""
        print(
            f"  {d['role']:<12} pid {d['pid']:<7} port {d['port']:<6} address "
            f"{d['address']:<22} threads {d['threads']}{where}"
        )
    print(f"  run file:  {os.path.join(info['run_dir'], 'run.json')}")
    print("Ctrl-C or SIGTERM stops everything.", flush=True)


# -- pdd serve ------------------------------------------------------------------------------------


def _serve(args: argparse.Namespace) -> int:
    from pddnet.config import ConfigError, load_config

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"pdd serve: {exc}", file=sys.stderr)
        return 2
    role = SERVE_ROLES[args.role]
    _setup_logging(role)
    _limit_threads(config.model.threads, role)
    if role == "router":  # no model and no KV transport here: it starts without loading torch
        _exit_after_close(_run_loop(serve_daemon(role, config, args.stats_file)) or 0)
    from pddnet.transport.kv_backend import TransferError

    try:
        code = _run_loop(serve_daemon(role, config, args.stats_file)) or 0
    except TransferError as exc:  # a KV backend that cannot run here: say why, at start
        print(f"pdd serve {args.role}: cannot start its KV transport: {exc}", file=sys.stderr)
        return 1
    _exit_after_close(code)


def _exit_after_close(code: int) -> NoReturn:
    """End a daemon whose close() has released everything it held (connections, the engine
    thread, the KV pool and its shared-memory segment, the transport's registrations): skip
    the interpreter's teardown of torch and the other modules, which was 1.2 s of every
    daemon's 1.3 s from SIGTERM to exit (its close: 10 ms), paid by every `pdd up` stop."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _setup_logging(role: str) -> None:
    import logging

    logging.basicConfig(
        level=os.environ.get("PDD_LOG_LEVEL", "INFO"),
        format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
    )


def _limit_threads(threads: int, role: str) -> None:
    if role == "router":
        return  # the router never imports torch
    import torch

    torch.set_num_threads(threads)


def build_daemon(role: str, config: Any) -> Any:
    """The daemon object for a role: the router, or P / RLD / MD from pddnet.roles."""
    if role == "router":
        from pddnet.roles.router import Router

        return Router(config)
    from pddnet.roles import make_daemon

    return make_daemon(role, config)


class StatsFile:
    """The daemon's stats as JSON, rewritten atomically with a rising `seq`."""

    def __init__(self, path: str, role: str, daemon: Any) -> None:
        self.path, self.role, self.daemon, self.seq = path, role, daemon, 0

    def write(self, state: str) -> None:
        self.seq += 1
        try:
            stats = {**self.daemon.stats(), "gc": gc_report()}
        except Exception as exc:  # a stats bug must not kill the daemon
            stats = {"error": f"{type(exc).__name__}: {exc}"}
        body = {
            "role": self.role,
            "pid": os.getpid(),
            "state": state,
            "seq": self.seq,
            "time": time.time(),
            "stats": stats,
        }
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(body, f, default=str)
        os.replace(tmp, self.path)


def freeze_start_up() -> None:
    """Move what start-up built out of the garbage collector's reach: it lives as long as the
    daemon. A full collection scanned all of it (~176K objects of torch, the model, the engine:
    ~70 ms, after six 50-60K-token prompts too), a pause that lands in whatever forward or
    network read is running (paced: an overrun when it exceeds the wait; unpaced: a
    latency spike); frozen, one takes ~1 ms. Servers do the same after start-up."""
    import gc

    gc.collect()
    gc.freeze()


def gc_report() -> dict[str, Any]:
    """The collector's view for the stats: objects frozen at start-up, collections per
    generation since."""
    import gc

    return {
        "frozen_objects": gc.get_freeze_count(),
        "collections": [g["collections"] for g in gc.get_stats()],
    }


async def serve_daemon(role: str, config: Any, stats_file: str | None) -> int:
    """Start one daemon, serve until SIGTERM/SIGINT, close it. SIGUSR1 refreshes the stats."""
    import asyncio
    import signal

    daemon = build_daemon(role, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    stats = StatsFile(stats_file, role, daemon) if stats_file else None
    if stats is not None:
        loop.add_signal_handler(signal.SIGUSR1, lambda: stats.write("serving"))
    try:
        start = asyncio.create_task(daemon.start())
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({start, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not start.done():
            start.cancel()
            await asyncio.gather(start, return_exceptions=True)
            return 0
        start.result()
        freeze_start_up()
        if stats is not None:
            stats.write("serving")
        serve = asyncio.create_task(daemon.serve_forever())
        await asyncio.wait({serve, waiter}, return_when=asyncio.FIRST_COMPLETED)
        serve.cancel()
        await asyncio.gather(serve, return_exceptions=True)
        return 0
    finally:
        await daemon.close()
        if stats is not None:
            stats.write("stopped")


# -- pdd status -----------------------------------------------------------------------------------


def status_of(run_dir: str) -> dict[str, Any]:
    import urllib.error
    import urllib.request

    from emulation.netns import pid_alive
    from pddnet.cluster.launcher import read_run_file

    info = read_run_file(run_dir)
    out: dict[str, Any] = {
        "run_dir": run_dir,
        "state": info.get("state"),
        "mode": info["mode"],
        "router_url": info["router_url"],
        "wan": info["wan"],
        "daemons": [],
        "transport": info.get("transport"),
    }
    out["emulation"] = info.get("emulation")
    for d in info["daemons"]:
        alive = pid_alive(d["pid"])
        device = fresh_stats(d).get("device") if alive and d["role"] != "router" else None
        out["daemons"].append({**d, "alive": alive, **({"device": device} if device else {})})
    health: dict[str, Any] | None
    try:
        with urllib.request.urlopen(f"{info['router_url']}/health", timeout=3) as r:
            health = {**json.loads(r.read()), "http_status": r.status}
    except urllib.error.HTTPError as exc:
        health = {**json.loads(exc.read() or b"{}"), "http_status": exc.code}
    except (OSError, ValueError) as exc:
        health = {"http_status": None, "error": str(exc)}
    out["health"] = health
    return out


def fresh_stats(daemon: dict[str, Any], timeout: float = 2.0) -> dict[str, Any]:
    """A daemon's stats() from its stats file, refreshed by SIGUSR1 (pdd up's daemons); {} when
    it does not answer in time."""
    import signal

    def read() -> dict[str, Any]:
        try:
            with open(daemon["stats_file"]) as f:
                return json.load(f)
        except (OSError, ValueError, KeyError):
            return {}

    before = read().get("seq", -1)
    try:
        os.kill(daemon["pid"], signal.SIGUSR1)
    except OSError:
        return {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = read()
        if info.get("seq", -1) > before:
            return info.get("stats") or {}
        time.sleep(0.02)
    return {}


def describe_device(dev: dict[str, Any]) -> str:
    """A daemon's modelled device and how well this box kept up with it."""
    if not dev.get("emulated"):
        return "unpaced"
    text = (
        f"{dev['gpus']} x {dev['chip']}: {dev['steps']} steps, {dev['overruns']} overran "
        f"({dev['overrun_share']:.1%}), {dev['overrun_lost_s']:.3f} s lost"
    )
    if not dev.get("valid", True):
        text += f" -- NOT VALID above 1%: rerun with --dilation {dev['dilation_needed']:g} or more"
    return text


def status_from_config(path: str, timeout: float = 3.0) -> dict[str, Any]:
    """What a cluster.toml's addresses answer: each daemon's port (a TCP connect, no handshake)
    and the router's /health, which lists what the router itself sees."""
    import socket
    import urllib.error
    import urllib.request

    from pddnet.config import load_config

    cfg = load_config(path)
    roles = {
        "pdd": ("prefill", "relay", "main_decode"),
        "cross-dc": ("prefill", "main_decode"),
        "same-dc": ("prefill", "relay"),
    }[cfg.mode.value]
    daemons = []
    for role in roles:
        host, port = getattr(cfg, role).dial_address()
        try:
            with socket.create_connection((host, port), timeout=timeout):
                reachable, error = True, None
        except OSError as exc:
            reachable, error = False, str(exc)
        daemons.append(
            {
                "role": role,
                "address": f"{host}:{port}",
                "alive": reachable,
                **({"error": error} if error else {}),
            }
        )
    url = f"http://{cfg.router.host}:{cfg.router.port}"
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout) as r:
            health = {**json.loads(r.read()), "http_status": r.status}
    except urllib.error.HTTPError as exc:
        health = {**json.loads(exc.read() or b"{}"), "http_status": exc.code}
    except (OSError, ValueError) as exc:
        health = {"http_status": None, "error": str(exc)}
    transport = {"pdd": ("intra_dc", "wan"), "cross-dc": ("wan",), "same-dc": ("intra_dc",)}[
        cfg.mode.value
    ]
    return {
        "config": path,
        "state": "reachable" if all(d["alive"] for d in daemons) else "unreachable",
        "mode": cfg.mode.value,
        "router_url": url,
        "wan": {"shell": "configured"},
        "daemons": daemons,
        "health": health,
        "transport": {p: cfg.transport.backend_of(p) for p in transport},
    }


def _status(args: argparse.Namespace) -> int:
    try:
        st = status_from_config(args.config) if args.config else status_of(args.run_dir)
    except (FileNotFoundError, ValueError) as exc:  # ConfigError is a ValueError
        print(f"pdd status: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(st, indent=2))
    else:
        where = st.get("run_dir") or st.get("config")
        print(
            f"cluster in {where}: {st['state']}, mode {st['mode']}, router "
            f"{st['router_url']}, WAN {st['wan']['shell']}, KV transport "
            f"{', '.join(f'{k} {v}' for k, v in (st.get('transport') or {}).items())}"
        )
        if st.get("emulation"):
            print(f"  devices: {describe_emulation(st['emulation'])}")
        for d in st["daemons"]:
            device = f"  {describe_device(d['device'])}" if d.get("device") else ""
            print(
                f"  {d['role']:<12} pid {d.get('pid', '-')!s:<7} "
                f"{('alive' if d['alive'] else 'DEAD'):<6} "
                f"{d['address']}{device}"
            )
        h = st["health"]
        brief = {k: v for k, v in h.items() if k not in ("http_status", "links", "waiting_for")}
        verdict = "ready" if h.get("http_status") == 200 else "NOT READY"
        print(f"  /health: HTTP {h.get('http_status')} {verdict} {json.dumps(brief)}")
        for line in h.get("waiting_for") or []:
            print(f"    waiting for {line}")
    alive = all(d["alive"] for d in st["daemons"])
    return 0 if alive and st["health"].get("http_status") == 200 else 1
