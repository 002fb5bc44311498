"""pddnet.transport.tcp_info: TCP_INFO's loss-recovery counters, parsed from the bytes the
kernel fills (older kernels fill fewer) and read from a real socket."""

from __future__ import annotations

import socket
import struct

import pytest

from pddnet.transport.tcp_info import TcpCounters, parse_tcp_info, tcp_counters


def info_bytes(length: int, retrans: int, retrans_bytes: int, rtos: int) -> bytes:
    buf = bytearray(248)
    struct.pack_into("I", buf, 100, retrans)
    struct.pack_into("Q", buf, 208, retrans_bytes)
    struct.pack_into("H", buf, 240, rtos)
    return bytes(buf[:length])


def test_counters_are_read_at_their_offsets_and_missing_ones_are_none():
    assert parse_tcp_info(info_bytes(248, 7, 9000, 2)) == TcpCounters(7, 9000, 2)
    # a kernel before 6.7 stops before the timeout counter; one before 4.19 before the bytes
    assert parse_tcp_info(info_bytes(232, 7, 9000, 2)) == TcpCounters(7, 9000, None)
    assert parse_tcp_info(info_bytes(104, 7, 9000, 2)) == TcpCounters(7, None, None)


def test_since_is_the_difference_and_unknown_stays_unknown():
    later, before = TcpCounters(10, 5000, 1), TcpCounters(4, 2000, None)
    assert later.since(before) == TcpCounters(6, 3000, None)


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="no TCP_INFO on this system")
def test_a_connected_socket_reports_counters_and_other_sockets_none():
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    client = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    try:
        client.sendall(b"x" * 1000)
        assert peer.recv(1000)
        got = tcp_counters(client)
        assert got is not None and got.retrans_segments is not None
        assert got.retrans_segments >= 0
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        assert tcp_counters(udp) is None and tcp_counters(None) is None
        udp.close()
    finally:
        for s in (client, peer, srv):
            s.close()
