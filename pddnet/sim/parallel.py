"""Independent simulations on several cores, with results identical to running them in turn.

A simulation is a pure function of its inputs (config, system, recorded schedule), so runs that
do not feed each other -- the systems compared once the baseline's schedule is recorded, the
planner's searches of different systems -- may run in separate processes. One simulation is
one process (the event loop is sequential), so this is how a comparison uses both cores.

Workers are *spawned*, not forked: the parent may hold threads (torch, asyncio, tqdm's monitor)
whose locks a fork would copy mid-use. Progress travels back over a queue, batched (a
simulation reports every request; one message per request would cost more than the run).
``jobs == 1`` runs everything in this process, in order, with the callbacks called directly.
"""

from __future__ import annotations

import multiprocessing
import queue as queue_mod
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

FLUSH_S = 0.25  # how often a worker sends its accumulated request counts
_DONE = "__task_done__"  # a task's last progress message (its feeder thread may lag its result)


@dataclass
class Task:
    """``fn(*args, **kwargs)``; with ``progress_kw`` the call also gets a progress callback
    under that keyword, whose payloads reach ``run_tasks``'s ``progress(index, payload)``."""

    fn: Callable[..., Any]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    progress_kw: str | None = None


def run_tasks(
    tasks: Sequence[Task], jobs: int = 1, progress: Callable[[int, Any], None] | None = None
) -> list[Any]:
    """Results in the order of ``tasks``. The first exception of a task is raised here (the
    others are cancelled)."""
    if jobs < 1:
        raise ValueError(f"jobs must be >= 1, got {jobs!r}")
    if jobs == 1 or len(tasks) <= 1:
        return [_call_here(i, t, progress) for i, t in enumerate(tasks)]
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with ProcessPoolExecutor(
        max_workers=min(jobs, len(tasks)), mp_context=ctx, initializer=_init_worker, initargs=(q,)
    ) as pool:
        futures = [
            pool.submit(_call_in_worker, i, t.fn, t.args, t.kwargs, t.progress_kw)
            for i, t in enumerate(tasks)
        ]
        reported: set[int] = set()
        try:
            pending = set(futures)
            while pending or len(reported) < len(tasks):
                _drain(q, progress, reported, timeout=0.1)
                done, pending = wait(pending, timeout=0, return_when=FIRST_EXCEPTION)
                for f in done:
                    exc = f.exception()
                    if exc is not None:
                        raise exc
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise


def _call_here(index: int, task: Task, progress: Callable[[int, Any], None] | None) -> Any:
    kwargs = dict(task.kwargs)
    if task.progress_kw is not None:
        kwargs[task.progress_kw] = (
            (lambda payload: progress(index, payload)) if progress is not None else None
        )
    return task.fn(*task.args, **kwargs)


def _drain(
    q: Any, progress: Callable[[int, Any], None] | None, reported: set[int], timeout: float
) -> None:
    """Hand every queued progress message to ``progress`` (noting finished tasks in
    ``reported``); wait up to ``timeout`` for the first one."""
    block = True
    while True:
        try:
            index, payload = q.get(True, timeout) if block else q.get_nowait()
        except queue_mod.Empty:
            return
        block = False
        if isinstance(payload, str) and payload == _DONE:
            reported.add(index)
        elif progress is not None:
            progress(index, payload)


# -- the worker side ------------------------------------------------------------------------------

_queue: Any = None


def _init_worker(q: Any) -> None:
    global _queue
    _queue = q


class _Reporter:
    """A worker's progress callback: request counts summed and sent every FLUSH_S seconds,
    anything else (a planner's line of text) sent at once."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.count = 0
        self.sent_at = time.monotonic()

    def __call__(self, payload: Any) -> None:
        if isinstance(payload, int) and not isinstance(payload, bool):
            self.count += payload
            if time.monotonic() - self.sent_at >= FLUSH_S:
                self.flush()
            return
        self.flush()
        _queue.put((self.index, payload))

    def flush(self) -> None:
        if self.count:
            _queue.put((self.index, self.count))
            self.count = 0
        self.sent_at = time.monotonic()


def _call_in_worker(
    index: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    progress_kw: str | None,
) -> Any:
    reporter = None
    if progress_kw is not None:
        reporter = _Reporter(index)
        kwargs = {**kwargs, progress_kw: reporter}
    try:
        return fn(*args, **kwargs)
    finally:
        if reporter is not None:
            reporter.flush()
        _queue.put((index, _DONE))
