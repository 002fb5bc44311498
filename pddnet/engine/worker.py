"""EngineWorker: an Engine driven from ONE dedicated thread, so the event loop stays responsive.

A daemon's asyncio loop must keep answering the network (heartbeats, token events, handoffs)
while a forward runs. The Engine is not thread-safe, so exactly one thread touches it: this
worker. The loop talks to it in two ways:

- `await worker.call(fn, *args)` runs `fn(*args)` in the worker thread *between* steps (e.g.
  `engine.add_request`, `engine.append_tokens`, `engine.abort`) and returns its result;
- after every step that did something, `on_outputs(outputs)` is invoked on the loop
  (`call_soon_threadsafe`); a step's exception goes to `on_error(exc)` on the loop;
- `on_step_stats(step)`, if given, is called in the engine thread with each step's timing;
- `after_step(outputs)`, if given, is called in the engine thread with a step's outputs just
  before they go to the loop: bookkeeping that must see the engine as this step left it (MD
  drains its cache's notices when a request ends there, so P hears of them before the tokens).

With a `pacer` (pddnet.device.pacer.StepPacer) the engine runs on a modelled accelerator's
clock: after each forward the thread waits until the forward has lasted the modelled time x k,
and only then delivers its outputs (the tokens exist when the modelled device would have them)
and runs queued calls (the device is busy until then). `engine.last_step.duration_s` is then the
paced wall time, which is what the daemons' own estimates (RLD's time per token) must see.

The thread steps while `engine.has_work()` and sleeps on a threading.Event otherwise; `call()`
and `wake()` set it. A step that makes no progress (everything held, or the pool cannot admit
the waiting requests) or that raised also puts the worker to sleep until the next call/wake,
instead of spinning.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from pddnet.engine.engine import Engine, StepOutput, StepStats

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.device.pacer import StepPacer

log = logging.getLogger("pddnet.engine.worker")
T = TypeVar("T")


class WorkerClosed(RuntimeError):
    """The worker is closed: no more calls are accepted (pending ones fail with this)."""


class EngineWorker:
    """Owns the only thread that touches `engine`. Create it inside a running event loop (or
    pass `loop`); the thread starts at once. `close()` stops and joins it."""

    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[StepOutput]], None],
        threads: int = 1,
        name: str = "engine",
        *,
        on_error: Callable[[BaseException], None] | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        on_step_stats: Callable[[StepStats], None] | None = None,
        pacer: StepPacer | None = None,
        after_step: Callable[[list[StepOutput]], None] | None = None,
    ) -> None:
        if not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be an int >= 1, got {threads!r}")
        self.engine = engine
        self.on_outputs = on_outputs
        self.on_error = on_error
        # Called in the engine thread after each step that ran (keep it cheap, no locks)
        self.on_step_stats = on_step_stats
        self.after_step = after_step
        self.pacer = pacer
        self._last_seen = -1
        self.threads = threads
        self.name = name
        self.loop = loop if loop is not None else asyncio.get_running_loop()
        self.num_steps = 0
        self.num_errors = 0
        self.last_error: BaseException | None = None
        self.in_step = False  # read by tests and /metrics: a forward is running right now
        self._calls: collections.deque[tuple[concurrent.futures.Future, Callable, tuple, dict]] = (
            collections.deque()
        )
        self._lock = threading.Lock()  # guards _calls and _closing against close() racing call()
        self._wakeup = threading.Event()
        self._stop = threading.Event()  # ends a paced wait at once when the worker closes
        self._closing = False
        self._stalled = False  # last step made no progress or failed: wait for a call/wake
        self._exited: asyncio.Future[None] = self.loop.create_future()
        self._thread = threading.Thread(target=self._run, name=f"pdd-{name}", daemon=True)
        self._thread.start()

    # -- the loop side ------------------------------------------------------------------------
    async def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn(*args, **kwargs) in the worker thread between steps, serialized with them;
        return its result (or raise its exception) here on the loop."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closing:
                raise WorkerClosed(f"engine worker {self.name!r} is closed")
            self._calls.append((fut, fn, args, kwargs))
        self._wakeup.set()
        return await asyncio.wrap_future(fut, loop=self.loop)

    def wake(self) -> None:
        """There may be new work: step while engine.has_work() (thread-safe, cheap)."""
        self._wakeup.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    async def close(self) -> None:
        """Stop the thread after the step in progress (if any) and join it. Calls still queued
        fail with WorkerClosed. Idempotent."""
        with self._lock:
            self._closing = True
        self._stop.set()
        self._wakeup.set()
        if self._thread.is_alive() or not self._exited.done():
            await asyncio.shield(self._exited)
        self._thread.join()

    # -- the worker thread --------------------------------------------------------------------
    def _run(self) -> None:
        torch.set_num_threads(self.threads)  # per thread for OpenMP: set it in the compute thread
        try:
            while True:
                self._run_calls()
                if self._closing:
                    break
                if not self._stalled and self.engine.has_work():
                    self._step()
                    continue
                self._wakeup.wait()
                # Cleared before the state is re-checked, so a wake-up is never lost; only this
                # thread touches _stalled, so a wake during a stalled step cannot be overwritten.
                self._wakeup.clear()
                self._stalled = False
        except Exception as exc:  # the engine broke outside a step: report it, then stop
            self.num_errors += 1
            self.last_error = exc
            log.exception("engine worker %r died", self.name)
            if self.on_error is not None:
                self._deliver(self.on_error, exc)
        finally:
            self._fail_pending()
            self._deliver(self._set_exited)

    def _run_calls(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    return
                fut, fn, args, kwargs = self._calls.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # the awaiting coroutine was cancelled before we got to it
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # handed to the caller, never swallowed
                fut.set_exception(exc)

    def _step(self) -> None:
        self.in_step = True
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self.in_step = False
            self.num_errors += 1
            self.last_error = exc
            self._stalled = True  # do not hammer a broken state: wait for the loop to act
            log.exception("engine worker %r: step failed", self.name)
            if self.on_error is not None:
                self._deliver(self.on_error, exc)
            return
        self.num_steps += 1
        step = self.engine.last_step
        if step is not None and step.step != self._last_seen:
            self._last_seen = step.step  # an empty step() leaves last_step as it was
            if self.pacer is not None:
                step = self._pace(step)
            if self.on_step_stats is not None:
                self.on_step_stats(step)
        self.in_step = False
        if outputs:
            if self.after_step is not None:
                try:
                    self.after_step(outputs)
                except Exception:  # bookkeeping: the outputs still go to the loop
                    log.exception("engine worker %r: after_step failed", self.name)
            self._deliver(self.on_outputs, outputs)
        else:
            self._stalled = True  # no progress possible until something changes

    def _pace(self, step: StepStats) -> StepStats:
        """Wait out the modelled device's time for this forward; the step as it was paced."""
        assert self.pacer is not None
        wait = self.pacer.pace(step.chunks, 0.0, step.duration_s)
        if wait > 0:
            self._stop.wait(wait)
        paced = dataclasses.replace(step, duration_s=step.duration_s + wait)
        self.engine.last_step = paced
        return paced

    def _deliver(self, callback: Callable[..., Any], *args: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            log.warning(
                "engine worker %r: event loop closed, dropping %s",
                self.name,
                getattr(callback, "__name__", callback),
            )

    def _fail_pending(self) -> None:
        with self._lock:
            self._closing = True  # the thread is leaving: later calls must fail, not hang
            pending, self._calls = list(self._calls), collections.deque()
        for fut, *_ in pending:
            if fut.set_running_or_notify_cancel():
                fut.set_exception(
                    WorkerClosed(f"engine worker {self.name!r} closed before running this call")
                )

    def _set_exited(self) -> None:
        if not self._exited.done():
            self._exited.set_result(None)
