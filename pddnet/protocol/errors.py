"""The one exception family of the wire format.

Every way a frame can be wrong raises a `ProtocolError` (or a subclass), never a bare
ValueError/KeyError/struct.error from the layers underneath, so a daemon can catch exactly one
type per connection, answer with an ERROR frame whose `code` is `err.code`, and keep serving its
other peers. The message always names what was wrong and by how much.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """A frame (or a message about to be encoded) breaks the wire format.

    `code` is a short snake_case tag suitable for the `code` field of an ERROR message.
    `messages` holds the whole messages a `Decoder.feed` call had already decoded from the same
    chunk of bytes before it hit the bad frame (so a caller may still act on them if it wants).
    """

    code = "protocol_error"

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        self.messages: list = []


class FrameError(ProtocolError):
    """The fixed header is wrong: magic, version, checksum, type, flags or lengths."""

    code = "bad_frame"


class LimitExceeded(FrameError):
    """A declared length is larger than this connection's limits (checked before buffering)."""

    code = "limit_exceeded"


class TruncatedFrame(FrameError):
    """The stream ended in the middle of a frame."""

    code = "truncated"


class SchemaError(ProtocolError):
    """The metadata map does not match the message's schema (missing, unknown or mistyped field)."""

    code = "bad_metadata"


class PayloadError(ProtocolError):
    """The payload does not match what the metadata declares (dtype, shape, length, checksum)."""

    code = "bad_payload"


class DecoderPoisoned(ProtocolError):
    """The decoder already failed once; the byte stream can no longer be trusted (h11 style)."""

    code = "decoder_poisoned"
