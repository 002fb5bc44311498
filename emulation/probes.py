"""Measurement tools for the testbed: UDP RTT probes, one-way UDP streams, bulk TCP.

They take sockets rather than addresses to create, so they work across namespaces (sockets
made with netns.socket_in / Testbed.socket) as well as on loopback. Every loop is bounded in
count and time. Timestamps are time.monotonic(), the clock the emulators use too.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TypeVar

_PROBE = struct.Struct("!Qd")  # sequence number, send time

T = TypeVar("T")


def _until_stopped(stop: threading.Event, wait: Callable[[], T]) -> Iterator[T]:
    """What `wait` (a socket call with a timeout) returns, over and over, until `stop` is set or
    the socket fails (closed under it): the loop of every thread here. A timeout only gives the
    loop a chance to see `stop`."""
    while not stop.is_set():
        try:
            got = wait()
        except TimeoutError:
            continue
        except OSError:
            return
        yield got


class _SocketThread:
    """A thread that serves `sock` until stop(): what the echoes share. The socket gets
    `timeout_s` so that the loop (a subclass's `_run`) sees stop() soon."""

    def __init__(self, sock: socket.socket, timeout_s: float, name: str) -> None:
        self.sock = sock
        sock.settimeout(timeout_s)
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)


class UdpEcho(_SocketThread):
    """Echo every datagram back to its sender, in a thread, until stop()."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(sock, 0.1, "udp-echo")

    def _run(self) -> None:
        for data, peer in _until_stopped(self._stop, lambda: self.sock.recvfrom(65535)):
            self.sock.sendto(data, peer)


def udp_rtts(
    sock: socket.socket,
    dst: tuple[str, int],
    count: int,
    interval_s: float = 0.01,
    timeout_s: float = 1.0,
    size: int = 64,
) -> list[float | None]:
    """Send `count` probes one at a time (the next after the reply or a timeout, then at least
    `interval_s` apart); returns each RTT in ms, None for a lost probe."""
    sock.settimeout(timeout_s)
    pad = b"\0" * max(0, size - _PROBE.size)
    out: list[float | None] = []
    for seq in range(count):
        sent = time.monotonic()
        sock.sendto(_PROBE.pack(seq, sent) + pad, dst)
        rtt = None
        while rtt is None:
            remaining = timeout_s - (time.monotonic() - sent)
            if remaining <= 0:
                break
            sock.settimeout(remaining)
            try:
                data = sock.recv(65535)
            except TimeoutError:
                break
            if len(data) >= _PROBE.size and _PROBE.unpack_from(data)[0] == seq:
                rtt = (time.monotonic() - sent) * 1000.0
        out.append(rtt)
        pause = interval_s - (time.monotonic() - sent)
        if pause > 0:
            time.sleep(pause)
    return out


def udp_stream(
    tx: socket.socket,
    rx: socket.socket,
    dst: tuple[str, int],
    count: int,
    interval_s: float = 0.0002,
    size: int = 200,
    drain_s: float = 0.5,
) -> list[int]:
    """Send `count` numbered datagrams one way; returns the sequence numbers received at `rx`,
    in arrival order (compare with range(count) for loss and reordering)."""
    got: list[int] = []
    _big_receive_buffer(rx)
    rx.settimeout(0.05)
    done = threading.Event()

    def receive() -> None:
        quiet_since = None
        while True:
            try:
                data = rx.recv(65535)
                quiet_since = None
            except TimeoutError:
                if done.is_set():
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > drain_s:
                        return
                continue
            got.append(_PROBE.unpack_from(data)[0])

    thread = threading.Thread(target=receive, name="udp-stream-rx", daemon=True)
    thread.start()
    pad = b"\0" * max(0, size - _PROBE.size)
    start = time.monotonic()
    for seq in range(count):
        pause = start + seq * interval_s - time.monotonic()
        if pause > 0:
            time.sleep(pause)  # releases the GIL: the receiving thread must keep up
        tx.sendto(_PROBE.pack(seq, time.monotonic()) + pad, dst)
    done.set()
    thread.join(timeout=drain_s + 5)
    return got


def _big_receive_buffer(sock: socket.socket, size: int = 8 << 20) -> None:
    """A receive buffer that holds a whole test stream, so a briefly descheduled receiver does
    not show up as network loss (SO_RCVBUFFORCE passes rmem_max when root)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUFFORCE, size)
    except (OSError, AttributeError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, size)


@dataclass
class TcpSink:
    """Accept connections on a listening socket and count what arrives, with timestamps."""

    listener: socket.socket
    max_conns: int = 8
    arrivals: list[list[tuple[float, int]]] = field(default_factory=list)  # per connection

    def __post_init__(self) -> None:
        self.listener.settimeout(0.2)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, name="tcp-sink", daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        if self.max_conns < 1:
            return
        for conn, _ in _until_stopped(self._stop, self.listener.accept):
            log: list[tuple[float, int]] = []
            self.arrivals.append(log)
            t = threading.Thread(target=self._drain, args=(conn, log), daemon=True)
            t.start()
            self._threads.append(t)
            if len(self.arrivals) >= self.max_conns:
                return

    def _drain(self, conn: socket.socket, log: list[tuple[float, int]]) -> None:
        buf = bytearray(1 << 20)
        conn.settimeout(0.2)
        with conn:
            for n in _until_stopped(self._stop, lambda: conn.recv_into(buf)):
                if not n:
                    return
                log.append((time.monotonic(), n))

    def bytes_between(self, t0: float, t1: float, conn: int | None = None) -> int:
        logs = self.arrivals if conn is None else [self.arrivals[conn]]
        return sum(n for log in logs for t, n in list(log) if t0 < t <= t1)

    def total(self) -> int:
        return sum(n for log in self.arrivals for _, n in list(log))

    def stop(self) -> None:
        self._stop.set()
        self._acceptor.join(timeout=2)
        for t in self._threads:
            t.join(timeout=2)


def tcp_send_for(
    sock: socket.socket, dst: tuple[str, int], seconds: float, chunk: int = 1 << 18
) -> int:
    """Connect and send as fast as TCP allows for `seconds`; returns the bytes sent."""
    sock.settimeout(10)
    sock.connect(dst)
    data = b"\x5a" * chunk
    sent = 0
    end = time.monotonic() + seconds
    with sock:
        while time.monotonic() < end:
            sock.sendall(data)
            sent += chunk
    return sent


class TcpEcho(_SocketThread):
    """Echo everything back on every connection `listener` accepts (threads), until stop()."""

    def __init__(self, listener: socket.socket) -> None:
        super().__init__(listener, 0.2, "tcp-echo")

    def _run(self) -> None:
        for conn, _ in _until_stopped(self._stop, self.sock.accept):
            threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

    def _echo(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.settimeout(0.2)
        with conn:
            for data in _until_stopped(self._stop, lambda: conn.recv(65536)):
                if not data:
                    return
                conn.sendall(data)


def tcp_rtts(
    sock: socket.socket, dst: tuple[str, int], count: int, interval_s: float = 0.002, size: int = 64
) -> list[float]:
    """Connect, then `count` request/response round trips of `size` bytes; RTTs in ms."""
    sock.settimeout(5)
    sock.connect(dst)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    msg = b"r" * size
    out = []
    with sock:
        for _ in range(count):
            t = time.monotonic()
            sock.sendall(msg)
            got = 0
            while got < size:
                chunk = sock.recv(size - got)
                if not chunk:
                    raise ConnectionError("echo server closed the connection")
                got += len(chunk)
            out.append((time.monotonic() - t) * 1000.0)
            time.sleep(interval_s)
    return out
