"""pddnet.protocol: the wire only, sans-IO: frames, messages, validation, and the HELLO/AUTH
handshake machine (handshake.py). What a request does with the messages is pddnet.lifecycle's.

    from pddnet.protocol import Decoder, encode, Ping
    bufs = encode(Ping(nonce=1, time=0.0))        # -> transport.writelines(bufs)
    msgs = Decoder().feed(received_bytes)         # -> [Ping(...)]

See docs/protocol.md for the header layout, the limits, every message and the flow of a request.
"""

from pddnet.lazy import lazy_exports

# The wire's public names, each beside the module that defines it: one list (PEP 562, as
# pddnet.model's and pddnet.engine's faces do).
_EXPORTS = {
    "ProtocolError": "errors",
    "FrameError": "errors",
    "LimitExceeded": "errors",
    "TruncatedFrame": "errors",
    "SchemaError": "errors",
    "PayloadError": "errors",
    "DecoderPoisoned": "errors",
    "MAGIC": "frame",
    "VERSION": "frame",
    "HEADER": "frame",
    "HEADER_SIZE": "frame",
    "Flag": "frame",
    "KNOWN_FLAGS": "frame",
    "Limits": "frame",
    "DEFAULT_LIMITS": "frame",
    "FrameHeader": "frame",
    "parse_header": "frame",
    "unpack_metadata": "frame",
    "encode": "frame",
    "encode_bytes": "frame",
    "Decoder": "frame",
    "decode_bytes": "frame",
    "MessageType": "messages",
    "Message": "messages",
    "SamplingFields": "messages",
    "MESSAGE_CLASSES": "messages",
    "message_class": "messages",
    "DTYPES": "messages",
    "ROLES": "messages",
    "PRODUCERS": "messages",
    "DONE_REASONS": "messages",
    "HANDOFF_MODES": "messages",
    "Hello": "messages",
    "Auth": "messages",
    "AuthOk": "messages",
    "AuthFail": "messages",
    "Ping": "messages",
    "Pong": "messages",
    "ErrorMessage": "messages",
    "LinkState": "messages",
    "Submit": "messages",
    "Cancel": "messages",
    "TokenEvent": "messages",
    "RequestDone": "messages",
    "KvAllocRequest": "messages",
    "KvAllocResponse": "messages",
    "KvChunk": "messages",
    "KvDone": "messages",
    "KvAbort": "messages",
    "CacheEvents": "messages",
    "KvReceived": "messages",
    "RelayTokens": "messages",
    "Takeover": "messages",
    "Handoff": "messages",
    "Timeline": "messages",
    "PipelineChoice": "messages",
    "PipelineChange": "messages",
    "dtype_itemsize": "messages",
    "as_payload": "messages",
    "payload_from_array": "messages",
    "payload_from_tensor": "messages",
    "array_from_payload": "messages",
    "tensor_from_payload": "messages",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
