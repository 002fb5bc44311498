"""Frames: the fixed binary header, the encoder and the incremental (sans-IO) decoder.

A frame is

    header (32 bytes, network byte order)  |  metadata (msgpack map)  |  payload (raw bytes)

    offset size field
    0      4    magic          b"PDDN"
    4      1    version        1
    5      1    message type   MessageType code
    6      2    flags          bit 0: PAYLOAD_CHECKSUM (payload_hash is valid); others must be 0
    8      4    metadata_len   1 .. Limits.max_metadata_bytes
    12     8    payload_len    0 .. Limits.max_payload_bytes (non-zero only for KV_CHUNK)
    20     8    payload_hash   xxh3-64 of the payload when PAYLOAD_CHECKSUM is set, else 0
    28     4    header_crc     CRC-32 of bytes 0..27 (catches a corrupt or misaligned stream
                               before any length in it is trusted)

Like h11, nothing here touches a socket or a clock: `encode()` turns a message into buffers for
`writelines`/`sendmsg`, and `Decoder.feed()` turns received bytes into messages. The decoder
checks every declared length against its per-connection `Limits` as soon as the header is in,
and validates the metadata (including a KV_CHUNK's dtype x shape against payload_len) before a
single payload byte is buffered. After any error it is poisoned: the stream offset can no longer
be trusted, so the connection must be closed.
"""

from __future__ import annotations

import enum
import struct
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from .errors import (
    DecoderPoisoned,
    FrameError,
    LimitExceeded,
    PayloadError,
    ProtocolError,
    SchemaError,
    TruncatedFrame,
)
from .messages import MAX_TOKEN_LIST, MESSAGE_CLASSES, Message, MessageType, payload_mismatch

MAGIC = b"PDDN"
VERSION = 1
HEADER = struct.Struct("!4sBBHIQQI")
HEADER_SIZE = HEADER.size  # 32
_CRC_SPAN = HEADER_SIZE - 4


class Flag(enum.IntFlag):
    PAYLOAD_CHECKSUM = 0x0001


KNOWN_FLAGS = int(Flag.PAYLOAD_CHECKSUM)
_LONGEST_FIELD_NAME = max(len(f.name) for c in MESSAGE_CLASSES.values() for f in c.schema())
_MOST_FIELDS = max(len(c.schema()) for c in MESSAGE_CLASSES.values())


@dataclass(frozen=True)
class Limits:
    """Per-connection bounds. A control connection can be tighter than a KV bulk lane."""

    max_metadata_bytes: int = 2 << 20  # a 64K-token prompt's ids are ~200 KB of msgpack
    max_payload_bytes: int = 256 << 20  # one KV_CHUNK; senders chunk by tokens and layers
    max_str_len: int = 16 << 10
    max_bin_len: int = 1024  # only nonces and MACs are bytes in metadata
    max_array_len: int = MAX_TOKEN_LIST
    max_map_len: int = 64  # the largest message has ~20 fields

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if type(value) is not int or value < 1:
                raise ValueError(f"Limits.{name} must be a positive int, got {value!r}")
        # Field names are msgpack strings and every field is a map entry: limits below what
        # the schema itself needs would reject every valid message of some type.
        if self.max_str_len < _LONGEST_FIELD_NAME:
            raise ValueError(
                f"Limits.max_str_len must be >= {_LONGEST_FIELD_NAME} (the longest "
                f"field name), got {self.max_str_len}"
            )
        if self.max_map_len < _MOST_FIELDS:
            raise ValueError(
                f"Limits.max_map_len must be >= {_MOST_FIELDS} (the most fields of "
                f"a message), got {self.max_map_len}"
            )

    @property
    def max_frame_bytes(self) -> int:
        return HEADER_SIZE + self.max_metadata_bytes + self.max_payload_bytes


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class FrameHeader:
    msg_type: MessageType
    flags: int
    metadata_len: int
    payload_len: int
    payload_hash: int

    @property
    def frame_len(self) -> int:
        return HEADER_SIZE + self.metadata_len + self.payload_len


def _check_prefix(head: bytes | bytearray) -> None:
    """Magic and version, checked on as few bytes as have arrived (garbage fails at byte 0)."""
    n = min(len(head), 4)
    if head[:n] != MAGIC[:n]:
        raise FrameError(
            f"bad magic {bytes(head[:n])!r}: expected {MAGIC!r} (not a pddnet peer, "
            "or the stream is misaligned)"
        )
    if len(head) > 4 and head[4] != VERSION:
        raise FrameError(f"unsupported protocol version {head[4]}: this peer speaks {VERSION}")


def parse_header(
    head: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS
) -> FrameHeader:
    """Parse and check a 32-byte header against `limits`; raise ProtocolError naming the fault."""
    head = bytes(head[:HEADER_SIZE])
    if len(head) < HEADER_SIZE:
        raise TruncatedFrame(f"header needs {HEADER_SIZE} bytes, got {len(head)}")
    _check_prefix(head)
    _, _, code, flags, meta_len, payload_len, payload_hash, crc = HEADER.unpack(head)
    actual = zlib.crc32(head[:_CRC_SPAN])
    if crc != actual:
        raise FrameError(
            f"header checksum mismatch (0x{crc:08x} != 0x{actual:08x}): corrupt or "
            "misaligned stream"
        )
    cls = MESSAGE_CLASSES.get(code)
    if cls is None:
        raise FrameError(f"unknown message type {code}")
    name = cls.TYPE.name
    if flags & ~KNOWN_FLAGS:
        raise FrameError(f"{name} frame has unknown flag bits 0x{flags & ~KNOWN_FLAGS:04x}")
    if not flags & Flag.PAYLOAD_CHECKSUM and payload_hash != 0:
        raise FrameError(f"{name} frame has a payload hash but no PAYLOAD_CHECKSUM flag")
    if meta_len == 0:
        raise FrameError(f"{name} frame has no metadata: every frame carries a msgpack map")
    if meta_len > limits.max_metadata_bytes:
        raise LimitExceeded(
            f"{name} metadata of {meta_len} bytes exceeds this connection's "
            f"limit of {limits.max_metadata_bytes}"
        )
    if payload_len > limits.max_payload_bytes:
        raise LimitExceeded(
            f"{name} payload of {payload_len} bytes exceeds this connection's "
            f"limit of {limits.max_payload_bytes}"
        )
    if payload_len and not cls.HAS_PAYLOAD:
        raise FrameError(f"{name} carries no payload but the header declares {payload_len} bytes")
    return FrameHeader(cls.TYPE, flags, meta_len, payload_len, payload_hash)


# ---------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------


def encode(
    msg: Message, *, checksum: bool = False, limits: Limits = DEFAULT_LIMITS
) -> list[bytes | memoryview]:
    """The frame as buffers: [header + metadata] and, for KV_CHUNK, the payload view (not copied).

    The sender applies the same limits a receiver would, so an oversize frame fails here with a
    clear message instead of poisoning the peer's decoder.
    """
    if not isinstance(msg, Message) or type(msg) is not MESSAGE_CLASSES.get(msg.TYPE):
        raise ProtocolError(f"cannot encode {type(msg).__name__}: not a registered message")
    meta = msgpack.packb(msg.to_metadata(), use_bin_type=True)
    name = msg.TYPE.name
    if len(meta) > limits.max_metadata_bytes:
        raise LimitExceeded(
            f"{name} metadata of {len(meta)} bytes exceeds the limit of {limits.max_metadata_bytes}"
        )
    payload: memoryview | None = msg.payload if msg.HAS_PAYLOAD else None  # type: ignore[attr-defined]
    payload_len = payload.nbytes if payload is not None else 0
    if payload_len > limits.max_payload_bytes:
        raise LimitExceeded(
            f"{name} payload of {payload_len} bytes exceeds the limit of {limits.max_payload_bytes}"
        )
    flags, payload_hash = 0, 0
    if checksum and payload_len:
        flags |= Flag.PAYLOAD_CHECKSUM
        payload_hash = xxhash.xxh3_64_intdigest(payload)
    head = HEADER.pack(
        MAGIC, VERSION, int(msg.TYPE), flags, len(meta), payload_len, payload_hash, 0
    )
    head = head[:_CRC_SPAN] + struct.pack("!I", zlib.crc32(head[:_CRC_SPAN]))
    if payload_len:
        return [head + meta, payload]  # type: ignore[list-item]
    return [head + meta]


def encode_bytes(msg: Message, *, checksum: bool = False, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """The whole frame as one bytes object (copies the payload; for tests and small messages)."""
    return b"".join(encode(msg, checksum=checksum, limits=limits))


# ---------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------


def _reject_ext(code: int, data: bytes) -> Any:
    raise SchemaError(f"metadata contains a msgpack extension type {code}: not allowed")


def _map_without_duplicates(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for key, value in pairs:
        if key in out:
            raise SchemaError(f"metadata map repeats key {key!r}")
        out[key] = value
    return out


def unpack_metadata(name: str, data: bytes | bytearray, limits: Limits = DEFAULT_LIMITS) -> dict:
    """msgpack -> dict with strict limits: no ext types, no pickle, str keys, no duplicates."""
    try:
        meta = msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_str_len=limits.max_str_len,
            max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len,
            max_map_len=limits.max_map_len,
            max_ext_len=0,
            ext_hook=_reject_ext,
            object_pairs_hook=_map_without_duplicates,
        )
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises ValueError, FormatError, StackError, ExtraData...
        raise SchemaError(
            f"{name} metadata is not valid msgpack within limits: {type(exc).__name__}: {exc}"
        ) from None
    if not isinstance(meta, dict):
        raise SchemaError(f"{name} metadata must be a map, got {type(meta).__name__}")
    return meta


class Decoder:
    """Incremental frame decoder for one connection: `feed(bytes) -> [Message, ...]`.

    Partial frames are kept between calls. Memory held is bounded by the limits: at most one
    header + metadata (<= HEADER_SIZE + max_metadata_bytes) and one payload buffer whose size
    was declared, checked and matched against the metadata before it was allocated. The
    payload is copied once, from the fed bytes into that buffer, and handed out as a memoryview.
    """

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self.limits = limits
        self.frames_decoded = 0
        self._head = bytearray()  # header, then header + metadata, of the current frame
        self._header: FrameHeader | None = None
        self._values: dict[str, object] | None = None  # checked metadata awaiting its payload
        self._payload: bytearray | None = None
        self._filled = 0
        self._error: ProtocolError | None = None

    # -- introspection (tests assert on these) --
    @property
    def buffered_bytes(self) -> int:
        """Bytes of the current, incomplete frame held right now."""
        return len(self._head) + self._filled

    @property
    def head_bytes(self) -> int:
        """Header + metadata bytes held (<= HEADER_SIZE + limits.max_metadata_bytes)."""
        return len(self._head)

    @property
    def payload_capacity(self) -> int:
        """Size of the current frame's payload buffer (<= limits.max_payload_bytes)."""
        return len(self._payload) if self._payload is not None else 0

    @property
    def allocated_bytes(self) -> int:
        """Bytes of memory the decoder holds for the current frame (payload buffer included)."""
        return self.head_bytes + self.payload_capacity

    @property
    def error(self) -> ProtocolError | None:
        return self._error

    @property
    def poisoned(self) -> bool:
        return self._error is not None

    @property
    def in_frame(self) -> bool:
        return bool(self._head) or self._header is not None

    # -- the work --
    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Consume `data`; return every message it completes, in order.

        On a bad frame raises ProtocolError (with `.messages` = the messages completed earlier in
        this same call) and poisons the decoder: every later call raises DecoderPoisoned.
        """
        self._raise_if_poisoned()
        out: list[Message] = []
        try:
            view = memoryview(data).cast("B")
            pos, end = 0, len(view)
            while True:
                if self._header is None:
                    take = min(HEADER_SIZE - len(self._head), end - pos)
                    self._head += view[pos : pos + take]
                    pos += take
                    _check_prefix(self._head)
                    if len(self._head) < HEADER_SIZE:
                        break
                    self._header = parse_header(self._head, self.limits)
                header = self._header
                if self._values is None:
                    frame_head = HEADER_SIZE + header.metadata_len
                    take = min(frame_head - len(self._head), end - pos)
                    self._head += view[pos : pos + take]
                    pos += take
                    if len(self._head) < frame_head:
                        break
                    self._values = self._check_metadata(header)
                    if header.payload_len == 0:
                        out.append(self._finish(None))
                        continue
                    self._payload = bytearray(header.payload_len)
                assert self._payload is not None
                take = min(len(self._payload) - self._filled, end - pos)
                self._payload[self._filled : self._filled + take] = view[pos : pos + take]
                self._filled += take
                pos += take
                if self._filled < len(self._payload):
                    break
                out.append(self._finish(self._payload))
        except ProtocolError as exc:
            self._error = exc
            exc.messages = out
            raise
        return out

    def eof(self) -> None:
        """The peer closed the stream: raise TruncatedFrame if it stopped inside a frame."""
        self._raise_if_poisoned()
        if not self.in_frame:
            return
        header = self._header
        if header is None:
            exc: ProtocolError = TruncatedFrame(
                f"stream ended inside a frame header ({len(self._head)} of {HEADER_SIZE} bytes)"
            )
        else:
            exc = TruncatedFrame(
                f"stream ended inside a {header.msg_type.name} frame: {self.buffered_bytes} of "
                f"{header.frame_len} bytes received (metadata {header.metadata_len}, payload "
                f"{header.payload_len})"
            )
        self._error = exc
        raise exc

    # -- helpers --
    def _raise_if_poisoned(self) -> None:
        if self._error is not None:
            raise DecoderPoisoned(
                f"decoder is poisoned by an earlier error ({self._error}); close the connection"
            ) from self._error

    def _check_metadata(self, header: FrameHeader) -> dict[str, object]:
        cls = MESSAGE_CLASSES[header.msg_type]
        name = header.msg_type.name
        meta = unpack_metadata(name, self._head[HEADER_SIZE:], self.limits)
        values = cls.check_metadata(meta)
        if cls.HAS_PAYLOAD:
            need = cls.expected_payload_len(values)
            if need != header.payload_len:
                raise PayloadError(
                    payload_mismatch(
                        header.payload_len,
                        values["dtype"],  # type: ignore[arg-type]
                        values["shape"],
                        need,
                    )
                )  # type: ignore[arg-type]
        return values

    def _finish(self, payload: bytearray | None) -> Message:
        header, values = self._header, self._values
        assert header is not None and values is not None
        if payload is not None and header.flags & Flag.PAYLOAD_CHECKSUM:
            actual = xxhash.xxh3_64_intdigest(payload)
            if actual != header.payload_hash:
                raise PayloadError(
                    f"{header.msg_type.name} payload checksum mismatch (0x{actual:016x} != "
                    f"0x{header.payload_hash:016x}): payload corrupted in transit"
                )
        cls = MESSAGE_CLASSES[header.msg_type]
        msg = cls._from_checked(values, memoryview(payload) if payload is not None else None)
        self._head = bytearray()
        self._header = self._values = self._payload = None
        self._filled = 0
        self.frames_decoded += 1
        return msg


def decode_bytes(data: bytes | bytearray | memoryview, limits: Limits = DEFAULT_LIMITS) -> Message:
    """Decode exactly one whole frame (for tests and datagram-like uses)."""
    decoder = Decoder(limits)
    messages = decoder.feed(data)
    decoder.eof()
    if len(messages) != 1:
        raise FrameError(f"expected exactly one frame, got {len(messages)}")
    return messages[0]
