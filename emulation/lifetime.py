"""Children that die with the process that started them (Linux PR_SET_PDEATHSIG).

A launcher killed by SIGTERM or SIGKILL runs no cleanup of its own; its daemons and its WAN
emulator would keep running (and keep their ports, namespaces and CPU). A child started with
`preexec_fn=die_with_parent()` gets SIGTERM when its parent dies, and the setting survives exec.
Note: the kernel sends it when the *thread* that forked exits, so start children from a thread
that lives as long as they should (the launcher's main thread).
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1
_prctl: list[Any] = []


def _set_pdeathsig() -> None:
    # Runs between fork and exec: only calls what the parent resolved, nothing that takes a lock.
    if _prctl:
        _prctl[0](PR_SET_PDEATHSIG, signal.SIGTERM)


def die_with_parent() -> Callable[[], None]:
    """A preexec_fn for subprocess.Popen (resolves libc's prctl now, in the parent)."""
    if not _prctl:
        import ctypes

        with contextlib.suppress(Exception):  # not Linux / no libc: children just outlive us
            _prctl.append(ctypes.CDLL(None, use_errno=True).prctl)
    return _set_pdeathsig
