"""A TCP socket's loss-recovery counters, from Linux's TCP_INFO: how many segments it has
retransmitted, how many bytes, and how many retransmission timeouts it took (the counter that
tells a timeout from a fast retransmit; kernels since 6.7 report it). And what held a sender
back: how long it had data in flight, and of that how long the receiver's window or its own
send buffer limited it (kernels since 4.10), with its congestion window.

Offsets are struct tcp_info's (include/uapi/linux/tcp.h), which only ever grows at its end; a
field the running kernel does not fill is None."""

from __future__ import annotations

import socket
import struct
from dataclasses import dataclass

_TOTAL_RETRANS = (100, "I")  # segments retransmitted, over the connection's life
_BYTES_RETRANS = (208, "Q")
_TOTAL_RTO = (240, "H")  # retransmission timeouts
_SND_CWND = (80, "I")  # segments
_BUSY_US = (168, "Q")  # time with data in flight
_RWND_LIMITED_US = (176, "Q")  # of which the receiver's window was full
_SNDBUF_LIMITED_US = (184, "Q")  # of which the send buffer was empty of new data to send
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


@dataclass(frozen=True)
class TcpSendLimits:
    """Microseconds over the connection's life: busy (data in flight), and of that limited by
    the receiver's window or by the send buffer; the congestion window now (segments)."""

    busy_us: int | None
    rwnd_limited_us: int | None
    sndbuf_limited_us: int | None
    cwnd_segments: int | None

    def since(self, before: TcpSendLimits) -> TcpSendLimits:
        """The times between `before` and this reading; the window as it is now."""

        def diff(a: int | None, b: int | None) -> int | None:
            return None if a is None or b is None else a - b

        return TcpSendLimits(
            diff(self.busy_us, before.busy_us),
            diff(self.rwnd_limited_us, before.rwnd_limited_us),
            diff(self.sndbuf_limited_us, before.sndbuf_limited_us),
            self.cwnd_segments,
        )


def parse_send_limits(info: bytes) -> TcpSendLimits:
    """The sender's limits in a TCP_INFO reply (as many bytes as the kernel filled)."""
    return TcpSendLimits(
        _field(info, _BUSY_US),
        _field(info, _RWND_LIMITED_US),
        _field(info, _SNDBUF_LIMITED_US),
        _field(info, _SND_CWND),
    )


def _tcp_info(sock: socket.socket | None) -> bytes | None:
    """The socket's TCP_INFO; None for no socket, a socket that is not TCP, or a system
    without TCP_INFO."""
    if sock is None or sock.type != socket.SOCK_STREAM or not hasattr(socket, "TCP_INFO"):
        return None
    if sock.family not in (socket.AF_INET, socket.AF_INET6):
        return None
    try:
        return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _LARGEST)
    except OSError:
        return None


def tcp_counters(sock: socket.socket | None) -> TcpCounters | None:
    """The socket's loss-recovery counters (None as `_tcp_info`)."""
    info = _tcp_info(sock)
    return None if info is None else parse_tcp_info(info)


def tcp_send_limits(sock: socket.socket | None) -> TcpSendLimits | None:
    """The socket's sender limits (None as `_tcp_info`)."""
    info = _tcp_info(sock)
    return None if info is None else parse_send_limits(info)
