"""dial / Server / Connection over loopback: handshake, round trips, hostile peers, timeouts."""

from __future__ import annotations

import asyncio
import functools
import socket
import struct
import zlib

import numpy as np
import pytest

from pddnet.protocol import (
    HEADER,
    MAGIC,
    VERSION,
    Auth,
    AuthFail,
    Decoder,
    ErrorMessage,
    Hello,
    KvChunk,
    MessageType,
    Ping,
    Submit,
    TokenEvent,
    encode_bytes,
    payload_from_array,
)
from pddnet.protocol.handshake import Handshake, Side
from pddnet.transport import (
    LATENCY_DSCP,
    AuthenticationFailed,
    ConnectionClosed,
    DialRefused,
    DialTimeout,
    Server,
    dial,
    dial_with_retry,
    lane_dscp,
)
from tests.polling import wait_for

SECRET = b"cluster-secret-for-tests"
HOST = "127.0.0.1"


def kv_chunk(index: int = 0, tokens: int = 4) -> KvChunk:
    arr = np.arange(2 * 2 * tokens * 2 * 8, dtype=np.float32).reshape(2, 2, tokens, 2, 8) + index
    payload, dtype, shape = payload_from_array(arr)
    return KvChunk(
        request_id="r-1",
        chunk_index=index,
        token_start=0,
        token_end=tokens,
        layer_start=0,
        layer_end=2,
        dtype=dtype,
        shape=shape,
        payload=payload,
    )


def raw_header(msg_type: int, meta_len: int, payload_len: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, msg_type, 0, meta_len, payload_len, 0, 0)
    return head[:28] + struct.pack("!I", zlib.crc32(head[:28]))


def make_server(
    on_connection, port: int = 0, role: str = "relay", instance_id: str = "rld", **kw
) -> Server:
    """A Server on HOST with the tests' secret (RLD's role and id unless told otherwise)."""
    return Server(
        HOST,
        port,
        role=role,
        instance_id=instance_id,
        secret=SECRET,
        on_connection=on_connection,
        **kw,
    )


class Echo:
    """A server whose handler echoes every message and records how each connection ended."""

    def __init__(self, **server_kwargs) -> None:
        self.ended: list[str] = []
        self.conns = []
        self.server = make_server(
            self.handle, role="main_decode", instance_id="md-0", **server_kwargs
        )

    async def handle(self, conn) -> None:
        self.conns.append(conn)
        async for msg in conn:
            await conn.send(msg)
        self.ended.append(conn.close_reason)

    async def __aenter__(self) -> Echo:
        self.port = await self.server.start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.close()


async def dial_echo(port: int, lane: str = "control", secret: bytes = SECRET, **kw):
    return await dial(HOST, port, role="prefill", instance_id="p-0", lane=lane, secret=secret, **kw)


async def read_messages(reader: asyncio.StreamReader, timeout: float = 5.0) -> list:
    """Everything the server sends until it closes the stream."""
    decoder = Decoder()
    out = []
    async with asyncio.timeout(timeout):
        while data := await reader.read(65536):
            out += decoder.feed(data)
    return out


async def raw_authenticated(port: int, lane: str = "control"):
    """A raw stream that passed the handshake (so the test can then misbehave on it)."""
    reader, writer = await asyncio.open_connection(HOST, port)
    hs = Handshake(Side.CONNECTOR, role="client", instance_id="raw", secret=SECRET, lane=lane)
    decoder = Decoder()
    for m in hs.start():
        writer.write(encode_bytes(m))
    while not hs.done:
        data = await reader.read(65536)
        assert data, "server closed during a valid handshake"
        for m in decoder.feed(data):
            for out in hs.receive(m):
                writer.write(encode_bytes(out))
    return reader, writer


async def assert_echoes(conn, nonce: int) -> None:
    """`conn` still works: a PING through the echo server comes back whole."""
    await conn.send(Ping(nonce=nonce, time=0.0))
    assert await conn.recv() == Ping(nonce=nonce, time=0.0)


def assert_no_other_tasks() -> None:
    others = asyncio.all_tasks() - {asyncio.current_task()}
    assert not others, f"tasks left behind: {others}"


async def test_round_trip_over_loopback_with_the_handshake():
    async with Echo() as echo:
        conn = await dial_echo(echo.port)
        assert (conn.peer_role, conn.peer_instance, conn.lane) == ("main_decode", "md-0", "control")
        msgs = [
            Ping(nonce=7, time=1.5),
            Submit(request_id="r-1", prompt_token_ids=list(range(5000)), max_tokens=8),
            TokenEvent(request_id="r-1", index=0, token_ids=[3, 4], producer="relay", time=2.0),
        ]
        for m in msgs:
            await conn.send(m)
        assert [await conn.recv() for _ in msgs] == msgs
        server_conn = echo.conns[0]
        assert (server_conn.peer_role, server_conn.peer_instance, server_conn.lane) == (
            "prefill",
            "p-0",
            "control",
        )
        # stats count every frame, exact bytes, by type and direction (handshake included)
        submit_bytes = len(encode_bytes(msgs[1]))
        assert conn.stats["frames_out"]["SUBMIT"] == 1
        assert conn.stats["bytes_out"]["SUBMIT"] == submit_bytes
        assert conn.stats["bytes_in"]["SUBMIT"] == submit_bytes
        assert server_conn.stats["frames_in"]["PING"] == 1
        assert conn.stats["frames_out"]["HELLO"] == 1 and conn.stats["frames_in"]["AUTH_OK"] == 1
        sock = conn.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        await conn.close()
        with pytest.raises(ConnectionClosed, match="closed locally"):
            await conn.recv()
        with pytest.raises(ConnectionClosed):
            await conn.send(Ping(nonce=1, time=0.0))
    assert_no_other_tasks()


async def test_a_server_listens_on_a_socket_it_is_given_and_dial_makes_its_own_by_a_factory():
    """As a process that sits in neither network makes them (the handoff bench's packet shell:
    MD's listener in one namespace, RLD's sockets in the other)."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((HOST, 0))
    made: list[tuple[int, int, int]] = []

    def make_socket(family: int, kind: int, proto: int) -> socket.socket:
        made.append((family, kind, proto))
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)  # to tell it is ours
        return sock

    echo = Echo()
    port = await echo.server.start(sock=listener)
    try:
        assert port == listener.getsockname()[1] and echo.server.host == HOST
        conn = await dial_echo(port, make_socket=make_socket)
        assert made == [(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)]
        sock = conn.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0
        await conn.send(Ping(nonce=3, time=0.5))
        assert await conn.recv() == Ping(nonce=3, time=0.5)
        await conn.close()
    finally:
        await echo.server.close()
    assert_no_other_tasks()


async def test_bulk_lane_carries_large_kv_chunks_zero_copy_payload():
    async with Echo() as echo:
        conn = await dial_echo(echo.port, lane="bulk")
        chunk = kv_chunk(tokens=4096)  # 1 MiB payload: above the control lanes' limit
        await conn.send(chunk)
        back = await conn.recv()
        assert back == chunk and back.payload.nbytes == 2 * 2 * 4096 * 2 * 8 * 4
        assert conn.stats["bytes_in"]["KV_CHUNK"] == len(encode_bytes(chunk))
        await conn.close()
    assert_no_other_tasks()


async def test_peer_eof_raises_connection_closed_with_the_reason():
    async def close_at_once(conn) -> None:
        await conn.close("server says bye")

    server = make_server(close_at_once)
    port = await server.start()
    conn = await dial_echo(port)
    with pytest.raises(ConnectionClosed, match="peer closed"):
        await conn.recv()
    assert conn.closed
    assert [m async for m in conn] == []
    await server.close()
    assert_no_other_tasks()


async def test_wrong_secret_refused_others_unaffected():
    async with Echo() as echo:
        good = await dial_echo(echo.port)
        with pytest.raises(AuthenticationFailed, match="bad AUTH mac"):
            await dial_echo(echo.port, secret=b"not-the-secret")
        # the refused connector was told why: AUTH_FAIL then close (seen on a raw stream too)
        reader, writer = await asyncio.open_connection(HOST, echo.port)
        hs = Handshake(Side.CONNECTOR, role="client", instance_id="x", secret=b"wrong")
        writer.write(encode_bytes(hs.start()[0]))
        hello_back = None
        decoder = Decoder()
        while hello_back is None:
            msgs = decoder.feed(await reader.read(65536))
            hello_back = msgs[0] if msgs else None
        writer.write(encode_bytes(hs.receive(hello_back)[0]))
        rest = await read_messages(reader)
        assert [type(m) for m in rest] == [AuthFail] and "wrong secret" in rest[0].reason
        writer.close()
        assert echo.server.handshakes_failed == 2
        await assert_echoes(good, 1)
        await good.close()
    assert_no_other_tasks()


async def test_replayed_handshake_refused():
    async with Echo() as echo:
        # Record a legitimate connector's bytes: its HELLO and AUTH.
        reader, writer = await asyncio.open_connection(HOST, echo.port)
        hs = Handshake(Side.CONNECTOR, role="prefill", instance_id="p-0", secret=SECRET)
        hello = hs.start()[0]
        sent = [encode_bytes(hello)]
        writer.write(sent[0])
        decoder = Decoder()
        got = []
        while not got:
            got = decoder.feed(await reader.read(65536))
        auth = hs.receive(got[0])[0]
        sent.append(encode_bytes(auth))
        writer.write(sent[1])
        while not hs.done:
            for m in decoder.feed(await reader.read(65536)):
                hs.receive(m)
        writer.close()
        # An eavesdropper replays them on a new connection: refused, named as a replay.
        reader2, writer2 = await asyncio.open_connection(HOST, echo.port)
        writer2.write(b"".join(sent))
        replies = await read_messages(reader2)
        writer2.close()
        assert isinstance(replies[-1], AuthFail)
        assert "replayed handshake" in replies[-1].reason
        assert not any(isinstance(m, Hello) for m in replies)  # refused at its HELLO
        assert isinstance(auth, Auth)
    assert_no_other_tasks()


@pytest.mark.parametrize("when", ["before_auth", "after_auth"])
async def test_garbage_closes_that_connection_and_the_server_keeps_serving(when):
    async with Echo() as echo:
        bystander = await dial_echo(echo.port, lane="events")
        if when == "before_auth":
            reader, writer = await asyncio.open_connection(HOST, echo.port)
        else:
            reader, writer = await raw_authenticated(echo.port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        replies = await read_messages(reader)
        writer.close()
        assert isinstance(replies[-1], ErrorMessage)
        assert replies[-1].fatal and replies[-1].code == "bad_frame"
        assert "bad magic" in replies[-1].message
        if when == "after_auth":
            await wait_for(lambda: echo.ended, 2, "the server to end that connection", step=0.01)
            assert any("protocol error from peer (bad_frame)" in r for r in echo.ended)
        else:
            assert echo.server.handshakes_failed == 1
        await assert_echoes(bystander, 2)
        fresh = await dial_echo(echo.port)
        await assert_echoes(fresh, 3)
        await bystander.close()
        await fresh.close()
    assert_no_other_tasks()


async def test_message_before_authentication_is_not_processed():
    async with Echo() as echo:
        reader, writer = await asyncio.open_connection(HOST, echo.port)
        writer.write(encode_bytes(Ping(nonce=1, time=0.0)))
        replies = await read_messages(reader)
        writer.close()
        assert len(replies) == 1 and replies[0].code == "unauthenticated" and replies[0].fatal
        assert "PING received before authentication" in replies[0].message
        assert echo.conns == []  # the handler never saw a connection
    assert_no_other_tasks()


@pytest.mark.parametrize("when", ["before_auth", "after_auth"])
async def test_huge_declared_payload_on_control_lane_rejected_before_allocation(when):
    async with Echo() as echo:
        if when == "before_auth":
            reader, writer = await asyncio.open_connection(HOST, echo.port)
        else:
            reader, writer = await raw_authenticated(echo.port, lane="control")
        # Only the 32-byte header: it declares 1 GiB. The server must answer without waiting
        # for (or allocating) the body.
        writer.write(raw_header(MessageType.KV_CHUNK, 100, 1 << 30))
        replies = await read_messages(reader)
        writer.close()
        assert replies[-1].code == "limit_exceeded" and replies[-1].fatal
        assert f"payload of {1 << 30} bytes exceeds" in replies[-1].message
    assert_no_other_tasks()


async def test_silent_peer_is_dropped_after_the_handshake_timeout():
    async with Echo(handshake_timeout=0.3) as echo:
        reader, writer = await asyncio.open_connection(HOST, echo.port)
        assert await read_messages(reader, timeout=5.0) == []  # EOF, nothing said
        writer.close()
        assert echo.server.handshakes_failed == 1
    assert_no_other_tasks()


async def test_dial_refused_and_dial_with_retry():
    probe = socket.socket()
    probe.bind((HOST, 0))
    port = probe.getsockname()[1]
    probe.close()  # nothing listens there now
    with pytest.raises(DialRefused, match=f"cannot connect to {HOST}:{port}"):
        await dial_echo(port)
    # P dialling RLD's port, with a given patience
    dial = functools.partial(
        dial_with_retry, HOST, port, role="prefill", instance_id="p", lane="control", secret=SECRET
    )
    with pytest.raises(DialRefused, match="gave up after 2 attempts"):
        await dial(attempts=2, delay=0.01)
    # The server comes up while the dialer retries.
    server = make_server(lambda conn: conn.recv(), port)

    async def start_late() -> None:
        await asyncio.sleep(0.2)  # deliberately late: the dialer must retry meanwhile
        await server.start()

    starter = asyncio.create_task(start_late())
    conn = await dial(attempts=100, delay=0.05)
    await starter
    assert conn.peer_role == "relay"
    await conn.close()
    await server.close()
    assert_no_other_tasks()


async def test_auth_failure_is_not_retried():
    async with Echo() as echo:
        with pytest.raises(AuthenticationFailed):
            await dial_with_retry(
                HOST,
                echo.port,
                attempts=5,
                delay=0.01,
                role="prefill",
                instance_id="p",
                lane="control",
                secret=b"wrong",
            )
        assert echo.server.handshakes_failed == 1
    assert_no_other_tasks()


async def test_server_close_closes_every_connection_and_handler():
    stuck = asyncio.Event()

    async def never_returns(conn) -> None:
        stuck.set()
        await asyncio.Event().wait()  # a handler that ignores its connection

    server = make_server(never_returns)
    port = await server.start()
    conns = [await dial_echo(port) for _ in range(3)]
    await stuck.wait()
    await server.close(grace=0.1)
    for conn in conns:
        with pytest.raises(ConnectionClosed):
            await conn.recv()
    assert not server.connections
    assert_no_other_tasks()


async def test_handler_exception_ends_only_that_connection():
    async def picky(conn) -> None:
        async for msg in conn:
            if isinstance(msg, Ping) and msg.nonce == 13:
                raise ValueError("unlucky")
            await conn.send(msg)

    server = make_server(picky)
    port = await server.start()
    a, b = await dial_echo(port), await dial_echo(port)
    await a.send(Ping(nonce=13, time=0.0))
    with pytest.raises(ConnectionClosed):
        await a.recv()
    await assert_echoes(b, 1)
    await b.close()
    await server.close()
    assert_no_other_tasks()


async def test_a_cancelled_recv_loses_nothing():
    """wait_for(conn.recv(), deadline) may cancel mid-frame; the next recv gets the whole frame."""
    got, timeouts = [], []

    async def handle(conn) -> None:
        for _ in range(2):
            try:
                await asyncio.wait_for(conn.recv(), 0.1)
            except asyncio.TimeoutError:
                timeouts.append(True)
        got.append(await conn.recv())
        got.append(await conn.recv())

    server = make_server(handle)
    port = await server.start()
    reader, writer = await raw_authenticated(port)
    msg = Submit(request_id="r-9", prompt_token_ids=list(range(300)), max_tokens=4)
    frame = encode_bytes(msg)
    # Inside the header, then inside the metadata: each part waits out one 0.1 s recv.
    for n, part in enumerate((frame[:10], frame[10:60]), 1):
        writer.write(part)
        await wait_for(lambda n=n: len(timeouts) >= n, 3, f"recv {n} to time out", step=0.01)
    writer.write(frame[60:] + encode_bytes(Ping(nonce=5, time=0.0)))
    await wait_for(lambda: len(got) == 2, 3, "both messages", step=0.01)
    assert timeouts == [True, True]
    assert got == [msg, Ping(nonce=5, time=0.0)]
    writer.close()
    await server.close()
    assert_no_other_tasks()


async def test_role_allow_list_refuses_with_a_reason():
    async with Echo(allowed_peer_roles={"router"}) as echo:
        with pytest.raises(AuthenticationFailed, match="role 'prefill' may not connect here"):
            await dial_echo(echo.port)
    assert_no_other_tasks()


async def test_dial_times_out_on_a_silent_acceptor():
    peers = []

    async def silent(reader, writer) -> None:
        peers.append(writer)
        await reader.read()  # says nothing; returns when the dialer gives up

    raw = await asyncio.start_server(silent, HOST, 0)
    port = raw.sockets[0].getsockname()[1]
    with pytest.raises(DialTimeout, match=f"handshake with {HOST}:{port} .* timed out"):
        await dial_echo(port, timeout=0.3)
    for w in peers:
        w.close()
    raw.close()
    await raw.wait_closed()


async def test_close_drops_the_socket_when_the_peer_never_takes_the_last_bytes():
    # A stripe blocked mid KV_CHUNK (its peer no longer reads) must not keep its socket:
    # asyncio closes a transport only once its buffer is flushed, so close() aborts it after
    # its grace period instead (before, each such lane stayed open for the daemon's life).
    stop = asyncio.Event()

    async def never_reads(conn) -> None:
        await stop.wait()

    server = make_server(never_reads, role="main_decode", instance_id="md-0")
    port = await server.start()
    conn = await dial_echo(port, lane="bulk")
    sock = conn._writer.transport.get_extra_info("socket")
    blob = encode_bytes(kv_chunk(tokens=4096))  # 1 MiB a frame: socket buffers fill up
    for _ in range(64):
        conn._writer.write(blob)  # (no drain: the peer never reads)
    assert conn._writer.transport.get_write_buffer_size() > 0
    async with asyncio.timeout(5):
        await conn.close("stripe replaced")
    # The transport closes on the next turn.
    await wait_for(lambda: sock.fileno() == -1, 2, "the socket to close", step=0.01)
    assert sock.fileno() == -1, "the socket is still open"
    stop.set()
    await server.close()
    assert_no_other_tasks()


async def test_latency_lanes_are_marked_from_the_handshake_on_and_bulk_lanes_are_not():
    # A WAN with a QoS class for Expedited Forwarding (the emulator's priority_dscp) must be able
    # to tell a HANDOFF's connection from a KV stream's by its packets, both ways.
    from emulation.link import Link
    from emulation.proxy import WanProxy

    assert lane_dscp("control") == lane_dscp("events") == LATENCY_DSCP == 46
    assert lane_dscp("bulk") == 0
    with pytest.raises(ValueError, match="unknown lane 'side'"):
        lane_dscp("side")
    link = Link(priority_dscp=LATENCY_DSCP)
    async with Echo() as echo, WanProxy((HOST, 0), (HOST, echo.port), link) as proxy:
        control = await dial_echo(proxy.port, lane="control")
        await assert_echoes(control, 1)
        sock = control.get_extra_info("socket")
        assert sock.getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == LATENCY_DSCP << 2
        urgent = link.a_to_b.counters()["priority"]["bytes"]
        assert urgent > 0 and link.b_to_a.counters()["priority"]["bytes"] > 0
        bulk = await dial_echo(proxy.port, lane="bulk")
        await bulk.send(kv_chunk(tokens=64))
        await bulk.recv()
        assert link.a_to_b.counters()["priority"]["bytes"] == urgent  # the KV went best effort
        assert bulk.get_extra_info("socket").getsockopt(socket.IPPROTO_IP, socket.IP_TOS) == 0
        await control.close()
        await bulk.close()
