"""Named network namespaces without shelling out to `ip`: create, delete, run code inside, exec.

A namespace is a file under /run/netns bind-mounted from /proc/.../ns/net, exactly as
`ip netns add` makes it, so `ip netns list` / `ip netns exec` see ours and we see theirs.

Python 3.11 has no os.setns, so setns/unshare come from libc through ctypes. A network
namespace belongs to a *thread*, not a process: code that must run inside a namespace (open a
TUN device, create a socket, talk rtnetlink) runs in a short-lived helper thread that joins the
namespace and then dies, so the caller's thread never changes namespace. Sockets and TUN fds
keep the namespace they were made in, so they can be used from any thread afterwards.

`python -m emulation.netns exec NS -- CMD...` is the exec trampoline: setns, then execvp, so the
command keeps the trampoline's PID (which is what the testbed tracks).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

NETNS_RUN_DIR = "/run/netns"
CLONE_NEWNET = 0x40000000
_MS_REC = 0x4000
_MS_BIND = 0x1000
_MS_SHARED = 1 << 20
_MNT_DETACH = 2

T = TypeVar("T")

_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    return _libc


def _check(rc: int, what: str, target: str = "") -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what} failed: {os.strerror(err)}", target or None)


def check_plain_name(name: str, what: str, longest: int) -> str:
    """`name`, if it is 1 to `longest` characters of A-Z a-z 0-9 _ . - starting with a letter or
    digit (nothing that could escape a folder or that `ip` would not accept); else ValueError
    ("bad <what> name ...")."""
    pattern = rf"^[A-Za-z0-9][A-Za-z0-9_.-]{{0,{longest - 1}}}$"
    if not isinstance(name, str) or not re.match(pattern, name):
        raise ValueError(
            f"bad {what} name {name!r}: use 1-{longest} characters of A-Z a-z 0-9 _ . - "
            "starting with a letter or digit"
        )
    return name


def check_name(name: str) -> str:
    """Reject names that could escape /run/netns or that `ip` would not accept."""
    return check_plain_name(name, "network namespace", 63)


def netns_path(name: str) -> str:
    return os.path.join(NETNS_RUN_DIR, check_name(name))


def exists(name: str) -> bool:
    return os.path.exists(netns_path(name))


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_RUN_DIR))
    except FileNotFoundError:
        return []


def setns_fd(fd: int, nstype: int = CLONE_NEWNET) -> None:
    """Move the calling *thread* into the namespace behind `fd`."""
    _check(_lib().setns(fd, nstype), "setns")


def setns(name: str) -> None:
    """Move the calling thread into the named network namespace (for exec trampolines)."""
    fd = os.open(netns_path(name), os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns_fd(fd)
    finally:
        os.close(fd)


def _share_run_dir() -> None:
    # As iproute2 does: make /run/netns a shared mount point so that namespaces created here
    # are visible from other mount namespaces (e.g. inside `ip netns exec`).
    os.makedirs(NETNS_RUN_DIR, exist_ok=True)
    libc = _lib()
    run_dir = NETNS_RUN_DIR.encode()
    if libc.mount(b"", run_dir, b"none", _MS_SHARED | _MS_REC, None) == 0:
        return
    _check(
        libc.mount(run_dir, run_dir, b"none", _MS_BIND | _MS_REC, None), "bind mount", NETNS_RUN_DIR
    )
    _check(
        libc.mount(b"", run_dir, b"none", _MS_SHARED | _MS_REC, None), "make shared", NETNS_RUN_DIR
    )


def _in_thread(fn: Callable[[], T]) -> T:
    """Run `fn` in a fresh thread and return its result (or raise its exception)."""
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed back to the caller below
            box["error"] = exc

    thread = threading.Thread(target=body, name="netns-helper", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def create(name: str) -> None:
    """Create the named namespace with its loopback up. FileExistsError if it exists."""
    path = netns_path(name)
    _share_run_dir()
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o444))
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST, f"network namespace {name!r} already exists", path
        ) from None

    def make() -> None:
        # unshare() moves only this helper thread into the new namespace; the bind mount keeps
        # the namespace alive after the thread is gone.
        _check(_lib().unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)", name)
        _check(
            _lib().mount(b"/proc/thread-self/ns/net", path.encode(), b"none", _MS_BIND, None),
            "bind mount of the namespace",
            path,
        )
        _loopback_up()

    try:
        _in_thread(make)
    except BaseException:
        _unmount_and_unlink(path)
        raise


def _loopback_up() -> None:
    from pyroute2 import IPRoute

    with IPRoute() as ipr:
        idx = ipr.link_lookup(ifname="lo")[0]
        ipr.link("set", index=idx, state="up")


def _unmount_and_unlink(path: str) -> None:
    _lib().umount2(path.encode(), _MNT_DETACH)  # fails harmlessly when it was never mounted
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def delete(name: str, missing_ok: bool = True) -> bool:
    """Remove the namespace's name. Returns whether it existed.

    The kernel frees the namespace (and every device in it) once no process and no open fd
    refers to it any more: end the processes inside first (see pids_in / kill_all_in).
    """
    path = netns_path(name)
    if not os.path.exists(path):
        if missing_ok:
            return False
        raise FileNotFoundError(errno.ENOENT, f"no network namespace {name!r}", path)
    _unmount_and_unlink(path)
    return True


def run_in_netns(name: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call fn(*args, **kwargs) inside the named namespace (in a helper thread) and return its
    result. Use it to create sockets, open TUN devices or run pyroute2 IPRoute() there."""
    path = netns_path(name)

    def inside() -> T:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns_fd(fd)
        finally:
            os.close(fd)
        return fn(*args, **kwargs)

    return _in_thread(inside)


def _sysctl_path(key: str) -> str:
    if not key or any(not part.isidentifier() for part in key.split(".")):
        raise ValueError(f"bad sysctl name {key!r} (dotted, as `sysctl` takes it)")
    return "/proc/sys/" + key.replace(".", "/")


def read_sysctl(name: str, key: str) -> str:
    """The named namespace's value of the sysctl `key` (``net.ipv4.tcp_rto_min_us``): the
    net.* ones are per namespace, and /proc/sys/net shows the reading thread's."""
    path = _sysctl_path(key)

    def read() -> str:
        with open(path) as f:
            return f.read().strip()

    return run_in_netns(name, read)


def write_sysctl(name: str, key: str, value: str) -> None:
    """Set the sysctl `key` in the named namespace only (as `read_sysctl`)."""
    path = _sysctl_path(key)

    def write() -> None:
        with open(path, "w") as f:
            f.write(value)

    run_in_netns(name, write)


def socket_in(
    name: str, family: int = socket.AF_INET, type: int = socket.SOCK_STREAM, proto: int = 0
) -> socket.socket:
    """A socket that lives in the named namespace (usable from any thread afterwards)."""
    return run_in_netns(name, socket.socket, family, type, proto)


def _ns_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def pids_in(name: str) -> list[int]:
    """PIDs of the processes whose (main thread's) network namespace is the named one."""
    target = _ns_id(netns_path(name))
    if target is None:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and _ns_id(f"/proc/{entry}/ns/net") == target:
            found.append(int(entry))
    return sorted(found)


def kill_all_in(name: str, grace_s: float = 1.0) -> list[int]:
    """End every process inside the named namespace, by PID: SIGTERM, then SIGKILL after
    `grace_s`. Only processes in *this* namespace are touched. Returns the PIDs ended."""
    me = os.getpid()
    pids = [p for p in pids_in(name) if p != me]
    for pid in pids:
        _signal(pid, signal.SIGTERM)
        _signal(pid, signal.SIGCONT)  # a stopped (hung) process only sees SIGTERM once resumed
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.02)
    for pid in pids:
        if pid_alive(pid):
            _signal(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and any(pid_alive(p) for p in pids):
        time.sleep(0.02)
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie. Never reaps: a caller's Popen must
    still see its child's real exit status."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")


def exec_argv(name: str, argv: Sequence[str]) -> list[str]:
    """The argv that runs `argv` inside the named namespace via this module's trampoline.
    The trampoline execs, so the process keeps its PID."""
    check_name(name)
    if not argv:
        raise ValueError("exec needs a command to run")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # -c with an explicit path: works whether or not the package is installed.
    code = (
        f"import sys; sys.path.insert(0, {root!r}); "
        "from emulation.netns import main; sys.exit(main(sys.argv[1:]))"
    )
    return [sys.executable, "-c", code, "exec", name, "--", *argv]


def exec_in(name: str, argv: Sequence[str]) -> None:
    """setns into the namespace and replace this process with argv (does not return)."""
    setns(name)
    try:
        os.execvp(argv[0], list(argv))
    except FileNotFoundError:
        sys.stderr.write(f"netns exec: command not found: {argv[0]}\n")
        os._exit(127)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: python -m emulation.netns exec NS -- CMD [ARGS...]\n"
        "       python -m emulation.netns list"
    )
    if args[:1] == ["list"]:
        print("\n".join(list_netns()))
        return 0
    if len(args) >= 3 and args[0] == "exec":
        name, rest = args[1], args[2:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        if not rest:
            sys.stderr.write(usage + "\n")
            return 2
        try:
            exec_in(name, rest)
        except (OSError, ValueError) as exc:
            sys.stderr.write(f"netns exec {name}: {exc}\n")
            return 1
    sys.stderr.write(usage + "\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
