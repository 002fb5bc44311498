"""A connection a process dials and keeps: heartbeats with a deadline, redial after a loss.

The dialling side of every control lane (P -> RLD, P -> MD, RLD -> MD) and of the router's
events lanes (router -> P, RLD, MD) is a Peer; what it needs from the process that keeps it (a
daemon, the router) is a `PeerHost`. While it is up it sends PING every `heartbeat_s`. The lane is
lost when nothing at all arrived from the peer for `deadline_s` (no PONG, no message, no part of
a frame) with two PINGs unanswered: a hung or partitioned peer (TCP alone would wait for
minutes); the connection is closed with that reason. A late PONG alone is not a loss: on a slow
WAN our PINGs wait in the bottleneck queue behind the bulk KV going the same way (P's, even for
RLD's and the router's lanes) for longer than the deadline, while the peer is alive and
receiving. So the accepting side beats too (`beat`, a PING of its own every `heartbeat_s` while
bytes reach it), and the dialler hears it over the other direction. Either way a lost
connection ends the host's `serve` (a daemon's `connection_lost` fails or re-routes the
requests that depended on it) and runs its `link_changed` (the router replays the requests the
peer carried); the Peer redials with backoff until the host closes, so a restarted peer rejoins
without restarting anybody else. `on_up(conn)` runs after every (re)connect, before messages
are read, e.g. P dials the bulk lanes that go with MD's control lane.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pddnet.protocol import Message, Ping, Pong
from pddnet.transport import Connection, ConnectionClosed

from .outbox import Outbox
from .readiness import Link

log = logging.getLogger("pddnet.roles")


async def silent_past_deadline(
    last_heard: Callable[[], float], unanswered: Callable[[], int], deadline_s: float
) -> float | None:
    """How long a peer has been silent, when that makes it lost (else None): nothing heard from
    it (`last_heard`: a PONG, or any bytes) for `deadline_s` and two PINGs unanswered (a stall
    of our own event loop is not the peer's), judged again after the readers had a turn (bytes
    that arrived during such a stall may still wait to be read: this timer can run first)."""
    if time.monotonic() - last_heard() <= deadline_s or unanswered() < 2:
        return None
    await asyncio.sleep(0.05)
    silent = time.monotonic() - last_heard()
    return silent if silent > deadline_s and unanswered() >= 2 else None


async def beat(
    conn: Connection, heartbeat_s: float, deadline_s: float, last_heard: Callable[[], float]
) -> None:
    """The accepting side's heartbeat on `conn` (a control or events lane someone dialled): a
    PING every `heartbeat_s` until the connection closes, so that the dialler hears us over our
    direction of the line while its own PINGs queue behind bulk bytes in the other.

    Only while we hear the line ourselves (`last_heard`: bytes arrived on any lane we accepted
    within `deadline_s`): a beat says "alive, and your side's bytes reach me". When the direction
    toward us alone is cut, nothing arrives and we fall silent too, so the dialler still loses
    the lane (after our deadline and then its own). Nothing is judged here: the dialler's Peer
    judges the lane and closes it."""
    nonce = 0
    while not conn.closed:
        await asyncio.sleep(heartbeat_s)
        if time.monotonic() - last_heard() > deadline_s:
            continue
        nonce += 1
        try:
            await conn.send(Ping(nonce=nonce, time=time.monotonic()))
        except ConnectionClosed:
            return


@dataclass(frozen=True)
class PeerHost:
    """What a Peer needs from the process that keeps it (a daemon's: Daemon.peer; the router
    builds its own)."""

    name: str  # who keeps the peer, for logs and task names
    dial: Callable[[tuple[str, int], str], Awaitable[Connection]]  # the first dial, retrying
    dial_once: Callable[[tuple[str, int], str], Awaitable[Connection]]  # one redial attempt
    serve: Callable[[Connection], Awaitable[None]]  # read the connection until it closes
    outbox: Callable[[Connection, str], Outbox]
    forget_outbox: Callable[[Outbox | None], None]  # a lost connection's outbox
    spawn: Callable[[Awaitable[Any], str], asyncio.Task]
    closing: Callable[[], bool]  # ends the redial loop (see Peer._reconnect)
    link_changed: Callable[[str], None]  # the lane `name` went up or down
    counters: MutableMapping[str, int]  # where "heartbeat_deadlines" are counted


class Peer:
    def __init__(
        self,
        host: PeerHost,
        address: tuple[str, int],
        name: str,
        *,
        heartbeat_s: float,
        deadline_s: float,
        on_up: Callable[[Connection], Awaitable[None]] | None = None,
        lane: str = "control",
        backoff: tuple[float, float] = (0.1, 2.0),  # the redial's first and longest wait
    ) -> None:
        if heartbeat_s <= 0 or deadline_s <= heartbeat_s:
            raise ValueError(f"need 0 < heartbeat_s < deadline_s, got {heartbeat_s}, {deadline_s}")
        self.host = host
        self.address = address
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.deadline_s = deadline_s
        self.on_up = on_up
        self.lane = lane
        self.backoff = backoff
        self.box: Outbox | None = None  # None while the lane is down
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

    # -- what the host uses ----------------------------------------------------------------------

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

    async def connect_first(self) -> Connection:
        """The first connection (retrying while the peer starts), then keep it up."""
        conn = await self.host.dial(self.address, self.lane)
        await self._adopt(conn)
        self._task = self.host.spawn(self._keep(conn), f"{self.host.name} keeps {self.name}")
        return conn

    def start(self) -> None:
        """Dial in the background (with the redial's backoff) and keep the lane up: for a host
        that must not wait for its peer, e.g. the router, which answers /health meanwhile."""
        self._task = self.host.spawn(self._keep(None), f"{self.host.name} keeps {self.name}")

    async def close(self) -> None:
        """Stop keeping the lane and close it (once the host's `closing` is true)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self.box is not None:
            await self.box.close()

    def link(self) -> Link:
        """This lane as a link the host needs (its readiness)."""
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
        self.box = self.host.outbox(conn, self.name)
        self._last_pong = time.monotonic()
        self._unanswered = 0
        self.connects += 1
        if self.on_up is not None:
            await self.on_up(conn)
        self.up.set()
        log.info("%s: connected to %s at %s:%d", self.host.name, self.name, *self.address)
        self._changed()

    def _changed(self) -> None:
        self.changed_at = time.time()
        self.host.link_changed(self.name)

    async def _keep(self, conn: Connection | None) -> None:
        if conn is None:
            conn = await self._reconnect()
        while True:
            beat = asyncio.get_running_loop().create_task(self._heartbeat(conn))
            try:
                await self.host.serve(conn)  # returns when the connection closed
            finally:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
            self.up.clear()
            if self.host.closing():
                return  # the host is shutting down: nothing to keep up any more
            self.losses += 1
            self.last_loss = conn.close_reason or "closed"
            box, self.box = self.box, None
            self.host.forget_outbox(box)
            self._changed()
            conn = await self._reconnect()

    async def _reconnect(self) -> Connection:
        from pddnet.transport import DialError

        backoff, longest = self.backoff
        # `closing`, not only the task's cancel: Python 3.11's wait_for can swallow the cancel
        # (when the awaited close of a lost lane finishes in the same step), and this loop then
        # redialled a stopped peer for ever.
        while not self.host.closing():
            try:
                conn = await self.host.dial_once(self.address, self.lane)
            except DialError as exc:
                self.last_loss = f"redial: {exc}"
            except Exception as exc:  # whatever it was: a keeper that dies leaves the link down
                log.exception("%s: redialling %s failed unexpectedly", self.host.name, self.name)
                self.last_loss = f"redial: {type(exc).__name__}: {exc}"
            else:
                try:
                    await self._adopt(conn)
                    return conn
                except (DialError, OSError) as exc:  # e.g. P's bulk lanes to MD
                    self.last_loss = f"reconnect: {exc}"
                    box, self.box = self.box, None
                    self.host.forget_outbox(box)
                    await conn.close(f"reconnect failed: {exc}")
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, longest)
        raise asyncio.CancelledError  # closing: end the keeper quietly

    async def _heartbeat(self, conn: Connection) -> None:
        while not conn.closed:
            await asyncio.sleep(self.heartbeat_s)
            silent = await silent_past_deadline(
                lambda: max(self._last_pong, conn.last_received),
                lambda: self._unanswered,
                self.deadline_s,
            )
            if silent is not None:
                self.host.counters["heartbeat_deadlines"] = (
                    self.host.counters.get("heartbeat_deadlines", 0) + 1
                )
                await conn.close(
                    f"heartbeat deadline: nothing from {self.name} for "
                    f"{silent:.1f} s (deadline {self.deadline_s:g} s)"
                )
                return
            self._nonce += 1
            self._unanswered += 1
            self.post(Ping(nonce=self._nonce, time=time.monotonic()))
