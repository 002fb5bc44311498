"""Fork servers for loopback clusters: each process's imports are done once, each start forks.

Every P, RLD and MD process imports torch and pddnet's roles (~3.5 s of CPU) before it does
anything of its own (~0.5 s), the router and the WAN proxy their modules (~1 s); a local
cluster start paid all of that, every restart again. `spawn(argv, env, cwd, log, preload)` hands
a `python -m pddnet ...` command line to a server process that has imported `preload` already
(TORCH_DAEMONS, or NO_TORCH for the processes that must never map torch); it forks, and the
child runs `pddnet.cli.main` as that command line would have (own session, stdin /dev/null,
stdout and stderr to the log, the given environment and working directory, the command line
in ps). Thread counts stay explicit: `pdd serve` calls torch.set_num_threads(model.threads).

One server per interpreter, preload and import-time environment (IMPORT_TIME_PREFIXES: what
a module may read while it imports is then what the daemon would have started with); it lives
as long as the process that started it: it exits when its control socket closes (that process
exited or was killed), and its children get SIGTERM when it goes (PR_SET_PDEATHSIG), as they
do when a launcher dies. A server stays single-threaded and runs nothing it imported, so a
fork inherits no thread or held lock.

The handle (`ForkedProcess`) answers as subprocess.Popen does (pid, poll, wait, send_signal,
kill, returncode): the launcher and the chaos tests stop, kill and restart daemons by PID as
before. The server reaps its children and reports each exit status over the socket.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import IO, Any

# What a server imports before it forks: P / RLD / MD's torch and roles; or, for the processes
# that must never map torch (the router, the WAN proxy), their modules alone.
TORCH_DAEMONS = (
    "torch",
    "pddnet.cli",
    "pddnet.cluster.cli",
    "pddnet.roles.prefill",
    "pddnet.roles.relay",
    "pddnet.roles.main_decode",
)
NO_TORCH = (
    "pddnet.cli",
    "pddnet.cluster.cli",
    "pddnet.roles.router",
    "emulation.wan_cli",
    "emulation.proxy",
    "emulation.link",
)
MAX_MESSAGE = 1 << 20
# Room in the server's command line for a child's own (see _retitle): ps shows a daemon's
# `python -m pddnet serve ROLE --config ...`, not the server's line.
TITLE_ROOM = 4096


class ForkServerError(RuntimeError):
    """The fork server is gone or did not answer."""


def forkable(argv: Sequence[str], python: str = sys.executable) -> bool:
    """True for a `python -m pddnet ...` command line of this interpreter (what the server runs)."""
    return len(argv) > 3 and argv[0] == python and list(argv[1:3]) == ["-m", "pddnet"]


class ForkedProcess:
    """A daemon forked by the server, with subprocess.Popen's interface for what the launcher
    uses. Its exit status comes from the server (its parent), which reaps it."""

    def __init__(self, server: ForkServer, pid: int, args: list[str]) -> None:
        self.server = server
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout=timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never signal a PID the server has reaped (it may be reused)
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The launcher's side: starts the server, asks it for forks, collects exit statuses."""

    def __init__(
        self, env: Mapping[str, str], preload: Sequence[str], python: str = sys.executable
    ) -> None:
        self.python = python
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = mine
        self.proc = subprocess.Popen(
            [python, "-m", "pddnet.cluster.forkserver", str(theirs.fileno()), ",".join(preload)]
            + [" " * TITLE_ROOM],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,  # its children write to their logs; errors go to stderr
            env=dict(env),
            cwd="/",
            pass_fds=(theirs.fileno(),),
            start_new_session=True,  # a terminal's Ctrl-C reaches only the launcher
        )
        theirs.close()
        self._lock = threading.Lock()
        self._exits: dict[int, int] = {}
        ready = self._receive(timeout=120.0, want="ready")
        if ready is None:
            self.close()
            raise ForkServerError("the fork server did not finish its imports within 120 s")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log: IO
    ) -> ForkedProcess:
        request = {"argv": list(argv), "env": dict(env), "cwd": os.path.abspath(cwd)}
        with self._lock:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [log.fileno()])
            reply = self._receive_locked(timeout=30.0, want="pid")
        if reply is None:
            raise ForkServerError("the fork server did not fork within 30 s")
        return ForkedProcess(self, reply["pid"], list(argv))

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code (negative: the signal that ended it), or None while it runs
        after waiting up to `timeout` seconds (None: for ever). The lock is taken a slice at a
        time, so a wait in one thread does not hold up a poll in another."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if pid in self._exits:
                    return self._exits[pid]
                left = 0.1 if deadline is None else max(0.0, deadline - time.monotonic())
                got = self._receive_locked(timeout=min(left, 0.1), want=None)
            if got is None and deadline is not None and time.monotonic() >= deadline:
                return self._exits.get(pid)

    def _receive(self, timeout: float | None, want: str | None) -> dict[str, Any] | None:
        with self._lock:
            return self._receive_locked(timeout, want)

    def _receive_locked(self, timeout: float | None, want: str | None) -> dict[str, Any] | None:
        """Read messages (recording exits) until one with key `want` (None: any one message)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            readable, _, _ = select.select([self.sock], [], [], left)
            if not readable:
                return None
            data = self.sock.recv(MAX_MESSAGE)
            if not data:
                raise ForkServerError(
                    f"the fork server (pid {self.proc.pid}) is gone (exit code {self.proc.poll()})"
                )
            message = json.loads(data)
            if "exit" in message:
                self._exits[message["exit"]] = message["code"]
            if want is None or want in message:
                return message

    def close(self) -> None:
        """End the server (it sees its socket close); its running daemons get SIGTERM."""
        with contextlib.suppress(OSError):
            self.sock.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)


# What the interpreter, torch, its thread pools and its allocator read while they start: a
# server serves launches whose environments agree on these; the rest of a launch's environment
# (e.g. pytest's PYTEST_CURRENT_TEST, which changes every test) is set in the child.
IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "TORCH",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "CUDA",
    "LD_",
    "MALLOC_",
    "PDD_",
)

_servers: dict[tuple[Any, ...], ForkServer] = {}
_servers_lock = threading.Lock()


def server_for(
    env: Mapping[str, str], preload: Sequence[str], python: str = sys.executable
) -> ForkServer:
    """The one server of this process for this interpreter, preload and the environment's
    import-time variables (started on first use, again if it died)."""
    read = sorted((k, v) for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES))
    key = (python, tuple(preload), tuple(read))
    with _servers_lock:
        server = _servers.get(key)
        if server is None or not server.alive():
            server = _servers[key] = ForkServer(env, preload, python)
        return server


@atexit.register
def _close_all() -> None:
    for server in _servers.values():
        server.close()
    _servers.clear()


def spawn(
    argv: Sequence[str], env: Mapping[str, str], cwd: str, log: IO, preload: Sequence[str]
) -> ForkedProcess:
    """Fork `python -m pddnet ...` (see `forkable`) from the server for `env` and `preload`."""
    return server_for(env, preload, argv[0]).spawn(argv, env, cwd, log)


# -- the server process -------------------------------------------------------------------------


def serve(sock: socket.socket) -> None:
    """Fork on request, report exits; return when the launcher's end of the socket closes."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so SIGCHLD writes to wake_w
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    with contextlib.suppress(ConnectionError):  # the launcher is gone
        while True:
            readable, _, _ = select.select([sock, wake_r], [], [])
            if wake_r in readable:
                os.read(wake_r, 4096)
                _report_exits(sock)
            if sock in readable:
                data, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 1)
                if not data:
                    return  # the launcher is gone: exiting sends our daemons their SIGTERM
                server_pid = os.getpid()
                pid = os.fork()
                if pid == 0:
                    _child(json.loads(data), fds[0], [sock.fileno(), wake_r, wake_w], server_pid)
                os.close(fds[0])
                sock.send(json.dumps({"pid": pid}).encode())


def _report_exits(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def _child(request: dict[str, Any], log_fd: int, server_fds: list[int], server_pid: int) -> None:
    """Become `python -m pddnet ARGS` as `subprocess.Popen` with the launcher's options would
    have started it; never returns into the server's loop."""
    code: object = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in server_fds:
            os.close(fd)
        os.setsid()
        from emulation.lifetime import die_with_parent

        die_with_parent()()  # SIGTERM when the server exits, as a launcher's Popen child
        if os.getppid() != server_pid:  # it exited before the line above armed that
            os._exit(1)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(null)
        os.close(log_fd)
        _retitle(request["argv"])
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = os.getcwd()  # what `python -m` puts first
        import pddnet
        from pddnet.cli import main

        sys.argv = [os.path.join(os.path.dirname(pddnet.__file__), "__main__.py")]
        sys.argv += request["argv"][3:]
        code = main(request["argv"][3:])  # `pdd serve` itself ends with os._exit
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code if isinstance(code, int) else 0 if code is None else 1)


def _retitle(argv: list[str]) -> None:
    """Write `argv` over this process's command line (the memory /proc/PID/cmdline reads, from
    the server's argv, which left TITLE_ROOM bytes for it): ps and /proc show the daemon's
    command line. A longer one is cut at the room's end."""
    import ctypes

    with open("/proc/self/stat") as f:
        stat = f.read().rsplit(")", 1)[1].split()
    start, end = int(stat[45]), int(stat[46])  # arg_start, arg_end (fields 48 and 49)
    title = b"\0".join(a.encode() for a in argv)[: end - start - 1]
    ctypes.memmove(start, title.ljust(end - start, b"\0"), end - start)


def _main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    import importlib

    preload = sys.argv[2].split(",")
    for name in preload:
        importlib.import_module(name)
    if "torch" not in preload and "torch" in sys.modules:  # its children would map libtorch
        raise SystemExit(f"fork server: importing {preload} imported torch")
    serve(sock)


if __name__ == "__main__":
    _main()
