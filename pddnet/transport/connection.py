"""Authenticated message connections over asyncio streams: `dial()`, `Server`, `Connection`.

The shell around two sans-IO parts: the frame codec (pddnet.protocol) and the handshake
(pddnet/protocol/handshake.py). Every connection starts with the HELLO/AUTH handshake under tight limits and a
deadline; only then does it become a `Connection` whose decoder uses the lane's limits (bulk lanes
take large KV payloads, control and events lanes small frames). Frames are read one at a time,
never past the end of the current frame, so every frame's exact size is known for `stats` and a
frame's declared lengths are checked before any of its body is buffered.

A ProtocolError from the peer ends only that connection: we send ERROR(fatal) when we can, close,
log the reason, and `recv()` raises `ConnectionClosed(reason)`. A Server never dies of a peer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import defaultdict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any

from pddnet.lanes import LANES, lane_dscp
from pddnet.protocol import (
    HEADER_SIZE,
    Decoder,
    ErrorMessage,
    FrameHeader,
    Hello,
    Limits,
    Message,
    ProtocolError,
    encode,
    encode_bytes,
    parse_header,
)
from pddnet.protocol.handshake import Handshake, HandshakeFailed, NonceCache, Side

log = logging.getLogger("pddnet.transport")

# Control and events lanes never carry a payload (KV_CHUNK goes on bulk lanes only), so their
# payload limit is small; their metadata limit still fits a 64K-token prompt's ids.
LANE_LIMITS: dict[str, Limits] = {
    "events": Limits(max_payload_bytes=1 << 20),
    "control": Limits(max_payload_bytes=1 << 20),
    "bulk": Limits(),
}
# Before authentication a peer may only send HELLO / AUTH / AUTH_OK / AUTH_FAIL: tiny frames.
HANDSHAKE_LIMITS = Limits(
    max_metadata_bytes=8 << 10,
    max_payload_bytes=1,
    max_str_len=4096,
    max_bin_len=128,
    max_array_len=16,
    max_map_len=32,
)
READ_CHUNK = 1 << 20  # most bytes taken from the stream per read while inside a frame body
STREAM_LIMIT = 4 << 20  # StreamReader buffer before it pauses the socket (backpressure)
DEFAULT_TIMEOUT = 5.0

LimitsArg = Limits | Mapping[str, Limits] | None


class ConnectionClosed(ConnectionError):
    """The connection is closed (EOF, local close, peer protocol error...); `reason` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DialError(ConnectionError):
    """dial() failed; `address` is (host, port). Subclasses say how."""

    def __init__(self, message: str, address: tuple[str, int]) -> None:
        super().__init__(message)
        self.address = address


class DialRefused(DialError):
    """Nothing listens there (or the network refused the connect)."""


class DialTimeout(DialError):
    """The connect or the handshake did not finish in time."""


class AuthenticationFailed(DialError):
    """The handshake was refused or the peer could not prove the shared secret (not retried)."""


def lane_limits(lane: str, limits: LimitsArg = None) -> Limits:
    """The decoder limits for `lane`: `limits` as given, per lane from a mapping, else defaults."""
    if lane not in LANES:
        raise ValueError(f"unknown lane {lane!r}: expected one of {', '.join(LANES)}")
    if isinstance(limits, Limits):
        return limits
    if limits is not None and lane in limits:
        return limits[lane]
    return LANE_LIMITS[lane]


def _mark(sock: socket.socket, dscp: int) -> None:
    if not dscp:
        return
    with contextlib.suppress(OSError):
        if sock.family == socket.AF_INET:
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_TOS, dscp << 2)
        elif sock.family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_TCLASS, dscp << 2)


def _tune_socket(writer: asyncio.StreamWriter, lane: str) -> None:
    # Small control frames must not wait for Nagle; bulk lanes write large buffers anyway.
    sock = writer.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6) and lane != "bulk":
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _mark(sock, lane_dscp(lane))  # the accepting side's replies (a dial marks before)


SocketFactory = Callable[[int, int, int], socket.socket]  # (family, type, proto) -> socket


async def _connect(
    host: str, port: int, dscp: int, make_socket: SocketFactory = socket.socket
) -> socket.socket:
    """A connected non-blocking TCP socket, marked `dscp` before its first packet: a middlebox
    may classify a connection by its handshake (Linux reports the TOS a connection was set up
    with), so marking after connect would be too late. `make_socket` makes the unconnected
    socket (e.g. inside a network namespace: emulation.netns.socket_in)."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    error: OSError = OSError(f"no address for {host}")
    for family, kind, proto, _, address in infos:
        sock = make_socket(family, kind, proto)
        try:
            sock.setblocking(False)
            _mark(sock, dscp)
            await loop.sock_connect(sock, address)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
        except BaseException:
            sock.close()
            raise
    raise error


class _EOF(Exception):
    """The stream ended; `partial` is True when it ended inside a frame."""

    def __init__(self, partial: bool) -> None:
        self.partial = partial


class _FrameReader:
    """Reads exactly one frame at a time from a stream (never past its end).

    The header is fed to the decoder as it arrives, so a wrong first byte fails at once and the
    declared lengths are checked against the decoder's limits before the body is read. The
    partial frame lives here, not in locals, so cancelling a read (e.g. `wait_for(conn.recv(),
    deadline)`) loses nothing: the next read continues the same frame.
    """

    def __init__(self, reader: asyncio.StreamReader, decoder: Decoder) -> None:
        self.reader = reader
        self.decoder = decoder
        self._head = bytearray()
        self._header: FrameHeader | None = None
        self._remaining = 0
        self.last_data = time.monotonic()  # when bytes last arrived (a frame's part counts)

    async def read(self) -> tuple[Message, int]:
        """The next message and its frame size in bytes. Raises ProtocolError or _EOF."""
        reader, decoder = self.reader, self.decoder
        while self._header is None:
            data = await reader.read(HEADER_SIZE - len(self._head))
            if not data:
                raise _EOF(partial=bool(self._head))
            self.last_data = time.monotonic()
            self._head += data
            decoder.feed(data)
            if len(self._head) == HEADER_SIZE:
                self._header = parse_header(self._head, decoder.limits)
                self._remaining = self._header.metadata_len + self._header.payload_len
        messages: list[Message] = []
        while self._remaining:  # metadata is never empty, so at least one pass
            data = await reader.read(min(self._remaining, READ_CHUNK))
            if not data:
                decoder.eof()  # raises TruncatedFrame naming how much of which frame arrived
                raise _EOF(partial=True)  # pragma: no cover - eof() always raises in a frame
            self.last_data = time.monotonic()
            self._remaining -= len(data)
            messages = decoder.feed(data)
        assert len(messages) == 1, "a whole frame decodes to exactly one message"
        size = self._header.frame_len
        self._head = bytearray()
        self._header = None
        return messages[0], size


def _frame_bytes(buffers: Iterable[bytes | memoryview]) -> int:
    return sum(b.nbytes if isinstance(b, memoryview) else len(b) for b in buffers)


def _new_stats() -> dict[str, Any]:
    return {
        "frames_in": defaultdict(int),
        "bytes_in": defaultdict(int),
        "frames_out": defaultdict(int),
        "bytes_out": defaultdict(int),
    }


class Connection:
    """An authenticated, framed message connection. One task may recv() at a time; any number of
    tasks may send() (each frame is written whole, then we wait for the transport to drain)."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        peer_hello: Hello,
        lane: str,
        limits: Limits,
        local_role: str,
        local_instance: str,
        stats: dict[str, Any] | None = None,
    ) -> None:
        self._reader = reader
        self._writer = writer
        self.peer_role: str = peer_hello.role
        self.peer_instance: str = peer_hello.instance_id
        self.lane = lane
        self.limits = limits
        self.local_role = local_role
        self.local_instance = local_instance
        self.peername = writer.get_extra_info("peername")
        self.stats: dict[str, Any] = stats if stats is not None else _new_stats()
        self.closed = False
        self.close_reason: str | None = None
        self._frames = _FrameReader(reader, Decoder(limits))
        self._receiving = False

    def __repr__(self) -> str:
        state = f"closed: {self.close_reason}" if self.closed else "open"
        return (
            f"<Connection {self.lane} {self.local_role}<->{self.peer_role} "
            f"{self.peer_instance!r} {state}>"
        )

    # -- sending ------------------------------------------------------------------------------
    async def send(self, msg: Message) -> None:
        """Encode and write `msg` (the payload view is not copied), then wait for the transport
        to drain below its high-water mark (backpressure). Raises ConnectionClosed; a message
        beyond this lane's limits raises LimitExceeded before anything is written."""
        if self.closed:
            raise ConnectionClosed(self.close_reason or "connection closed")
        buffers = encode(msg, limits=self.limits)
        name = msg.TYPE.name
        try:
            self._writer.writelines(buffers)
            self.stats["frames_out"][name] += 1
            self.stats["bytes_out"][name] += _frame_bytes(buffers)
            await self._writer.drain()
        except (ConnectionError, OSError, RuntimeError) as exc:
            # RuntimeError: asyncio raises it when writing to a transport being closed.
            reason = f"send failed: {type(exc).__name__}: {exc}"
            self._abort(reason)
            raise ConnectionClosed(self.close_reason or reason) from exc

    @property
    def peer_closed(self) -> bool:
        """The peer has gone (EOF seen with nothing left to read, or the transport broke), even
        if nobody is calling recv() on this connection (e.g. a bulk lane that only sends)."""
        transport = self._writer.transport
        return (
            self._reader.at_eof()
            or self._reader.exception() is not None
            or transport is None
            or transport.is_closing()
        )

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        """The transport's extra info ("peername", "sockname", "socket", ...)."""
        return self._writer.get_extra_info(name, default)

    @property
    def last_received(self) -> float:
        """When bytes from the peer last arrived (time.monotonic()), a large frame's parts too:
        the peer's liveness as the heartbeat judges it (pddnet/roles/peer.py)."""
        return self._frames.last_data

    def write_buffer_size(self) -> int:
        """Bytes queued in the transport, not yet handed to the kernel (for striping)."""
        transport = self._writer.transport
        return (
            0 if transport is None or transport.is_closing() else transport.get_write_buffer_size()
        )

    # -- receiving ----------------------------------------------------------------------------
    async def recv(self) -> Message:
        """The next message. Raises ConnectionClosed (with the reason) at EOF, after close() or
        after a protocol error from the peer (which also closes the connection)."""
        if self.closed:
            raise ConnectionClosed(self.close_reason or "connection closed")
        if self._receiving:
            raise RuntimeError("Connection.recv() is already being awaited by another task")
        self._receiving = True
        try:
            msg, size = await self._frames.read()
        except _EOF as eof:
            reason = self.close_reason or "peer closed the connection" + (
                " inside a frame" if eof.partial else ""
            )
            self._abort(reason)
            raise ConnectionClosed(reason) from None
        except ProtocolError as exc:
            reason = f"protocol error from peer ({exc.code}): {exc}"
            log.warning("%s: %s; closing", self, reason)
            self._fail(exc.code, str(exc))
            self._abort(reason)
            raise ConnectionClosed(reason) from None
        except (ConnectionError, OSError) as exc:
            reason = self.close_reason or f"connection lost: {type(exc).__name__}: {exc}"
            self._abort(reason)
            raise ConnectionClosed(reason) from None
        finally:
            self._receiving = False
        name = msg.TYPE.name
        self.stats["frames_in"][name] += 1
        self.stats["bytes_in"][name] += size
        return msg

    def __aiter__(self) -> AsyncIterator[Message]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Message]:
        """Messages until the connection closes (then `close_reason` says why)."""
        while True:
            try:
                yield await self.recv()
            except ConnectionClosed:
                return

    # -- closing ------------------------------------------------------------------------------
    async def close(self, reason: str = "closed locally") -> None:
        """Close the connection (idempotent); a pending recv() raises ConnectionClosed."""
        self._abort(reason)
        try:
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)
        except Exception:  # timed out or failed: whatever it was, the socket must go
            # A transport closes only once its buffer is flushed: a peer that never takes the
            # last bytes (a stripe blocked mid KV_CHUNK when MD's session was replaced) kept
            # the socket open for good, and the daemon's fds grew after each reconnect.
            with contextlib.suppress(Exception):
                self._writer.transport.abort()

    def _fail(self, code: str, message: str) -> None:
        """Best effort: tell the peer why we are about to close (no waiting for a dead peer)."""
        if self.closed or self._writer.is_closing():
            return
        with contextlib.suppress(Exception):
            self._writer.write(
                encode_bytes(
                    ErrorMessage(request_id=None, code=code, message=message[:4096], fatal=True)
                )
            )

    def _abort(self, reason: str) -> None:
        if not self.closed:
            self.closed = True
            self.close_reason = reason
        with contextlib.suppress(Exception):
            self._writer.close()


# ---------------------------------------------------------------------------------------------
# The handshake over a stream
# ---------------------------------------------------------------------------------------------


async def _run_handshake(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, hs: Handshake, stats: dict[str, Any]
) -> None:
    """Drive `hs` to DONE over the stream; raises HandshakeFailed (reply already sent) or _EOF."""
    frames = _FrameReader(reader, Decoder(HANDSHAKE_LIMITS))

    def write(messages: list[Message]) -> None:
        for m in messages:
            frame = encode_bytes(m, limits=HANDSHAKE_LIMITS)
            writer.write(frame)
            stats["frames_out"][m.TYPE.name] += 1
            stats["bytes_out"][m.TYPE.name] += len(frame)

    write(hs.start())
    await writer.drain()
    while not hs.done:
        try:
            msg, size = await frames.read()
        except ProtocolError as exc:
            failure = HandshakeFailed(
                f"protocol error during handshake ({exc.code}): {exc}", code=exc.code
            )
            write(
                [ErrorMessage(request_id=None, code=exc.code, message=str(exc)[:4096], fatal=True)]
            )
            raise failure from None
        stats["frames_in"][msg.TYPE.name] += 1
        stats["bytes_in"][msg.TYPE.name] += size
        try:
            write(hs.receive(msg, time.monotonic()))
        except HandshakeFailed as exc:
            write(exc.reply)
            raise
        await writer.drain()


async def _close_writer(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(Exception):
        await asyncio.wait_for(writer.wait_closed(), 1.0)


# ---------------------------------------------------------------------------------------------
# Connector side
# ---------------------------------------------------------------------------------------------


async def dial(
    host: str,
    port: int,
    *,
    role: str,
    instance_id: str,
    lane: str,
    secret: bytes,
    timeout: float = DEFAULT_TIMEOUT,
    limits: LimitsArg = None,
    make_socket: SocketFactory = socket.socket,
) -> Connection:
    """Connect to a pddnet Server and authenticate as connector on `lane`.

    `timeout` bounds the TCP connect and, separately, the handshake. Raises DialRefused,
    DialTimeout or AuthenticationFailed (all ConnectionError subclasses, naming the address).
    `make_socket`: how the socket is made (a process that is not itself inside the network it
    dials from passes one that makes it there).
    """
    address = (host, port)
    where = f"{host}:{port}"
    lim = lane_limits(lane, limits)
    hs = Handshake(Side.CONNECTOR, role=role, instance_id=instance_id, secret=secret, lane=lane)
    try:
        sock = await asyncio.wait_for(_connect(host, port, lane_dscp(lane), make_socket), timeout)
        reader, writer = await asyncio.open_connection(sock=sock, limit=STREAM_LIMIT)
    except asyncio.TimeoutError:
        raise DialTimeout(
            f"connect to {where} ({lane} lane) timed out after {timeout:g} s", address
        ) from None
    except OSError as exc:
        raise DialRefused(
            f"cannot connect to {where} ({lane} lane): {exc.strerror or exc}", address
        ) from None
    _tune_socket(writer, lane)
    stats = _new_stats()
    try:
        await asyncio.wait_for(_run_handshake(reader, writer, hs, stats), timeout)
    except asyncio.TimeoutError:
        await _close_writer(writer)
        raise DialTimeout(
            f"handshake with {where} ({lane} lane) timed out after {timeout:g} s", address
        ) from None
    except HandshakeFailed as exc:
        await _close_writer(writer)
        raise AuthenticationFailed(
            f"handshake with {where} ({lane} lane) failed: {exc.reason}", address
        ) from None
    except _EOF:
        await _close_writer(writer)
        raise AuthenticationFailed(
            f"{where} closed the connection during the handshake "
            f"({lane} lane): not a pddnet peer, or it refused us",
            address,
        ) from None
    except (ConnectionError, OSError) as exc:
        await _close_writer(writer)
        raise DialRefused(
            f"connection to {where} lost during the handshake: {exc}", address
        ) from None
    except RuntimeError as exc:
        # uvloop raises RuntimeError, not an OSError, on a write to a transport the peer has
        # already reset (e.g. the WAN proxy refusing for an MD that is not up again yet)
        if not writer.is_closing():
            raise
        await _close_writer(writer)
        raise DialRefused(
            f"connection to {where} reset during the handshake: {exc}", address
        ) from None
    return _opened(reader, writer, hs, lane, lim, stats)


def _opened(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    hs: Handshake,
    lane: str,
    limits: Limits,
    stats: dict[str, Any],
) -> Connection:
    """The Connection a completed handshake opens (on either side)."""
    assert hs.peer_hello is not None
    return Connection(
        reader,
        writer,
        peer_hello=hs.peer_hello,
        lane=lane,
        limits=limits,
        local_role=hs.hello.role,
        local_instance=hs.hello.instance_id,
        stats=stats,
    )


async def dial_with_retry(
    host: str, port: int, *, attempts: int = 50, delay: float = 0.2, **kwargs: Any
) -> Connection:
    """dial() until it succeeds, at most `attempts` times `delay` seconds apart (daemons start in
    any order). Refusals and timeouts are retried; an authentication failure is not (a wrong
    secret does not heal) and neither is anything else."""
    if attempts < 1:
        raise ValueError(f"attempts must be >= 1, got {attempts}")
    last: DialError | None = None
    for attempt in range(1, attempts + 1):
        try:
            return await dial(host, port, **kwargs)
        except (DialRefused, DialTimeout) as exc:
            last = exc
            log.debug("dial %s:%s attempt %d/%d: %s", host, port, attempt, attempts, exc)
            if attempt < attempts:
                await asyncio.sleep(delay)
    assert last is not None
    raise type(last)(f"{last} (gave up after {attempts} attempts)", last.address)


# ---------------------------------------------------------------------------------------------
# Acceptor side
# ---------------------------------------------------------------------------------------------


class Server:
    """Listens on host:port; authenticates every connection, then runs `on_connection(conn)` in
    its own task and closes the connection when it returns. A handler's exception is logged and
    ends only that connection."""

    def __init__(
        self,
        host: str,
        port: int,
        *,
        role: str,
        instance_id: str,
        secret: bytes,
        on_connection: Callable[[Connection], Awaitable[None]],
        limits: LimitsArg = None,
        handshake_timeout: float = DEFAULT_TIMEOUT,
        nonce_cache: NonceCache | None = None,
        allowed_peer_roles: Iterable[str] | None = None,
    ) -> None:
        if not secret:
            raise ValueError("Server needs a non-empty secret")
        self.host = host
        self.port = port
        self.role = role
        self.instance_id = instance_id
        self.secret = secret
        self.on_connection = on_connection
        self.limits = limits
        self.handshake_timeout = handshake_timeout
        self.nonce_cache = nonce_cache if nonce_cache is not None else NonceCache()
        self.allowed_peer_roles = allowed_peer_roles
        self.connections: set[Connection] = set()
        self.handshakes_failed = 0
        self._server: asyncio.base_events.Server | None = None
        self._tasks: set[asyncio.Task] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._closing = False

    async def start(self, sock: socket.socket | None = None) -> int:
        """Start listening; return the bound port (useful with port 0). `sock`: a socket already
        bound (e.g. made inside a network namespace) to listen on instead of host:port."""
        if sock is not None:
            self._server = await asyncio.start_server(self._accept, sock=sock, limit=STREAM_LIMIT)
        else:
            self._server = await asyncio.start_server(
                self._accept, self.host, self.port, limit=STREAM_LIMIT
            )
        bound = self._server.sockets[0].getsockname()
        self.port = bound[1]
        if sock is not None:
            self.host = bound[0]
        log.info("%s %s listening on %s:%d", self.role, self.instance_id, self.host, self.port)
        return self.port

    @property
    def last_received(self) -> float:
        """When bytes last arrived on any connection this server accepted (time.monotonic(); 0
        with none): whether the line toward us is moving at all (pddnet.roles.peer.beat)."""
        return max((conn.last_received for conn in self.connections), default=0.0)

    async def close(self, grace: float = 1.0) -> None:
        """Stop listening, close every connection, give handlers `grace` s to finish, cancel
        the rest and wait for them: no task is left behind."""
        self._closing = True
        if self._server is not None:
            self._server.close()
        # Concurrently: each close may wait up to 1 s for a peer to take the last bytes, and a
        # daemon has many lanes; one after the other that outlasts a supervisor's grace period.
        await asyncio.gather(*(conn.close("server closing") for conn in list(self.connections)))
        for writer in list(self._writers):  # connections still in their handshake
            writer.close()
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        peer = writer.get_extra_info("peername")
        try:
            if self._closing:
                return
            conn = await self._authenticate(reader, writer, peer)
            if conn is None:
                return
            self._writers.discard(writer)
            self.connections.add(conn)
            log.info(
                "%s: %s %r connected from %s on the %s lane",
                self.instance_id,
                conn.peer_role,
                conn.peer_instance,
                peer,
                conn.lane,
            )
            try:
                await self.on_connection(conn)
            except ConnectionClosed as exc:
                log.info("%s: connection %r ended: %s", self.instance_id, conn, exc)
            except Exception:
                log.exception(
                    "%s: handler for %r failed; closing that connection", self.instance_id, conn
                )
            finally:
                self.connections.discard(conn)
                await conn.close(conn.close_reason or "handler finished")
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _authenticate(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: Any
    ) -> Connection | None:
        hs = Handshake(
            Side.ACCEPTOR,
            role=self.role,
            instance_id=self.instance_id,
            secret=self.secret,
            nonce_cache=self.nonce_cache,
            allowed_peer_roles=self.allowed_peer_roles,
        )
        stats = _new_stats()
        reason: str | None = None
        try:
            await asyncio.wait_for(
                _run_handshake(reader, writer, hs, stats), self.handshake_timeout
            )
        except asyncio.TimeoutError:
            reason = f"no complete handshake within {self.handshake_timeout:g} s"
        except HandshakeFailed as exc:
            reason = exc.reason
        except _EOF as eof:
            reason = "peer closed during the handshake" + (" inside a frame" if eof.partial else "")
        except (ConnectionError, OSError) as exc:
            reason = f"connection lost during the handshake: {exc}"
        if reason is not None:
            self.handshakes_failed += 1
            log.warning("%s: refused connection from %s: %s", self.instance_id, peer, reason)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.drain(), 0.5)  # let AUTH_FAIL / ERROR go out
            await _close_writer(writer)
            return None
        assert hs.peer_hello is not None
        lane = hs.peer_hello.lane
        _tune_socket(writer, lane)
        return _opened(reader, writer, hs, lane, lane_limits(lane, self.limits), stats)
