"""Process faults for daemons started in a testbed: crash (SIGKILL) and hang (SIGSTOP, then
SIGCONT after a duration). Only PIDs the testbed started are accepted, so a typo cannot stop
an unrelated process on the machine."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable, Iterable


class Hang:
    """A process stopped by `ProcessFaults.hang`; resumes by itself after the duration."""

    def __init__(self, pid: int, duration: float, loop: asyncio.AbstractEventLoop) -> None:
        self.pid = pid
        self.duration = duration
        self.resumed = asyncio.Event()
        self._handle = loop.call_later(duration, self.resume)

    def resume(self) -> None:
        """SIGCONT now (idempotent; the process may have died meanwhile)."""
        self._handle.cancel()
        if not self.resumed.is_set():
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            self.resumed.set()

    async def wait(self) -> None:
        await self.resumed.wait()


class ProcessFaults:
    """Fault injection for the processes of one owner (a Testbed). `owned()` returns the PIDs
    that may be touched."""

    def __init__(self, owned: Callable[[], Iterable[int]], owner: str = "the testbed") -> None:
        self._owned = owned
        self._owner = owner
        self._hangs: dict[int, Hang] = {}

    def _check(self, pid: int) -> int:
        if isinstance(pid, bool) or not isinstance(pid, int):
            raise TypeError(f"pid must be an int, got {pid!r}")
        if pid not in set(self._owned()):
            raise ValueError(f"pid {pid} was not started by {self._owner}; refusing to signal it")
        return pid

    def kill(self, pid: int) -> None:
        """Crash the process: SIGKILL (no cleanup runs in it)."""
        self._check(pid)
        hang = self._hangs.pop(pid, None)
        if hang is not None:
            hang._handle.cancel()
            hang.resumed.set()
        os.kill(pid, signal.SIGKILL)

    def hang(self, pid: int, duration: float) -> Hang:
        """Freeze the process (SIGSTOP) for `duration` seconds, then SIGCONT. Needs a running
        event loop; returns the Hang (await hang.wait(), or hang.resume() early)."""
        self._check(pid)
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or duration <= 0:
            raise ValueError(f"hang duration must be a number of seconds > 0, got {duration!r}")
        loop = asyncio.get_running_loop()
        previous = self._hangs.pop(pid, None)
        if previous is not None:
            previous._handle.cancel()  # the new hang replaces it; the process stays stopped
            previous.resumed.set()
        os.kill(pid, signal.SIGSTOP)
        hang = Hang(pid, float(duration), loop)
        self._hangs[pid] = hang
        return hang

    def resume_all(self) -> None:
        """SIGCONT every process still hung (used on teardown)."""
        for hang in list(self._hangs.values()):
            hang.resume()
        self._hangs.clear()
