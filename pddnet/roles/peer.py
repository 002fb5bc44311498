"""A connection a daemon dials and keeps: heartbeats with a deadline, redial after a loss.

The dialling side of every control lane (P -> RLD, P -> MD, RLD -> MD) is a Peer. While it is up
it sends PING every `heartbeat_s`; a PONG that does not come within `deadline_s` (a hung or
partitioned peer: TCP alone would wait for minutes) closes the connection with that reason.
Either way a lost connection runs the daemon's `connection_lost` (which fails or re-routes the
requests that depended on it), and the Peer redials with backoff until the daemon closes, so a
restarted peer rejoins without restarting anybody else. `on_up(conn)` runs after every
(re)connect, before messages are read, e.g. P dials the bulk lanes that go with MD's control lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from pddnet.protocol import Message, Ping, Pong
from pddnet.transport import Connection

from .readiness import Link

log = logging.getLogger("pddnet.roles")

if TYPE_CHECKING:
    from .common import Daemon, Outbox


async def silent_past_deadline(
    last_pong: Callable[[], float], unanswered: Callable[[], int], deadline_s: float
) -> float | None:
    """How long a peer has been silent, when that makes it lost (else None): no PONG for
    `deadline_s` and two PINGs unanswered (a stall of our own event loop is not the peer's),
    judged again after the readers had a turn (PONGs that arrived during such a stall may still
    wait to be read: this timer can run first). The one rule for P's, RLD's and the router's
    heartbeats."""
    if time.monotonic() - last_pong() <= deadline_s or unanswered() < 2:
        return None
    await asyncio.sleep(0.05)
    silent = time.monotonic() - last_pong()
    return silent if silent > deadline_s and unanswered() >= 2 else None


class Peer:
    def __init__(
        self,
        daemon: Daemon,
        address: tuple[str, int],
        name: str,
        *,
        heartbeat_s: float,
        deadline_s: float,
        on_up: Callable[[Connection], Awaitable[None]] | None = None,
    ) -> None:
        if heartbeat_s <= 0 or deadline_s <= heartbeat_s:
            raise ValueError(f"need 0 < heartbeat_s < deadline_s, got {heartbeat_s}, {deadline_s}")
        self.daemon = daemon
        self.address = address
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.deadline_s = deadline_s
        self.on_up = on_up
        self.box: Outbox | None = None
        self.up = asyncio.Event()
        self.changed_at = time.time()  # when `up` last changed (wall clock, for readiness)
        self.connects = 0
        self.losses = 0
        self.last_loss = ""
        self.dropped = 0  # messages posted while down
        self._last_pong = 0.0
        self._nonce = 0
        self._unanswered = 0
        self._task: asyncio.Task | None = None

    # -- what the daemon uses ------------------------------------------------------------------

    @property
    def conn(self) -> Connection | None:
        return self.box.conn if self.box is not None else None

    @property
    def alive(self) -> bool:
        return self.box is not None and self.box.alive and self.up.is_set()

    def post(self, msg: Message) -> None:
        if self.box is None or not self.up.is_set():
            self.dropped += 1
            return
        self.box.post(msg)

    def pong(self, msg: Pong) -> float:
        """A PONG on this peer's connection; returns the round trip in seconds."""
        self._last_pong = time.monotonic()
        self._unanswered = 0
        return max(0.0, self._last_pong - msg.time)

    async def connect_first(self, lane: str = "control") -> Connection:
        """The first connection (retrying while the peer starts), then keep it up."""
        conn = await self.daemon.dial(self.address, lane)
        await self._adopt(conn)
        self._task = self.daemon.spawn(
            self._keep(conn), f"{self.daemon.instance_id} keeps {self.name}"
        )
        return conn

    def link(self) -> Link:
        """This lane as a link the daemon needs (its readiness)."""
        up = self.up.is_set()
        detail = "" if up else (self.last_loss or f"dialling {self.address[0]}:{self.address[1]}")
        return Link(up, self.changed_at, detail)

    def stats(self) -> dict[str, object]:
        return {
            "up": self.up.is_set(),
            "address": f"{self.address[0]}:{self.address[1]}",
            "connects": self.connects,
            "losses": self.losses,
            "last_loss": self.last_loss,
            "dropped_while_down": self.dropped,
        }

    # -- internals -------------------------------------------------------------------------------

    async def _adopt(self, conn: Connection) -> None:
        self.box = self.daemon.outbox(conn, self.name)
        self._last_pong = time.monotonic()
        self._unanswered = 0
        self.connects += 1
        if self.on_up is not None:
            await self.on_up(conn)
        self.up.set()
        self._changed()

    def _changed(self) -> None:
        self.changed_at = time.time()
        self.daemon.link_changed(self.name)

    async def _keep(self, conn: Connection) -> None:
        while True:
            beat = asyncio.get_running_loop().create_task(self._heartbeat(conn))
            try:
                await self.daemon._serve(conn)  # returns when the connection closed
            finally:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
            self.up.clear()
            if self.daemon.closing:
                return  # the daemon is shutting down: nothing to keep up any more
            self.losses += 1
            self.last_loss = conn.close_reason or "closed"
            self._changed()
            self.daemon.forget_outbox(self.box)
            conn = await self._reconnect()

    async def _reconnect(self) -> Connection:
        from pddnet.transport import DialError

        backoff = 0.1
        while not self.daemon.closing:
            try:
                conn = await self.daemon.dial_once(self.address, "control")
            except DialError as exc:
                self.last_loss = f"redial: {exc}"
            except Exception as exc:  # whatever it was: a keeper that dies leaves the link down
                log.exception(
                    "%s: redialling %s failed unexpectedly", self.daemon.instance_id, self.name
                )
                self.last_loss = f"redial: {type(exc).__name__}: {exc}"
            else:
                try:
                    await self._adopt(conn)
                    return conn
                except (DialError, OSError) as exc:  # e.g. P's bulk lanes to MD
                    self.last_loss = f"reconnect: {exc}"
                    self.daemon.forget_outbox(self.box)
                    await conn.close(f"reconnect failed: {exc}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 2.0)
        raise asyncio.CancelledError  # closing: end the keeper quietly

    async def _heartbeat(self, conn: Connection) -> None:
        while not conn.closed:
            await asyncio.sleep(self.heartbeat_s)
            silent = await silent_past_deadline(
                lambda: self._last_pong, lambda: self._unanswered, self.deadline_s
            )
            if silent is not None:
                self.daemon.counters["heartbeat_deadlines"] += 1
                await conn.close(
                    f"heartbeat deadline: no PONG from {self.name} for "
                    f"{silent:.1f} s (deadline {self.deadline_s:g} s)"
                )
                return
            self._nonce += 1
            self._unanswered += 1
            self.post(Ping(nonce=self._nonce, time=time.monotonic()))
