"""Ordered, non-blocking sends on one connection (a daemon's lanes, the router's events lanes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

from pddnet.protocol import Message
from pddnet.transport import Connection, ConnectionClosed

log = logging.getLogger("pddnet.roles")


class Outbox:
    """Ordered, non-blocking sends on one connection: handlers post, one task writes (and waits
    for the connection's backpressure), so a slow peer never stalls the code that posts."""

    def __init__(self, conn: Connection, name: str) -> None:
        self.conn = conn
        self.name = name
        self.dropped = 0
        self._queue: deque[Message] = deque()
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"outbox {name}")

    @property
    def alive(self) -> bool:
        return not self.conn.closed and not self._task.done()

    def post(self, msg: Message) -> None:
        if not self.alive:
            self.dropped += 1
            log.debug("%s: dropping %s, connection closed", self.name, msg.TYPE.name)
            return
        self._queue.append(msg)
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            while self._queue:
                msg = self._queue.popleft()
                try:
                    await self.conn.send(msg)
                except ConnectionClosed as exc:
                    self.dropped += 1 + len(self._queue)
                    self._queue.clear()
                    log.info("%s: connection closed (%s)", self.name, exc)
                    return
            self._wakeup.clear()
            await self._wakeup.wait()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._task
        await self.conn.close("daemon closing")
