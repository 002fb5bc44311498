"""A TCP socket's loss-recovery counters, from Linux's TCP_INFO: how many segments it has
retransmitted, how many bytes, and how many retransmission timeouts it took (the counter that
tells a timeout from a fast retransmit; kernels since 6.7 report it).

Offsets are struct tcp_info's (include/uapi/linux/tcp.h), which only ever grows at its end; a
field the running kernel does not fill is None."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_TOTAL_RETRANS = (100, "I")  # segments retransmitted, over the connection's life
_BYTES_RETRANS = (208, "Q")
_TOTAL_RTO = (240, "H")  # retransmission timeouts
_LARGEST = 248


@dataclass(frozen=True)
class TcpCounters:
    retrans_segments: int | None
    retrans_bytes: int | None
    rtos: int | None

    def since(self, before: TcpCounters) -> TcpCounters:
        """What happened between `before` and this reading."""

        def diff(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a - b

        return TcpCounters(
            diff(self.retrans_segments, before.retrans_segments),
            diff(self.retrans_bytes, before.retrans_bytes),
            diff(self.rtos, before.rtos),
        )


def _field(info: bytes, where: tuple[int, str]) -> int | None:
    offset, fmt = where
    if len(info) < offset + struct.calcsize(fmt):
        return None
    return struct.unpack_from(fmt, info, offset)[0]


def parse_tcp_info(info: bytes) -> TcpCounters:
    """The counters in a TCP_INFO reply (as many bytes as the kernel filled)."""
    return TcpCounters(
        _field(info, _TOTAL_RETRANS), _field(info, _BYTES_RETRANS), _field(info, _TOTAL_RTO)
    )


def tcp_counters(sock: socket.socket | None) -> TcpCounters | None:
    """The socket's counters; None for no socket, a socket that is not TCP, or a system without
    TCP_INFO."""
    if sock is None or sock.type != socket.SOCK_STREAM or not hasattr(socket, "TCP_INFO"):
        return None
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return parse_tcp_info(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _LARGEST))
    except OSError:
        return None
