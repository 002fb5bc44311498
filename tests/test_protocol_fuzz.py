"""Hypothesis fuzzing of the wire codec.

Valid messages of every type are generated from the schema specs themselves, so a new message
or field is fuzzed without touching this file. Properties:

- any valid message round-trips, whatever the split of its bytes;
- random garbage, random headers, and truncated / mutated valid frames never raise anything but
  ProtocolError, and the decoder never holds more than its limits allow (checked after every
  feed, on a decoder with small limits so that the bound means something);
- whatever the decoder does accept is a valid message (it re-encodes and decodes to itself).
"""

from __future__ import annotations

import math
import struct
import zlib

import msgpack
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pddnet.protocol import ProtocolError
from pddnet.protocol.frame import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    VERSION,
    Decoder,
    Limits,
    decode_bytes,
    encode_bytes,
)
from pddnet.protocol.messages import (
    DTYPES,
    MESSAGE_CLASSES,
    Bool,
    Bytes,
    Float,
    FloatList,
    KvAllocRequest,
    KvAllocResponse,
    KvChunk,
    KvDone,
    Message,
    MessageType,
    Nullable,
    Spec,
    Str,
    Submit,
    TokenEvent,
    UInt,
    UIntList,
)

FUZZ = settings(
    max_examples=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
SMALL = Limits(
    max_metadata_bytes=2048,
    max_payload_bytes=4096,
    max_str_len=256,
    max_bin_len=128,
    max_array_len=64,
    max_map_len=32,
)


def spec_strategy(spec: Spec) -> st.SearchStrategy:
    if isinstance(spec, Nullable):
        return st.none() | spec_strategy(spec.inner)
    if isinstance(spec, UInt):
        return st.integers(spec.lo, spec.hi)
    if isinstance(spec, Float):
        lo = spec.lo if math.isfinite(spec.lo) else -1e9
        hi = spec.hi if math.isfinite(spec.hi) else 1e9
        return st.floats(lo, hi, allow_nan=False, allow_infinity=False, exclude_min=spec.lo_open)
    if isinstance(spec, FloatList):
        lo = spec.lo if math.isfinite(spec.lo) else -1e9
        hi = spec.hi if math.isfinite(spec.hi) else 1e9
        return st.lists(
            st.floats(lo, hi, allow_nan=False, allow_infinity=False), max_size=min(spec.max_len, 12)
        )
    if isinstance(spec, Bool):
        return st.booleans()
    if isinstance(spec, Str):
        if spec.choices is not None:
            return st.sampled_from(spec.choices)
        if spec.pattern is not None:
            return st.from_regex(spec.pattern, fullmatch=True).filter(lambda s: len(s) <= 40)
        return st.text(max_size=min(spec.max_len, 40))
    if isinstance(spec, Bytes):
        return st.binary(min_size=spec.min_len, max_size=spec.max_len)
    if isinstance(spec, UIntList):
        return st.lists(
            st.integers(0, spec.hi),
            min_size=spec.min_len,
            max_size=max(spec.min_len, min(spec.max_len, 12)),
        )
    raise AssertionError(f"no strategy for {spec!r}")


def _fix_up(cls: type[Message], values: dict, draw) -> dict:
    """Make drawn values satisfy the message's cross-field rules (rarely true by chance)."""
    if "min_tokens" in values:  # SamplingFields: never more than max_tokens
        values["min_tokens"] = min(values["min_tokens"], values["max_tokens"])
    if cls is TokenEvent:
        n = len(values["token_ids"])
        lps = values["logprobs"] = (values["logprobs"] * n)[:n] if values["logprobs"] else []
        k = draw(st.integers(0, 3)) if lps else 0
        values["top_logprob_ids"] = [i % 7 for i in range(n * k)]
        values["top_logprobs"] = [-float(i) for i in range(n * k)]
    elif cls is KvDone:
        top = values["first_top_ids"]
        values["first_top_logprobs"] = [-1.0] * len(top)
        if top and values["first_logprob"] is None:
            values["first_logprob"] = -0.5
    if cls is KvAllocRequest:
        values["num_tokens"] = len(values["prompt_token_ids"])
        values["expected_hit_tokens"] = min(values["expected_hit_tokens"], values["num_tokens"])
    elif cls is KvAllocResponse:
        if values["accepted"]:
            values["error"] = ""
            values["hit_tokens"] = min(
                values["hit_tokens"], len(values["block_ids"]) * values["block_size"]
            )
        else:
            values["error"] = values["error"] or "refused"
            values["block_ids"] = []
    elif cls is Submit:
        values["max_tokens"] = max(values["max_tokens"], len(values["output_token_ids"]) + 1)
    elif cls.TYPE is MessageType.HANDOFF:
        if not values["final"]:
            values["mode"] = "streaming"
            values["token_ids"] = values["token_ids"] or [1]
    elif cls is KvChunk:
        tokens, layers = draw(st.integers(1, 4)), draw(st.integers(1, 3))
        heads, dim = draw(st.integers(1, 2)), draw(st.integers(1, 4))
        values["token_end"] = values["token_start"] = min(values["token_start"], 1000)
        values["token_end"] += tokens
        values["layer_start"] = min(values["layer_start"], 100)
        values["layer_end"] = values["layer_start"] + layers
        values["shape"] = [layers, 2, tokens, heads, dim]
        size = layers * 2 * tokens * heads * dim * DTYPES[values["dtype"]]
        values["payload"] = draw(st.binary(min_size=size, max_size=size))
    return values


@st.composite
def messages(draw, classes: tuple[type[Message], ...] = tuple(MESSAGE_CLASSES.values())):
    cls = draw(st.sampled_from(classes))
    values = {f.name: draw(spec_strategy(f.metadata["spec"])) for f in cls.schema()}
    return cls(**_fix_up(cls, values, draw))


@st.composite
def splits(draw, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=8)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def feed_all(decoder: Decoder, pieces: list[bytes]) -> list[Message]:
    """Feed pieces; assert the decoder's memory bound after each; raise only ProtocolError."""
    out: list[Message] = []
    limits = decoder.limits

    def check_bounds() -> None:
        assert decoder.head_bytes <= HEADER_SIZE + limits.max_metadata_bytes
        assert decoder.payload_capacity <= limits.max_payload_bytes
        assert decoder.buffered_bytes <= decoder.allocated_bytes <= limits.max_frame_bytes

    try:
        for piece in pieces:
            out += decoder.feed(piece)
            check_bounds()
        decoder.eof()
    except ProtocolError:
        assert decoder.poisoned
        check_bounds()
    return out


def assert_valid(decoded: list[Message]) -> None:
    for msg in decoded:
        assert decode_bytes(encode_bytes(msg)) == msg


# -- valid messages --------------------------------------------------------------------------------


@FUZZ
@given(st.data())
def test_any_valid_message_round_trips_in_any_split(data):
    batch = data.draw(st.lists(messages(), min_size=1, max_size=4))
    stream = b"".join(encode_bytes(m, checksum=data.draw(st.booleans())) for m in batch)
    decoder = Decoder()
    got = feed_all(decoder, data.draw(splits(stream)))
    assert got == batch
    assert not decoder.poisoned and decoder.buffered_bytes == 0


# -- garbage ---------------------------------------------------------------------------------------


@FUZZ
@given(st.binary(max_size=3000), st.data())
def test_random_garbage_only_raises_protocol_error(garbage, data):
    assert_valid(feed_all(Decoder(SMALL), data.draw(splits(garbage))))


def _header(code: int, flags: int, meta_len: int, payload_len: int, payload_hash: int) -> bytes:
    head = HEADER.pack(MAGIC, VERSION, code, flags, meta_len, payload_len, payload_hash, 0)
    return head[:28] + struct.pack("!I", zlib.crc32(head[:28]))


@FUZZ
@given(
    code=st.sampled_from(sorted(MESSAGE_CLASSES)) | st.integers(0, 255),
    flags=st.just(0) | st.integers(0, 3),
    meta_len=st.integers(0, 4096) | st.integers(0, 2**32 - 1),
    payload_len=st.just(0) | st.integers(0, 8192) | st.integers(0, 2**64 - 1),
    payload_hash=st.just(0) | st.sampled_from([1, 2**64 - 1]),
    body=st.binary(max_size=256),
    data=st.data(),
)
def test_random_well_formed_headers_never_overallocate(
    code, flags, meta_len, payload_len, payload_hash, body, data
):
    # A valid CRC takes the decoder past the first checks into the length and metadata logic.
    # The stream then carries as many bytes as the header declares (capped), so a decoder that
    # trusted a declared length beyond its limits would be caught holding too much.
    fill = max(0, min(meta_len + payload_len, 3 * SMALL.max_frame_bytes) - len(body))
    stream = _header(code, flags, meta_len, payload_len, payload_hash) + body + bytes(fill)
    assert_valid(feed_all(Decoder(SMALL), data.draw(splits(stream))))


@FUZZ
@given(
    dtype=st.sampled_from(sorted(DTYPES)),
    tokens=st.integers(1, 64),
    layers=st.integers(1, 4),
    heads=st.integers(1, 8),
    dim=st.integers(1, 64),
    sent=st.integers(0, 1 << 16),
    data=st.data(),
)
def test_kv_chunk_beyond_the_payload_limit_is_refused_before_allocation(
    dtype, tokens, layers, heads, dim, sent, data
):
    shape = [layers, 2, tokens, heads, dim]
    size = math.prod(shape) * DTYPES[dtype]
    meta = {
        "request_id": "r",
        "chunk_index": 0,
        "token_start": 0,
        "token_end": tokens,
        "layer_start": 0,
        "layer_end": layers,
        "dtype": dtype,
        "shape": shape,
    }
    body = msgpack.packb(meta, use_bin_type=True)
    payload = bytes(min(size, sent))
    frame = _header(int(MessageType.KV_CHUNK), 0, len(body), size, 0) + body + payload
    decoder = Decoder(SMALL)
    got = feed_all(decoder, data.draw(splits(frame)))
    if size > SMALL.max_payload_bytes:
        assert decoder.poisoned and "exceeds this connection's limit" in str(decoder.error)
    elif len(payload) == size:
        assert len(got) == 1 and bytes(got[0].payload) == payload
    else:
        assert decoder.poisoned and "stream ended inside a KV_CHUNK frame" in str(decoder.error)


# -- damaged valid frames ----------------------------------------------------------------------------


@st.composite
def mutated(draw, frame: bytes) -> bytes:
    buf = bytearray(frame)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        if not buf:
            break
        i = draw(st.integers(0, len(buf) - 1))
        if kind == "flip":
            buf[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            buf[i] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del buf[i:]
        elif kind == "insert":
            buf[i:i] = draw(st.binary(min_size=1, max_size=16))
        else:
            del buf[i : i + draw(st.integers(1, 16))]
    return bytes(buf)


@FUZZ
@given(st.data())
def test_mutated_and_truncated_frames_only_raise_protocol_error(data):
    msg = data.draw(messages())
    frame = encode_bytes(msg, checksum=data.draw(st.booleans()))
    damaged = data.draw(mutated(frame))
    assert_valid(feed_all(Decoder(), data.draw(splits(damaged))))


@FUZZ
@given(st.data())
def test_truncated_frames_are_reported_at_eof(data):
    frame = encode_bytes(data.draw(messages()))
    cut = data.draw(st.integers(1, len(frame) - 1))
    decoder = Decoder()
    try:
        decoder.feed(frame[:cut])
        decoder.eof()
    except ProtocolError as exc:
        assert "stream ended inside" in str(exc)
    else:
        raise AssertionError("a truncated frame was accepted")


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)


@FUZZ
@given(st.data())
def test_wrong_metadata_values_only_raise_protocol_error(data):
    """Well-framed metadata with some fields replaced, dropped or added: schema errors only."""
    msg = data.draw(messages())
    meta = dict(msg.to_metadata())
    for key in data.draw(st.lists(st.sampled_from(sorted(meta)), max_size=3)):
        action = data.draw(st.sampled_from(["replace", "drop"]))
        if action == "drop":
            meta.pop(key, None)
        else:
            meta[key] = data.draw(msgpack_values)
    if data.draw(st.booleans()):
        meta[data.draw(st.text(max_size=8))] = data.draw(msgpack_values)
    body = msgpack.packb(meta, use_bin_type=True)
    payload = bytes(msg.payload) if isinstance(msg, KvChunk) else b""
    if isinstance(msg, KvChunk) and data.draw(st.booleans()):
        payload = payload[: data.draw(st.integers(0, len(payload)))]
    frame = _header(int(msg.TYPE), 0, len(body), len(payload), 0) + body + payload
    assert_valid(feed_all(Decoder(), data.draw(splits(frame))))
