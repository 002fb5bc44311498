"""A dedicated thread for blocking calls, awaited with a deadline from the event loop.

A transfer engine's calls block (a synchronous batch write waits for the peer's acknowledgement)
and cannot be interrupted from outside. So they run here, one at a time in order, and the event
loop waits for each with pddnet's deadline. When the deadline passes the caller gets
`CallTimedOut` at once; a call that had not started yet is cancelled, one that is running keeps
the thread until the engine gives up (its own progress timeout) -- `CallTimedOut.future` lets the
caller wait for that before it declares the destination reusable.

The thread is a daemon thread: a call stuck on a hung peer must not keep the process from
exiting (a ThreadPoolExecutor's workers are joined at interpreter exit).

`ThreadedWriter` is the KVWriter of the backends whose writes block (shm's copy into a mapped
region, mooncake's synchronous engine write): each write runs in the writer's own CallThread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pddnet.transport.kv_backend import KVTransfer, KVWriter, TransferTimeout

if TYPE_CHECKING:
    from pddnet.kv.transfer import ExportedKV

_STOP = object()


class CallTimedOut(TimeoutError):
    """The call did not finish in time; `future` is the call itself (done, cancelled or running)."""

    def __init__(self, message: str, future: concurrent.futures.Future) -> None:
        super().__init__(message)
        self.future = future


class CallThread:
    """Runs submitted callables one after another in its own daemon thread."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopping = False
        self._current: concurrent.futures.Future | None = None
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue  # cancelled while queued: its deadline passed before it started
            self._current = fut
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # handed to the waiter, never lost in the thread
                fut.set_exception(exc)
            finally:
                self._current = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
        if self._stopping:
            raise RuntimeError(f"call thread {self.name} is stopped")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((fut, fn, args))
        return fut

    async def call(
        self, fn: Callable[..., Any], *args: Any, timeout: float, what: str = "call"
    ) -> Any:
        """Run fn(*args) in the thread; raise CallTimedOut after `timeout` seconds."""
        fut = self.submit(fn, *args)
        try:
            # wait_for cancels the wrapper on timeout, which cancels `fut` if it has not started.
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            state = "never started" if fut.cancelled() else "still running"
            raise CallTimedOut(
                f"{what} did not finish within {timeout:g} s ({state})", fut
            ) from None

    @property
    def busy(self) -> bool:
        """A call is running (e.g. stuck on a hung peer)."""
        return self._current is not None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Let the thread end after the calls already queued (idempotent)."""
        if not self._stopping:
            self._stopping = True
            self._queue.put(_STOP)

    def join(self, timeout: float) -> bool:
        """Wait for the thread to end; True if it did."""
        self._thread.join(timeout)
        return not self._thread.is_alive()


class ThreadedWriter(KVWriter):
    """A KVWriter whose writes block: they run one after another in its own CallThread."""

    def __init__(self, peer: str, deadline_s: float, abort_grace_s: float) -> None:
        super().__init__(peer, deadline_s, abort_grace_s)
        self._thread = CallThread(f"{self.backend}-writer-{peer}")
        # the last write that overran its deadline, while it still runs (the peer is hung)
        self._stuck: concurrent.futures.Future | None = None

    async def _in_thread(
        self,
        fn: Callable[[KVTransfer, ExportedKV], int],
        transfer: KVTransfer,
        exported: ExportedKV,
        deadline_s: float,
    ) -> int:
        """``fn(transfer, exported)`` in the thread, within ``deadline_s``. A call that overruns
        it raises TransferTimeout and stays on the transfer's lingering futures: the
        destination is reusable only once that call is done."""
        try:
            return await self._thread.call(
                fn,
                transfer,
                exported,
                timeout=deadline_s,
                what=f"{self.backend} write of {transfer.request_id} to {self.peer}",
            )
        except CallTimedOut as exc:
            transfer.lingering.append(exc.future)
            if not exc.future.done():
                self._stuck = exc.future
            raise self._error(TransferTimeout, str(exc)) from None
