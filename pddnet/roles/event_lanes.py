"""The router's events lanes to its daemons: one `Peer` each (heartbeats, deadline, redial).

Heartbeats are answered by the reader at once; each daemon's LINK_STATE is kept for /health
(pddnet/roles/readiness.py); every other message goes to the router (`on_message`), and a lost
lane is reported once (`on_lost`) after the Peer saw it go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from pddnet.config import ClusterConfig
from pddnet.protocol import messages as m
from pddnet.roles.outbox import Outbox
from pddnet.roles.peer import Peer, PeerHost
from pddnet.roles.readiness import DaemonLinks
from pddnet.transport import Connection, ConnectionClosed, dial

log = logging.getLogger("pddnet.router")


class EventLanes:
    def __init__(
        self,
        config: ClusterConfig,
        roles: tuple[str, ...],
        instance_id: str,
        on_message: Callable[[str, m.Message], Awaitable[None]],
        on_lost: Callable[[str, str], None],
        spawn: Callable[[Awaitable[Any], str], asyncio.Task],
        counters: MutableMapping[str, int],
    ) -> None:
        self.config = config
        self.instance_id = instance_id
        self.on_message = on_message
        self.on_lost = on_lost
        self.spawn = spawn  # for the lanes' small jobs (closing a lost lane's outbox)
        self.counters = counters
        self.closing = False  # ends the redial loops (see Peer._reconnect)
        self.links = {r: DaemonLinks() for r in roles}  # each daemon's LINK_STATE
        self.peers = {r: self._peer(r) for r in roles}
        self._keepers: set[asyncio.Task] = set()

    def start(self) -> None:
        for peer in self.peers.values():
            peer.start()

    async def close(self) -> None:
        self.closing = True
        # all at once: each close may wait up to a second for its peer to take the last bytes
        await asyncio.gather(*(peer.close() for peer in self.peers.values()))

    def connected(self) -> frozenset[str]:
        """The daemons whose events lane is up now."""
        return frozenset(r for r, p in self.peers.items() if p.alive)

    async def send(self, role: str, msg: m.Message) -> None:
        """Send now (raises ConnectionError when the lane is down)."""
        conn = self.peers[role].conn
        if conn is None:
            raise ConnectionError(f"not connected to {role}")
        await conn.send(msg)

    def readiness(self) -> dict[str, Any]:
        """Ready when every daemon is connected and reports all its links up; otherwise what
        it waits for, one line per link."""
        waiting: list[str] = []
        up = self.connected()
        for role, peer in self.peers.items():
            if role not in up:
                waiting.append(
                    f"{role}: the router's events lane is not connected"
                    + (f" ({peer.last_loss})" if peer.last_loss else "")
                )
            else:
                waiting += self.links[role].waiting_for(role)
        return {
            "ready": not waiting,
            "waiting_for": waiting,
            "peers": {r: r in up and self.links[r].ready for r in self.peers},
            "links": {r: links.to_json() for r, links in self.links.items()},
        }

    def stats(self) -> dict[str, Any]:
        return {
            r: {
                "connected": p.alive,
                "address": f"{p.address[0]}:{p.address[1]}",
                "connects": p.connects,
                "last_error": None if p.alive else (p.last_loss or None),
            }
            for r, p in self.peers.items()
        }

    # -- internals ---------------------------------------------------------------------------------

    def _peer(self, role: str) -> Peer:
        cfg = self.config

        async def dial_once(address: tuple[str, int], lane: str) -> Connection:
            host, port = address
            secret = cfg.secret.encode()
            return await dial(
                host, port, role="router", instance_id=self.instance_id, lane=lane, secret=secret
            )

        host = PeerHost(
            name=self.instance_id,
            dial=dial_once,  # unused: the router's lanes dial in the background (Peer.start)
            dial_once=dial_once,
            serve=lambda conn: self._read(role, conn),
            outbox=lambda conn, name: Outbox(conn, f"{self.instance_id} -> {name}"),
            forget_outbox=self._forget_outbox,
            spawn=self._spawn_keeper,
            closing=lambda: self.closing,
            link_changed=self._link_changed,
            counters=self.counters,
        )
        return Peer(
            host,
            getattr(cfg, role).dial_address(),
            role,
            heartbeat_s=cfg.wan.heartbeat_s,
            deadline_s=cfg.wan.heartbeat_deadline_s,
            lane="events",
            backoff=(0.05, 1.0),
        )

    async def _read(self, role: str, conn: Connection) -> None:
        try:
            async for msg in conn:
                if isinstance(msg, m.Ping):
                    with contextlib.suppress(ConnectionClosed):
                        await conn.send(m.Pong(nonce=msg.nonce, time=msg.time))
                elif isinstance(msg, m.Pong):
                    self.peers[role].pong(msg)
                elif isinstance(msg, m.LinkState):
                    self.links[role].apply(msg)
                    if not msg.up:
                        log.info("%s: %s down (%s)", role, msg.link, msg.detail)
                else:
                    await self.on_message(role, msg)
        except Exception as exc:  # a handler's bug: the lane is lost (and redialled), not the loop
            log.exception("events lane to %s failed", role)
            await conn.close(f"{type(exc).__name__}: {exc}")

    def _link_changed(self, role: str) -> None:
        peer = self.peers[role]
        if not peer.up.is_set():
            self.links[role].reset()
            self.on_lost(role, peer.last_loss)

    def _forget_outbox(self, box: Outbox | None) -> None:
        if box is not None:
            self.spawn(box.close(), f"close {box.name}")

    def _spawn_keeper(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        """The keepers are ended by Peer.close (last, after the HTTP front), not with the
        router's other tasks."""
        task = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._keepers.add(task)
        task.add_done_callback(self._keepers.discard)
        return task
