"""The fork servers (pddnet/cluster/forkserver.py): a forked daemon runs as its command line
would, answers as a Popen does, dies with the process that started it, and a local cluster's
processes are forks (P / RLD / MD of the server with torch; the router and the WAN proxy of the
one without: they must never map torch)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from emulation.netns import pid_alive
from pddnet.cluster import forkserver
from pddnet.cluster.local import LocalCluster
from pddnet.cluster.wan_setup import child_env, free_port
from pddnet.config import load_config
from tests.polling import wait_for_sync

ROOT = Path(__file__).resolve().parents[1]
TORCH = forkserver.TORCH_DAEMONS


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _md_argv(tmp_path: Path) -> list[str]:
    """`pdd serve main-decode` (it dials nobody, so it serves alone) with its stats file."""
    overrides = {"model.name": "tiny", "main_decode.port": free_port(), "secret": "s" * 32}
    cfg = load_config(None, overrides)
    (tmp_path / "cluster.toml").write_text(cfg.to_toml())
    return [sys.executable, "-m", "pddnet", "serve", "main-decode", "--config", "cluster.toml"]


def _serving(stats: Path) -> bool:
    try:
        return json.loads(stats.read_text())["state"] == "serving"
    except (FileNotFoundError, ValueError):
        return False


def _wait_serving(proc: forkserver.ForkedProcess, stats: Path, log: Path) -> None:
    wait_for_sync(lambda: _serving(stats) or proc.poll() is not None, 60, "MD serving", 0.05)
    assert proc.poll() is None, log.read_text()


def test_a_fork_runs_its_command_line_with_the_given_cwd_env_and_log(tmp_path):
    log_path = tmp_path / "log"
    env = {**child_env(1), "PDD_LOG_LEVEL": "WARNING"}
    argv = _md_argv(tmp_path) + ["--stats-file", "stats.json"]  # both relative to cwd
    with open(log_path, "ab") as log:
        proc = forkserver.spawn(argv, env, str(tmp_path), log, TORCH)
    try:
        _wait_serving(proc, tmp_path / "stats.json", log_path)
        assert proc.returncode is None
        with pytest.raises(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)
        server = forkserver.server_for(env, TORCH)
        fields = _stat(proc.pid)
        assert int(fields[1]) == server.proc.pid  # forked by the server
        assert int(fields[3]) == proc.pid  # its own session, as Popen(start_new_session=True)
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
        assert cmdline == [a.encode() for a in argv]  # what ps shows: its own command line
        # no torch import of its own: the server's ~3.5 s of CPU are not paid again
        assert int(fields[11]) / os.sysconf("SC_CLK_TCK") < 2.5
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SIGTERM: a clean close
    finally:
        proc.kill()
    # the given environment, read when the daemon set up its logging: no INFO lines
    assert " INFO " not in log_path.read_text()
    assert json.loads((tmp_path / "stats.json").read_text())["state"] == "stopped"
    proc.kill()  # a reaped child is never signalled (its PID may be someone else's now)


def test_exit_codes_and_signals_read_as_popen_reads_them(tmp_path):
    env = child_env(1)
    with open(tmp_path / "log", "ab") as log:
        bad = forkserver.spawn(
            [sys.executable, "-m", "pddnet", "serve", "relay", "--config", "missing.toml"],
            env,
            str(tmp_path),
            log,
            TORCH,
        )
        # an environment that differs only in what no import reads: the same server
        other = {**env, "PYTEST_CURRENT_TEST": "another test"}
        killed = forkserver.spawn(_md_argv(tmp_path), other, str(tmp_path), log, TORCH)
    assert forkserver.server_for(other, TORCH) is forkserver.server_for(env, TORCH)
    assert bad.wait(timeout=30) == 2  # pdd serve's exit code for a config error
    assert "pdd serve:" in (tmp_path / "log").read_text()
    os.kill(killed.pid, signal.SIGKILL)  # as the chaos tests kill daemons: by PID
    assert killed.wait(timeout=30) == -signal.SIGKILL
    assert not forkserver.forkable([sys.executable, "-m", "pddnet.bench"])
    assert not forkserver.forkable(["/other/python", "-m", "pddnet", "serve", "relay"])


LAUNCHER = """
import json, sys
from emulation.netns import pid_alive
from pddnet.cluster import forkserver
from pddnet.cluster.wan_setup import child_env
argv = [sys.executable, "-m", "pddnet", "serve", "main-decode", "--config", "cluster.toml",
        "--stats-file", "stats.json"]
with open("log", "ab") as log:
    proc = forkserver.spawn(argv, child_env(1), ".", log, forkserver.TORCH_DAEMONS)
server = forkserver.server_for(child_env(1), forkserver.TORCH_DAEMONS)
print(json.dumps([server.proc.pid, proc.pid]), flush=True)
sys.stdin.read()
"""


def test_the_server_and_its_daemons_die_with_the_process_that_started_them(tmp_path):
    _md_argv(tmp_path)
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=tmp_path,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    try:
        server_pid, md_pid = json.loads(launcher.stdout.readline())
        wait_for_sync(
            lambda: _serving(tmp_path / "stats.json") or not pid_alive(md_pid), 60, "MD serving"
        )
        assert pid_alive(md_pid), (tmp_path / "log").read_text()
        launcher.kill()  # SIGKILL: the launcher runs no cleanup of its own
        launcher.wait()
        wait_for_sync(
            lambda: not pid_alive(server_pid) and not pid_alive(md_pid),
            30,
            "the fork server and its daemon to exit",
            step=0.05,
        )
    finally:
        launcher.kill()
        launcher.wait()
    # the daemon got SIGTERM (not SIGKILL), closed and said so
    assert json.loads((tmp_path / "stats.json").read_text())["state"] == "stopped"


async def test_a_local_clusters_processes_are_forks_and_only_the_engine_daemons_map_torch():
    async with LocalCluster(mode="pdd", wan="proxy", rtt_ms=10) as cluster:
        pids = {role: d.pid for role, d in cluster.daemons.items()}
        pids["wan proxy"] = cluster.launcher.placement.emulator_pid
        parents = {role: int(_stat(pid)[1]) for role, pid in pids.items()}
        torch = {
            role: "libtorch" in Path(f"/proc/{pid}/maps").read_text() for role, pid in pids.items()
        }
        body = await cluster.complete(
            prompt=[1, 2, 3], max_tokens=4, temperature=0.0, ignore_eos=True
        )
        assert body["usage"]["completion_tokens"] == 4
    preloads = {s.proc.pid: preload for (_, preload, _), s in forkserver._servers.items()}
    assert {role: preloads.get(parent) for role, parent in parents.items()} == {
        "prefill": TORCH,
        "relay": TORCH,
        "main_decode": TORCH,
        "router": forkserver.NO_TORCH,
        "wan proxy": forkserver.NO_TORCH,
    }, (parents, preloads)
    assert torch == {role: role not in ("router", "wan proxy") for role in pids}, torch
    assert cluster.stop_report is not None and cluster.stop_report.killed == []
