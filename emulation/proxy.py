"""The proxy shell: an asyncio TCP proxy on loopback that runs the link model (no root needed).

    client ──> [listen] ── link.a_to_b ──> upstream
    client <──           ── link.b_to_a <── upstream

Every connection's bytes, split into chunks of at most `chunk_bytes`, are offered to the one
shared `Link` (so flows share its bottleneck the way flows share a WAN) and written out at the
departure times the model gives. A TCP stream cannot lose, duplicate or reorder bytes, so:

- backpressure instead of tail drop: while the bottleneck queue is full a connection takes at
  most one packet (1,500 B) off its socket and waits its turn (and while its destination
  socket is not draining, none), so TCP flow control pushes back on the sender, as a full
  router queue does in the end. Turns go in arrival order (`_Lane.admit`): a small message
  behind bulk flows waits for the queue ahead of it, as in a router's FIFO;
- partition / blackhole hold bytes: nothing is delivered in that direction until heal (each
  connection holds at most the one packet it has taken);
- loss, Gilbert-Elliott, duplication and reordering are refused (`Link.restrict`): setting them
  on a proxied link raises ValueError (a 400 on the control API);
- traffic classes: a connection takes the DSCP its client marked its handshake with (the TOS
  Linux records for a TCP connection when it is set up, read when it is accepted) for both
  directions, so with `priority_dscp` set, a marked connection's bytes go in the model's
  priority class and wait their turn only behind each other;
- closing is slow: a FIN travels through the model behind the data, so it arrives one link
  delay (plus queueing) after the close; `reset_connections()` aborts with RST at once.

Timers: asyncio wakes ~0.5 ms late (epoll/libuv millisecond timeouts). For departures from an
idle bottleneck (where that error would show in an RTT) the driver wakes 1 ms early and spins
to the exact time; under load, queueing dominates and it just sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import socket
import struct
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from emulation.effects import LOSSY_EFFECTS
from emulation.link import Link, LinkDirection, earliest

PROXY_RESTRICTION = (
    "the proxy shell carries TCP byte streams, which cannot lose, duplicate or "
    "reorder bytes; use the packet shell (pdd wan packet) for that"
)
log = logging.getLogger("pddnet.wan.proxy")
_EOF = object()  # an end-of-stream marker travelling through the model like data
_SPIN_S = 0.0015  # wake this much early for precise departures, then spin
_PRECISE_MAX_ITEMS = 8  # spin only on a lightly loaded link: under load it would burn a core
_DEST_HIGH_WATER = 1 << 20
# A reader waits for one packet's room, as a router's queue takes a packet whenever one fits.
# Waiting for a whole read's room (chunk_bytes) made every reader wait for a buffer smaller
# than a read to drain completely: a 267-byte HANDOFF then sat behind all of a bulk flow's
# queue (at k = 5 a 20 ms buffer of a 2 Gbit/s line is 22 KB of real bytes).
_PACKET_BYTES = 1500
# Linux: a TCP socket's received IP options, as ancillary data; with IP_RECVTOS on they hold the
# TOS byte the connection was set up with (not in Python's socket module).
_IP_PKTOPTIONS = 9
_IP_RECVTOS = 13


def received_dscp(sock: socket.socket | None) -> int:
    """The DSCP the peer of `sock` (an accepted IPv4 TCP socket with IP_RECVTOS set) marked the
    connection's handshake with; 0 where the platform cannot tell."""
    if sock is None:
        return 0
    try:
        raw = sock.getsockopt(socket.IPPROTO_IP, _IP_PKTOPTIONS, 64)
    except (OSError, ValueError):
        return 0
    while len(raw) >= 16:  # struct cmsghdr { size_t len; int level; int type; } + data
        length, level, kind = struct.unpack_from("QiI", raw)
        if level == socket.IPPROTO_IP and kind == socket.IP_TOS and length >= 17:
            return raw[16] >> 2
        step = (length + 7) & ~7
        if step <= 0:
            break
        raw = raw[step:]
    return 0


class _Conn:
    def __init__(
        self,
        conn_id: int,
        client: tuple[asyncio.StreamReader, asyncio.StreamWriter],
        upstream: tuple[asyncio.StreamReader, asyncio.StreamWriter],
    ) -> None:
        self.id = conn_id
        self.client_reader, self.client_writer = client
        self.up_reader, self.up_writer = upstream
        self.closed = False
        self.eofs = 0
        self.tasks: list[asyncio.Task] = []
        # the client's marking, for both directions
        self.dscp = received_dscp(self.client_writer.transport.get_extra_info("socket"))

    def writer_for(self, direction: str) -> asyncio.StreamWriter:
        return self.up_writer if direction == "a_to_b" else self.client_writer

    def abort(self, rst: bool = True) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in (self.client_writer, self.up_writer):
            transport = writer.transport
            sock = transport.get_extra_info("socket")
            if rst and sock is not None:
                # ValueError: uvloop's pseudo-socket of a transport that closed already
                with contextlib.suppress(OSError, ValueError):
                    # linger 0: close sends RST, as a middlebox reset would
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for writer in (self.client_writer, self.up_writer):
            writer.close()


class _Lane:
    """One direction of the proxy: the driver task that turns model departures into writes."""

    def __init__(self, proxy: WanProxy, model: LinkDirection) -> None:
        self.proxy = proxy
        self.model = model
        self.name = model.name
        self.in_model = 0  # bytes offered and not yet delivered
        self._waiters: list[asyncio.Future] = []  # waiting for a partition to end
        # Per traffic class (the model's priority class or not): readers with data, in order,
        # and the reader whose turn it is, not yet run.
        self._admission: dict[bool, deque[tuple[asyncio.Future, int, int]]] = {
            False: deque(),
            True: deque(),
        }
        self._granted: dict[bool, asyncio.Future | None] = {False: None, True: None}
        self._wake: asyncio.Future | None = None
        self._planned: float | None = None
        self.task: asyncio.Task | None = None

    # --- readers side -------------------------------------------------------------------

    def room(self, now: float, dscp: int = 0) -> int:
        """Bytes a reader of a connection marked `dscp` may offer now without the model
        dropping or unbounded buffering."""
        if self.model.blocked(now):
            return 0
        space = self.model.queue_space(now, dscp)
        if space is None:  # no rate limit: bound what sits in the delay line instead
            space = self.proxy.max_inflight_bytes - self.in_model
        return max(0, space)

    def capacity(self) -> int:
        """The most room a reader should wait for (queue limit or in-flight cap, one packet)."""
        fx = self.model.effects()
        limit = fx["queue_bytes"] if fx["rate_mbit"] is not None else self.proxy.max_inflight_bytes
        return max(1, min(limit, self.proxy.chunk_bytes, _PACKET_BYTES))

    def read_size(self, dscp: int = 0) -> int:
        """How much a reader may take off its socket now: what fits, or one packet when nothing
        does (the packet on its way into a full router, which then waits its turn in admit)."""
        room = self.room(self.proxy.clock(), dscp)
        return min(self.proxy.chunk_bytes, max(room, self.capacity()))

    def _fits(self, need: int, dscp: int) -> int:
        room = self.room(self.proxy.clock(), dscp)
        return room if room > 0 and room >= min(need, self.capacity()) else 0

    async def admit(self, need: int, dscp: int = 0) -> int:
        """Wait for this reader's turn, in arrival order, and for room for at least
        min(need, one packet); returns the room then, and the caller offers at once (no await
        in between: the room is checked in the step that uses it, or the model would drop the
        excess). A router's queue takes packets in the order they come: a HANDOFF or a PONG
        behind bulk flows waits for the bytes queued ahead of it, not for a race against every
        bulk reader at each freed slot (which doubled a small message's wait behind three
        flows; tests/test_proxy_shell.py). Each traffic class has its own line: a reader in the
        priority class waits only for the priority queue."""
        urgent = self.model.is_priority(dscp)
        line = self._admission[urgent]
        if not line and self._granted[urgent] is None:
            room = self._fits(need, dscp)
            if room:
                return room
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        line.append((fut, need, dscp))
        while True:
            try:
                await fut
            except asyncio.CancelledError:
                if self._granted[urgent] is fut:  # granted, then cancelled: pass the turn on
                    self._granted[urgent] = None
                    self.notify_room()
                raise
            self._granted[urgent] = None
            room = self._fits(need, dscp)
            if room:
                return room
            fut = loop.create_future()  # the link changed meanwhile (a partition): keep our place
            line.appendleft((fut, need, dscp))

    async def wait_open(self) -> None:
        """Wait until this direction is not blocked (a FIN waits out a partition as data does)."""
        while self.model.blocked(self.proxy.clock()):
            fut = asyncio.get_running_loop().create_future()
            self._waiters.append(fut)
            await fut

    def offer(self, conn: _Conn, payload: Any, size: int) -> None:
        now = self.proxy.clock()
        self.model.offer(now, size, (conn, payload), conn.dscp)
        self.in_model += size
        nxt = self.model.next_wakeup()
        if self._planned is None or (nxt is not None and nxt < self._planned):
            self.kick()

    def notify_room(self) -> None:
        """Give the first reader in each class's line its turn if its packet fits (one at a time
        per class: it offers, then calls this for the next), and wake whoever waits for a
        partition's end."""
        for urgent, line in self._admission.items():
            while self._granted[urgent] is None and line:
                fut, need, dscp = line[0]
                if fut.done():  # cancelled while waiting
                    line.popleft()
                    continue
                if self._fits(need, dscp):
                    line.popleft()
                    self._granted[urgent] = fut  # until it has run: nobody overtakes it
                    fut.set_result(None)
                break
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    def kick(self) -> None:
        if self._wake is not None and not self._wake.done():
            self._wake.set_result(None)

    # --- driver -------------------------------------------------------------------------

    async def drive(self) -> None:
        loop = asyncio.get_running_loop()
        clock = self.proxy.clock
        model = self.model
        while True:
            now = clock()
            blocked = model.blocked(now)
            if not blocked:
                for conn, payload in model.poll(now):
                    self._deliver(conn, payload)
            self.notify_room()
            change = model.next_change()
            wake = change if blocked else earliest(model.next_wakeup(), change)
            precise = (
                not blocked
                and wake is not None
                and wake == model.next_departure()
                and model.queued_bytes() == 0
                and model.in_flight_items() <= _PRECISE_MAX_ITEMS
            )
            self._wake = fut = loop.create_future()
            self._planned = wake
            handle = None
            if wake is None:
                await fut
            else:
                delay = wake - clock() - (_SPIN_S if precise else 0.0)
                if delay > 0:
                    handle = loop.call_later(delay, _resolve, fut)
                    await fut
                    handle.cancel()
                    if precise and fut.result() == "timer":
                        while clock() < wake and wake - clock() < 2 * _SPIN_S:
                            pass  # the last ~1.5 ms: asyncio timers are too coarse
                else:
                    # Due now (or within the spin window): one loop turn for I/O, then poll.
                    await asyncio.sleep(0)
            self._planned = None

    def _deliver(self, conn: _Conn, payload: Any) -> None:
        if payload is _EOF:
            if not conn.closed:
                writer = conn.writer_for(self.name)
                with contextlib.suppress(OSError, RuntimeError):
                    if writer.can_write_eof():
                        writer.write_eof()
                conn.eofs += 1
                if conn.eofs == 2:
                    self.proxy._finish(conn)
            return
        self.in_model -= len(payload)
        if not conn.closed:
            try:
                conn.writer_for(self.name).write(payload)
            except (OSError, RuntimeError):
                # The far end vanished (uvloop raises on a closed transport): reset this
                # connection as a middlebox would. Never let it escape: it would end the
                # lane's driver and freeze every other connection in this direction.
                conn.abort(rst=True)
                self.proxy._conns.pop(conn.id, None)


def _lane_ended(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error(
            "WAN proxy lane %s stopped: every connection in that direction is frozen",
            task.get_name(),
            exc_info=task.exception(),
        )


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result("timer")


class WanProxy:
    """TCP proxy applying `link.a_to_b` to client->upstream bytes and `link.b_to_a` back."""

    def __init__(
        self,
        listen: tuple[str, int],
        upstream: tuple[str, int],
        link: Link,
        chunk_bytes: int = 32 * 1024,
        max_inflight_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= chunk_bytes <= 1 << 24:
            raise ValueError(f"chunk_bytes must be in 1..16 MiB, got {chunk_bytes}")
        if max_inflight_bytes < chunk_bytes:
            raise ValueError("max_inflight_bytes must be >= chunk_bytes")
        link.restrict(LOSSY_EFFECTS, PROXY_RESTRICTION)
        self.listen = listen
        self.upstream = upstream
        self.link = link
        self.chunk_bytes = chunk_bytes
        self.max_inflight_bytes = max_inflight_bytes
        self.clock = clock
        self.port: int | None = None
        self._server: asyncio.base_events.Server | None = None
        self._lanes = {"a_to_b": _Lane(self, link.a_to_b), "b_to_a": _Lane(self, link.b_to_a)}
        self._conns: dict[int, _Conn] = {}
        self._ids = itertools.count(1)
        self.accepted = 0
        self.upstream_failures = 0
        link.subscribe(self._on_link_change)

    @property
    def connections(self) -> int:
        return len(self._conns)

    async def start(self) -> WanProxy:
        for lane in self._lanes.values():
            lane.task = asyncio.create_task(lane.drive(), name=f"wan-proxy-{lane.name}")
            lane.task.add_done_callback(_lane_ended)
        self._server = await asyncio.start_server(
            self._accept, self.listen[0], self.listen[1], limit=self.chunk_bytes * 2
        )
        for sock in self._server.sockets:
            if sock.family == socket.AF_INET:  # accepted sockets inherit it: see _Conn.dscp
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_IP, _IP_RECVTOS, 1)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        self.link.unsubscribe(self._on_link_change)
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns.values()):
            conn.abort(rst=False)
            for task in conn.tasks:
                task.cancel()
        for lane in self._lanes.values():
            if lane.task is not None:
                lane.task.cancel()
        tasks = [t for c in self._conns.values() for t in c.tasks]
        tasks += [lane.task for lane in self._lanes.values() if lane.task is not None]
        await asyncio.gather(*tasks, return_exceptions=True)
        self._conns.clear()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None

    async def __aenter__(self) -> WanProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def reset_connections(self) -> int:
        """Abort every proxied connection with RST on both sides; returns how many."""
        conns = list(self._conns.values())
        for conn in conns:
            conn.abort(rst=True)
            self._conns.pop(conn.id, None)
        return len(conns)

    def _on_link_change(self) -> None:
        for lane in self._lanes.values():
            lane.kick()
            lane.notify_room()

    def _finish(self, conn: _Conn) -> None:
        conn.close()
        self._conns.pop(conn.id, None)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up = await asyncio.open_connection(
                self.upstream[0], self.upstream[1], limit=self.chunk_bytes * 2
            )
        except OSError:
            # Reset, not a clean close: a dialler then sees a refusal and retries, as it would
            # without the proxy, instead of an EOF it cannot tell from a peer that refused it
            # (so daemons may start in any order behind the proxy).
            self.upstream_failures += 1
            sock = writer.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError, ValueError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
            return
        for w in (writer, up[1]):
            sock = w.transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(next(self._ids), (reader, writer), up)
        self._conns[conn.id] = conn
        self.accepted += 1
        conn.tasks = [
            asyncio.create_task(self._pump(conn, self._lanes["a_to_b"], reader, up[1])),
            asyncio.create_task(self._pump(conn, self._lanes["b_to_a"], up[0], writer)),
        ]

    async def _pump(
        self, conn: _Conn, lane: _Lane, reader: asyncio.StreamReader, dest: asyncio.StreamWriter
    ) -> None:
        """Read one side of a connection and offer it to the model, with backpressure."""
        try:
            while not conn.closed:
                if dest.transport.get_write_buffer_size() > _DEST_HIGH_WATER:
                    await dest.drain()
                data = await reader.read(lane.read_size(conn.dscp))
                if conn.closed:
                    return
                if not data:
                    await lane.wait_open()  # a FIN waits out a partition like data does
                    if not conn.closed:
                        lane.offer(conn, _EOF, 0)
                    return
                view = memoryview(data)
                while view:
                    room = await lane.admit(len(view), conn.dscp)
                    if conn.closed:
                        lane.notify_room()  # its turn goes to the next in line
                        return
                    piece = bytes(view[:room])
                    view = view[len(piece) :]
                    lane.offer(conn, piece, len(piece))
                    lane.notify_room()  # the next in line, if its packet fits too
        except (ConnectionError, OSError):
            # The peer reset or vanished: reset the other side too, as a middlebox would.
            conn.abort(rst=True)
            self._conns.pop(conn.id, None)


# A WanProxy in a process of its own (so its CPU time is measured apart from the traffic's),
# on the loop `pdd wan proxy` runs; it ends when its stdin closes.
_PROCESS = """
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from emulation.link import Link
from emulation.proxy import WanProxy
async def main():
    upstream = ("127.0.0.1", int(sys.argv[2]))
    async with WanProxy(("127.0.0.1", 0), upstream, Link(**json.loads(sys.argv[3]))) as proxy:
        print(proxy.port, flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
try:
    from uvloop import run
except ImportError:
    from asyncio import run
run(main())
"""


@contextlib.contextmanager
def proxy_process(upstream_port: int, **effects: Any) -> Iterator[tuple[int, int]]:
    """A proxy-shell link with `effects` in its own process, in front of 127.0.0.1:upstream_port:
    yields (the port to connect to, the process's pid); ended on leaving."""
    root = str(Path(__file__).resolve().parents[1])
    proc = subprocess.Popen(
        [sys.executable, "-c", _PROCESS, root, str(upstream_port), json.dumps(effects)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        if not line.strip().isdigit():
            raise RuntimeError(f"the WAN proxy did not start (printed {line!r})")
        yield int(line), proc.pid
    finally:
        if proc.stdin:
            proc.stdin.close()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
