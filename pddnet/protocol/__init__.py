"""pddnet.protocol: the sans-IO wire format (frames, messages, validation).

    from pddnet.protocol import Decoder, encode, Ping
    bufs = encode(Ping(nonce=1, time=0.0))        # -> transport.writelines(bufs)
    msgs = Decoder().feed(received_bytes)         # -> [Ping(...)]

See docs/protocol.md for the header layout, the limits, every message and the flow of a request.
"""

from .errors import (
    DecoderPoisoned,
    FrameError,
    LimitExceeded,
    PayloadError,
    ProtocolError,
    SchemaError,
    TruncatedFrame,
)
from .frame import (
    DEFAULT_LIMITS,
    HEADER,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    VERSION,
    Decoder,
    Flag,
    FrameHeader,
    Limits,
    decode_bytes,
    encode,
    encode_bytes,
    parse_header,
    unpack_metadata,
)
from .messages import (
    DONE_REASONS,
    DTYPES,
    HANDOFF_MODES,
    MESSAGE_CLASSES,
    PRODUCERS,
    ROLES,
    Auth,
    AuthFail,
    AuthOk,
    CacheEvents,
    Cancel,
    ErrorMessage,
    Handoff,
    Hello,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvChunk,
    KvDone,
    KvReceived,
    LinkState,
    Message,
    MessageType,
    Ping,
    Pong,
    RelayTokens,
    RequestDone,
    SamplingFields,
    Submit,
    Takeover,
    Timeline,
    TokenEvent,
    array_from_payload,
    as_payload,
    dtype_itemsize,
    message_class,
    payload_from_array,
    payload_from_tensor,
    tensor_from_payload,
)

__all__ = [
    # errors
    "ProtocolError", "FrameError", "LimitExceeded", "TruncatedFrame", "SchemaError",
    "PayloadError", "DecoderPoisoned",
    # frames
    "MAGIC", "VERSION", "HEADER", "HEADER_SIZE", "Flag", "KNOWN_FLAGS", "Limits",
    "DEFAULT_LIMITS", "FrameHeader", "parse_header", "unpack_metadata", "encode",
    "encode_bytes", "Decoder", "decode_bytes",
    # messages
    "MessageType", "Message", "SamplingFields", "MESSAGE_CLASSES", "message_class",
    "DTYPES", "ROLES", "PRODUCERS", "DONE_REASONS", "HANDOFF_MODES",
    "Hello", "Auth", "AuthOk", "AuthFail", "Ping", "Pong", "ErrorMessage", "LinkState",
    "Submit", "Cancel", "TokenEvent", "RequestDone",
    "KvAllocRequest", "KvAllocResponse", "KvChunk", "KvDone", "KvAbort", "CacheEvents", "KvReceived",
    "RelayTokens", "Takeover", "Handoff", "Timeline",
    "dtype_itemsize", "as_payload", "payload_from_array", "payload_from_tensor",
    "array_from_payload", "tensor_from_payload",
]
