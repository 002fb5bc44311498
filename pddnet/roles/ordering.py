"""Keeping a daemon's per-request work in order: one request's engine operations run strictly
one after another (Serial), and an ended request stays ended (RecentIds), so a late or
replayed message can neither overtake nor resurrect what it refers to."""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("pddnet.roles")

CANCELLED_MEMORY = 4096  # recently ended request ids, so a late message cannot resurrect one


class Serial:
    """Runs a request's engine operations strictly in submission order in one task, so e.g. an
    abort can never overtake the add_request it cancels, nor a KV_DONE the last write."""

    def __init__(self, name: str, tasks: set[asyncio.Task]) -> None:
        self.name = name
        self._queue: deque[Callable[[], Awaitable[Any]]] = deque()
        self._task: asyncio.Task | None = None
        self._tasks = tasks

    def submit(self, op: Callable[[], Awaitable[Any]]) -> None:
        self._queue.append(op)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.name)
            self._tasks.add(self._task)
            self._task.add_done_callback(self._tasks.discard)

    async def _run(self) -> None:
        while self._queue:
            op = self._queue.popleft()
            try:
                await op()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("%s: operation failed", self.name)


class RecentIds:
    """A bounded memory of ended request ids (FIFO)."""

    def __init__(self, size: int = CANCELLED_MEMORY) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._size = size

    def add(self, rid: str) -> None:
        self._ids[rid] = None
        self._ids.move_to_end(rid)
        while len(self._ids) > self._size:
            self._ids.popitem(last=False)

    def __contains__(self, rid: object) -> bool:
        return rid in self._ids
