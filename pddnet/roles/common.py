"""The shell every PDD daemon (P, RLD, MD) shares: listen, dial peers, route messages, emit to the
router, run per-request engine work in order, count, and close without leaving anything behind.

A daemon is thin: a request's decisions live in pddnet.lifecycle's machines (sans-IO),
compute in the engine behind an EngineWorker (one thread), bytes in pddnet.transport. What is
left here is glue: which connection a message came on, and where an action's message goes.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from pddnet.config import ClusterConfig, DaemonSection
from pddnet.device.dilation import wallclock
from pddnet.protocol import Message, Pong
from pddnet.transport import Connection, Server, dial, dial_with_retry

from .daemon_stats import DaemonStats
from .engine_host import EngineHost
from .inbox import read_in_order
from .ordering import RecentIds
from .outbox import Outbox
from .peer import Peer, PeerHost, beat
from .readiness import STARTED, Link, all_up
from .to_router import ToRouter

log = logging.getLogger("pddnet.roles")


def instance_id(config: ClusterConfig, role: str) -> str:
    name = re.sub(r"[^A-Za-z0-9._:-]", "-", config.name)[:100] or "pdd"
    return f"{name}.{role}"


class Daemon(EngineHost, ToRouter, DaemonStats):
    """Base of PrefillDaemon, RelayDaemon, MainDecodeDaemon.

    Subclasses set ``role`` (wire role, REQUEST_DONE producer and the name of their config
    table, ``section``), and implement ``handle(conn, msg)``, ``on_step(outputs)`` and
    ``dial_peers()``.
    """

    role: str = ""

    def __init__(self, config: ClusterConfig) -> None:
        config.validate()
        self.emulation = config.emulation()  # the modelled accelerator (None: unpaced)
        config = wallclock(config)  # timeouts, heartbeats, rates on this box's clock
        if not config.secret:
            raise ValueError(
                "config.secret is empty: daemons authenticate every connection "
                "with the cluster secret (pdd up generates one)"
            )
        self.config = config
        self.section: DaemonSection = getattr(config, self.role)
        self.instance_id = instance_id(config, self.role)
        self.secret = config.secret.encode()
        self.server: Server | None = None
        self.port: int | None = None
        self.counters: Counter[str] = Counter()
        self.init_engine()
        self.ended = RecentIds()
        self._router: list[Outbox] = []  # events lanes, most recent last
        self._outboxes: list[Outbox] = []
        self.peers: list[Peer] = []
        self.metrics: Any = None  # pddnet.obs.metrics.MetricsServer, when enabled
        self._tasks: set[asyncio.Task] = set()
        self._closed = asyncio.Event()
        self._closing = False
        self._started = Link(False, time.time(), "starting: loading the model, dialling its peers")

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model, start the engine thread, listen, then dial peers (retrying)."""
        await self.start_engine()
        sec = self.section
        self.server = Server(
            sec.host,
            sec.port,
            role=self.role,
            instance_id=self.instance_id,
            secret=self.secret,
            on_connection=self._on_connection,
        )
        self.port = await self.server.start()
        if sec.metrics_port is not None:
            from pddnet.obs.metrics import start_metrics_server

            self.metrics = await start_metrics_server(
                sec.host, sec.metrics_port, self.stats, self.role
            )
        try:
            await self.dial_peers()
        except BaseException:
            await self.close()
            raise
        self._started = Link(True, time.time())
        self.link_changed(STARTED)
        log.info("%s listening on %s:%d", self.instance_id, sec.host, self.port)

    @property
    def closing(self) -> bool:
        return self._closing

    async def serve_forever(self) -> None:
        await self._closed.wait()

    async def close(self) -> None:
        """Close connections, stop the engine thread, free the pool (and its shm segment)."""
        if self._closing:
            await self._closed.wait()
            return
        self._closing = True
        try:
            if self.server is not None:
                await self.server.close()
            await asyncio.gather(*(box.close() for box in self._outboxes))  # see Server.close
            tasks = [t for t in self._tasks if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.close_extra()
            if self.metrics is not None:
                await self.metrics.close()
            if self.worker is not None:
                await self.worker.close()
            if self.engine is not None:
                self.engine.close()
        finally:
            self._closed.set()

    async def close_extra(self) -> None:
        """Subclass resources (regions, striped senders), closed before the engine."""

    # -- connections -------------------------------------------------------------------------

    async def dial(self, address: tuple[str, int], lane: str) -> Connection:
        host, port = address
        return await dial_with_retry(
            host,
            port,
            role=self.role,
            instance_id=self.instance_id,
            lane=lane,
            secret=self.secret,
            attempts=150,
            delay=0.2,
        )

    async def dial_once(self, address: tuple[str, int], lane: str) -> Connection:
        """One attempt (a Peer's redial loop does its own backoff)."""
        host, port = address
        return await dial(
            host, port, role=self.role, instance_id=self.instance_id, lane=lane, secret=self.secret
        )

    def outbox(self, conn: Connection, name: str) -> Outbox:
        box = Outbox(conn, f"{self.instance_id} -> {name}")
        self._outboxes.append(box)
        return box

    def forget_outbox(self, box: Outbox | None) -> None:
        """A closed connection's outbox (its task has ended): stop counting it."""
        if box is not None and box in self._outboxes:
            self._outboxes.remove(box)
            self.spawn(box.close(), f"close {box.name}")

    def peer(
        self,
        address: tuple[str, int],
        name: str,
        on_up: Callable[[Connection], Awaitable[None]] | None = None,
    ) -> Peer:
        """A control lane this daemon dials and keeps up (heartbeats, redial)."""
        wan = self.config.wan
        host = PeerHost(
            name=self.instance_id,
            dial=self.dial,
            dial_once=self.dial_once,
            serve=self._serve,
            outbox=self.outbox,
            forget_outbox=self.forget_outbox,
            spawn=self.spawn,
            closing=lambda: self.closing,
            link_changed=self.link_changed,
            counters=self.counters,
        )
        p = Peer(
            host,
            address,
            name,
            heartbeat_s=wan.heartbeat_s,
            deadline_s=wan.heartbeat_deadline_s,
            on_up=on_up,
        )
        self.peers.append(p)
        return p

    def spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error(
                "%s: task %s failed", self.instance_id, task.get_name(), exc_info=task.exception()
            )

    async def _on_connection(self, conn: Connection) -> None:
        if conn.lane == "events":
            box = self.outbox(conn, f"{conn.peer_role} events")
            self._router.append(box)
            self._report_links(box)
        if conn.lane == "bulk":
            await self._serve(conn)
            return
        # Our beats let the dialler hear us while its PINGs queue behind bulk KV (peer.py).
        wan, server = self.config.wan, self.server
        assert server is not None  # it accepted this connection
        beating = self.spawn(
            beat(conn, wan.heartbeat_s, wan.heartbeat_deadline_s, lambda: server.last_received),
            f"beat {conn.peer_role} {conn.lane}",
        )
        try:
            await self._serve(conn)
        finally:
            beating.cancel()

    async def _serve(self, conn: Connection) -> None:
        """Read a connection until it closes (pddnet/roles/inbox.py), then forget its lanes."""
        await read_in_order(
            conn,
            lambda msg: self._handle_safely(conn, msg),
            lambda msg: self.on_pong(conn, msg),
            f"{self.instance_id} handles {conn.peer_role} {conn.lane}",
        )
        self.connection_lost(conn)
        # The connection's outboxes wait for messages that can no longer go anywhere.
        for box in [b for b in self._outboxes if b.conn is conn]:
            self.forget_outbox(box)
        self._router = [b for b in self._router if b.conn is not conn]

    async def _handle_safely(self, conn: Connection, msg: Message) -> None:
        try:
            await self.handle(conn, msg)
        except Exception as exc:  # one bad request must not end the connection
            rid = getattr(msg, "request_id", None)
            log.exception(
                "%s: handling %s from %s failed", self.instance_id, msg.TYPE.name, conn.peer_role
            )
            self.counters["errors"] += 1
            self.error(rid, "internal", f"{self.role} failed on {msg.TYPE.name}: {exc}")

    def connection_lost(self, conn: Connection) -> None:
        """A connection closed (override to fail the requests that depended on it)."""

    def on_pong(self, conn: Connection, msg: Pong) -> None:
        """A PONG to one of our PINGs: the peer is alive."""
        for p in self.peers:
            if p.conn is conn:
                self.on_rtt(conn, p.pong(msg))

    def on_rtt(self, conn: Connection, rtt_s: float) -> None:
        """A round-trip sample on a dialled lane (override to use it)."""

    async def handle(self, conn: Connection, msg: Message) -> None:  # pragma: no cover
        raise NotImplementedError

    async def dial_peers(self) -> None:
        """Dial the daemons this one sends to (none by default)."""

    # -- readiness (pddnet/roles/readiness.py) --------------------------------------------------

    def links(self) -> dict[str, Link]:
        """Every link this daemon needs, by name: started, then each lane it dials."""
        return {STARTED: self._started, **{p.name: p.link() for p in self.peers}}

    @property
    def ready(self) -> bool:
        return all_up(self.links())

    def link_changed(self, name: str) -> None:
        """A link went up or down: tell the router (and what that does to our readiness)."""
        links = self.links()
        if name in links:
            self.to_router(links[name].message(name, all_up(links)), drop_quietly=True)

    def _report_links(self, box: Outbox) -> None:
        """Every link's state, to a router whose events lane just connected."""
        links = self.links()
        ready = all_up(links)
        for name, link in links.items():
            box.post(link.message(name, ready))
