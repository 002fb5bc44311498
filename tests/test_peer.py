"""Peer without a daemon: any process that gives it a PeerHost keeps a lane up (the router does)."""

from __future__ import annotations

import asyncio
from collections import Counter

from pddnet.cluster.wan_setup import free_port
from pddnet.protocol import messages as m
from pddnet.roles.outbox import Outbox
from pddnet.roles.peer import Peer, PeerHost
from pddnet.transport import Connection, Server, dial
from tests.polling import wait_for

SECRET = b"s3cret"


class Host:
    """The smallest keeper of a Peer: reads PONGs, records link changes."""

    def __init__(self) -> None:
        self.closing = False
        self.changes: list[bool] = []
        self.counters: Counter[str] = Counter()
        self.tasks: set[asyncio.Task] = set()
        self.peer: Peer | None = None

    def peer_host(self) -> PeerHost:
        async def dial_once(address: tuple[str, int], lane: str) -> Connection:
            return await dial(*address, role="router", instance_id="t", lane=lane, secret=SECRET)

        return PeerHost(
            name="test",
            dial=dial_once,
            dial_once=dial_once,
            serve=self.serve,
            outbox=lambda conn, name: Outbox(conn, name),
            forget_outbox=lambda box: None if box is None else self.spawn(box.close(), "close"),
            spawn=self.spawn,
            closing=lambda: self.closing,
            link_changed=lambda name: self.changes.append(self.peer.up.is_set()),
            counters=self.counters,
        )

    async def serve(self, conn: Connection) -> None:
        async for msg in conn:
            if isinstance(msg, m.Pong):
                self.peer.pong(msg)

    def spawn(self, coro, name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        return task


def daemon(port: int, answers: bool) -> Server:
    """A daemon's events lane: answers PINGs (or, hung, never does)."""

    async def on_connection(conn: Connection) -> None:
        async for msg in conn:
            if answers and isinstance(msg, m.Ping):
                await conn.send(m.Pong(nonce=msg.nonce, time=msg.time))

    return Server(
        "127.0.0.1",
        port,
        role="prefill",
        instance_id="p",
        secret=SECRET,
        on_connection=on_connection,
    )


def check(cond):
    """A plain condition as tests.polling.wait_for's awaitable one."""

    async def awaitable():
        return cond()

    return awaitable


def make_peer(host: Host, port: int) -> Peer:
    host.peer = Peer(
        host.peer_host(),
        ("127.0.0.1", port),
        "prefill",
        heartbeat_s=0.05,
        deadline_s=0.3,
        lane="events",
        backoff=(0.02, 0.1),
    )
    return host.peer


async def test_a_peer_started_before_its_daemon_connects_and_rejoins_after_a_restart():
    port = free_port()
    host = Host()
    peer = make_peer(host, port)
    peer.start()  # nobody listens yet: it keeps dialling
    await asyncio.sleep(0.2)
    assert peer.conn is None and "redial" in peer.last_loss and host.changes == []
    server = daemon(port, answers=True)
    await server.start()
    await asyncio.wait_for(peer.up.wait(), 5)
    assert peer.alive and peer.conn.lane == "events" and host.changes == [True]
    await server.close()
    await wait_for(check(lambda: peer.conn is None), 5, "the lane to be seen lost")
    assert host.changes == [True, False] and peer.losses == 1 and not peer.alive
    server = daemon(port, answers=True)
    await server.start()
    await wait_for(check(lambda: peer.alive), 5, "the redial")
    assert host.changes == [True, False, True] and peer.connects == 2
    host.closing = True
    await asyncio.wait_for(peer.close(), 5)
    await server.close()
    assert host.counters["heartbeat_deadlines"] == 0


async def test_a_hung_daemon_is_lost_at_the_heartbeat_deadline():
    port = free_port()
    server = daemon(port, answers=False)
    await server.start()
    host = Host()
    peer = make_peer(host, port)
    peer.start()
    await asyncio.wait_for(peer.up.wait(), 5)
    await wait_for(check(lambda: host.counters["heartbeat_deadlines"] >= 1), 5, "the deadline")
    await wait_for(check(lambda: False in host.changes), 5, "the loss to be reported")
    assert peer.last_loss.startswith("heartbeat deadline: nothing from prefill")
    host.closing = True  # the redial loop ends on `closing`, even if a cancel is swallowed
    await asyncio.wait_for(peer.close(), 5)
    await server.close()
