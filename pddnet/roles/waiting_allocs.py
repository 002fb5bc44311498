"""MD's KV allocations the pool has no room for *now* (each fits once others free their blocks):
they wait here, first come first served, instead of failing the request at a momentary peak;
they are asked again whenever blocks may have been freed, and the router hears that they wait
(so it does not take a queued request for a stalled one)."""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pddnet.engine.engine import KVReservation
from pddnet.protocol import KvAllocRequest

from .outbox import Outbox

# reserve(p, msg, on_short): the pool's reservation for msg, or None (on_short called when
# there is no room for it yet)
Reserve = Callable[[Outbox, KvAllocRequest, Callable[[], None]], Awaitable[KVReservation | None]]


@dataclass(eq=False)
class WaitingAllocs:
    """The queue of waiting allocations, the retry of its head, the reports to the router."""

    reserve: Reserve
    accept: Callable[[Outbox, KvAllocRequest, KVReservation], None]
    spawn: Callable[[Awaitable[Any], str], asyncio.Task]
    timeline: Callable[[str, str, int], None]
    counters: Counter[str]
    report_every_s: float
    _queue: deque[tuple[Outbox, KvAllocRequest]] = field(default_factory=deque, init=False)
    _retrying: bool = field(default=False, init=False)
    _retry_again: bool = field(default=False, init=False)
    _telling_router: bool = field(default=False, init=False)

    def __len__(self) -> int:
        return len(self._queue)

    def wait(self, p: Outbox, msg: KvAllocRequest) -> None:
        """``msg`` has no room yet (or others wait before it): queue it."""
        self.counters["alloc_waits"] += 1
        self.timeline(msg.request_id, "kv_alloc_wait", len(self._queue))
        self._queue.append((p, msg))
        if not self._telling_router:
            self._telling_router = True
            self.spawn(self._still_waiting(), "KV allocations waiting for room")
        self.kick()  # blocks may have been freed while it was being reserved

    def drop(self, rid: str) -> bool:
        """A request dropped while it waits (True: it was waiting; it never got blocks)."""
        for entry in self._queue:
            if entry[1].request_id == rid:
                self._queue.remove(entry)
                return True
        return False

    def drop_lane(self, p: Outbox) -> None:
        """P's lane closed: nobody is left to answer its waiting allocations."""
        for entry in [e for e in self._queue if e[0] is p]:
            self._queue.remove(entry)

    async def _still_waiting(self) -> None:
        """While allocations wait, say so to the router (their queue position) at a third of
        its stall timeout: a request queued here is not stalled, and replaying it elsewhere
        would only add load where there is too much already."""
        try:
            while self._queue:
                await asyncio.sleep(self.report_every_s)
                for position, (_, msg) in enumerate(list(self._queue)):
                    self.timeline(msg.request_id, "kv_alloc_wait", position)
        finally:
            self._telling_router = False

    def kick(self) -> None:
        """Blocks may have been freed: ask again for the waiting allocations, in order."""
        if not self._queue:
            return
        if self._retrying:
            self._retry_again = True
            return
        self._retrying = True
        self.spawn(self._retry_waiting(), "retry waiting KV allocations")

    async def _retry_waiting(self) -> None:
        try:
            while self._queue:
                self._retry_again = False
                head = self._queue[0]
                p, msg = head
                short = False

                def still_short() -> None:
                    nonlocal short
                    short = True

                res = await self.reserve(p, msg, still_short)
                if short and self._queue and self._queue[0] is head:
                    if self._retry_again:
                        continue  # something was freed meanwhile: try once more
                    return
                if self._queue and self._queue[0] is head:
                    self._queue.popleft()
                if res is not None:
                    self.accept(p, msg, res)
        finally:
            self._retrying = False
