"""The wire codec: round trips of every message, incremental decoding, and each validation error.

Frames with deliberately wrong headers or metadata are built by hand with `raw_frame` (correct
CRC unless told otherwise), so each test hits exactly the check it names.
"""

from __future__ import annotations

import dataclasses
import random
import re
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from pddnet.protocol import (
    DTYPES,
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MESSAGE_CLASSES,
    VERSION,
    Auth,
    AuthFail,
    AuthOk,
    CacheEvents,
    Cancel,
    Decoder,
    DecoderPoisoned,
    ErrorMessage,
    Flag,
    FrameError,
    Handoff,
    Hello,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvChunk,
    KvDone,
    KvReceived,
    LimitExceeded,
    Limits,
    LinkState,
    MessageType,
    PayloadError,
    Ping,
    PipelineChange,
    Pong,
    ProtocolError,
    RelayTokens,
    RequestDone,
    SchemaError,
    Submit,
    Takeover,
    Timeline,
    TokenEvent,
    TruncatedFrame,
    decode_bytes,
    encode,
    encode_bytes,
    parse_header,
    payload_from_array,
    payload_from_tensor,
)
from tests.samples import kv_alloc_request, kv_done, pipeline_choice, sampled_submit

NONCE = bytes(range(16))
MAC = bytes(range(32))


def kv_chunk(
    payload: object = None,
    *,
    dtype: str = "float32",
    tokens: int = 3,
    layers: int = 2,
    heads: int = 1,
    dim: int = 4,
    **over: object,
) -> KvChunk:
    shape = (layers, 2, tokens, heads, dim)
    if payload is None:
        payload = np.arange(np.prod(shape), dtype=dtype).reshape(shape)
    fields = dict(
        request_id="req-1",
        chunk_index=0,
        token_start=16,
        token_end=16 + tokens,
        layer_start=0,
        layer_end=layers,
        block_ids=[7, 8],
        dtype=dtype,
        shape=shape,
        payload=payload,
    )
    fields.update(over)
    return KvChunk(**fields)  # type: ignore[arg-type]


KV_ALLOC = kv_alloc_request(expected_hit_tokens=32)
KV_GRANT = KvAllocResponse(
    request_id="req-1",
    accepted=True,
    hit_tokens=32,
    block_ids=[3, 4, 9],
    block_size=16,
    dtype="float64",
    region="pdd-rld-kv",
)

# At least one instance of every message type, with defaults and with every optional field set.
SAMPLES = [
    Hello(role="prefill", instance_id="p-0", nonce=NONCE),
    Hello(role="main_decode", instance_id="md.dc-b:1", nonce=bytes(64)),
    Auth(mac=MAC),
    AuthOk(mac=bytes(32)),
    AuthFail(reason="bad mac"),
    Ping(nonce=0, time=0.0),
    Ping(nonce=2**64 - 1, time=1234.5),
    Pong(nonce=17, time=99.25),
    ErrorMessage(request_id=None, code="bad_frame", message="bad magic", fatal=True),
    ErrorMessage(request_id="req-1", code="no_capacity", message="RLD full"),
    LinkState(
        link="main-decode control", up=False, since=1.5, detail="heartbeat deadline", ready=False
    ),
    Submit(request_id="req-1", prompt_token_ids=[1, 2, 3], max_tokens=16),
    sampled_submit(
        prompt_token_ids=list(range(300)),
        seed=2**63,
        temperature=0.7,
        ignore_eos=True,
        output_token_ids=[9, 9, 10],
    ),
    Cancel(request_id="req-1", reason="client disconnected"),
    TokenEvent(request_id="req-1", index=0, token_ids=[42], producer="relay", time=1.5),
    TokenEvent(request_id="req-1", index=5, token_ids=[1, 2, 3], producer="main_decode", time=2.0),
    RequestDone(
        request_id="req-1",
        reason="eos",
        num_prompt_tokens=3,
        num_output_tokens=7,
        producer="main_decode",
        time=3.0,
    ),
    KV_ALLOC,
    # every size at its least, and the optional fields set
    dataclasses.replace(
        KV_ALLOC,
        request_id="req-2",
        prompt_token_ids=[1, 2],
        num_tokens=2,
        dtype="bfloat16",
        expected_hit_tokens=0,
        temperature=1.0,
        seed=7,
        pipeline="p_rld_md",
        **dict.fromkeys(("block_size", "num_layers", "num_kv_heads", "head_dim", "max_tokens"), 1),
    ),
    KV_GRANT,
    dataclasses.replace(
        KV_GRANT, accepted=False, hit_tokens=0, block_ids=[], region="", error="out of blocks"
    ),
    kv_chunk(),
    kv_chunk(dtype="uint8", tokens=1, layers=1, block_ids=[]),
    kv_done(),
    KvAbort(request_id="req-1", reason="deadline"),
    CacheEvents(seq=3, block_size=32, inserted=[2**64 - 1, 5], evicted=[]),
    CacheEvents(seq=0, block_size=16, inserted=[7], evicted=[], reset=True),
    KvReceived(request_id="r1", num_bytes=1 << 33, span_bytes=1 << 32, span_s=2.5),
    RelayTokens(request_id="req-1", start_index=1, token_ids=[4, 5, 6]),
    Takeover(request_id="req-1", ready_position=40, chunk_tokens=16),
    Timeline(request_id="req-1", event="prefill_start", time=1.5, producer="prefill"),
    Timeline(
        request_id="req-1",
        event="handoff_end",
        time=2.5,
        producer="main_decode",
        detail_int=100,
        detail_str="one-shot",
    ),
    pipeline_choice(),
    PipelineChange(request_id="req-1", pipeline="p_md", reason="RLD refused", time=1.5),
    Handoff(request_id="req-1", start_index=1, token_ids=[4, 5, 6], final=True, mode="one-shot"),
    Handoff(request_id="req-1", start_index=1, token_ids=[4], final=False, mode="streaming"),
    Handoff(request_id="req-1", start_index=7, token_ids=[], final=True, mode="streaming"),
]


def sample(cls: type, i: int = 0):
    """The i-th sample of a message class."""
    return [m for m in SAMPLES if type(m) is cls][i]


def raw_frame(
    msg_type: int,
    meta: object,
    payload: bytes = b"",
    *,
    magic: bytes = MAGIC,
    version: int = VERSION,
    flags: int = 0,
    meta_len: int | None = None,
    payload_len: int | None = None,
    payload_hash: int = 0,
    crc: int | None = None,
) -> bytes:
    body = meta if isinstance(meta, bytes) else msgpack.packb(meta, use_bin_type=True)
    head = HEADER.pack(
        magic,
        version,
        msg_type,
        flags,
        len(body) if meta_len is None else meta_len,
        len(payload) if payload_len is None else payload_len,
        payload_hash,
        0,
    )
    crc = zlib.crc32(head[:28]) if crc is None else crc
    return head[:28] + struct.pack("!I", crc) + body + payload


def meta_of(msg: object) -> dict:
    return dict(msg.to_metadata())  # type: ignore[attr-defined]


def decode_error(data: bytes, limits: Limits | None = None) -> ProtocolError:
    decoder = Decoder(limits or Limits())
    with pytest.raises(ProtocolError) as info:
        decoder.feed(data)
        decoder.eof()
    assert decoder.poisoned
    return info.value


# -- round trips ---------------------------------------------------------------------------------


def test_every_message_type_has_a_sample_and_a_registered_class():
    assert {type(m).TYPE for m in SAMPLES} == set(MessageType)
    for code, cls in MESSAGE_CLASSES.items():
        assert cls.TYPE == code


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).TYPE.name)
def test_round_trip_every_message(msg):
    assert decode_bytes(encode_bytes(msg)) == msg
    assert decode_bytes(encode_bytes(msg, checksum=True)) == msg
    # through the buffer list, as a transport would write it
    decoder = Decoder()
    got = [m for buf in encode(msg) for m in decoder.feed(buf)]
    assert got == [msg]
    assert decoder.buffered_bytes == 0 and not decoder.in_frame


def test_decoded_fields_have_wire_types():
    got = decode_bytes(encode_bytes(sample(Submit, 1)))
    assert isinstance(got, Submit)
    assert got.prompt_token_ids == tuple(range(300))
    assert got.seed == 2**63 and got.ignore_eos is True and got.temperature == 0.7


@pytest.mark.parametrize("kind", ["bytes", "bytearray", "memoryview", "numpy"])
def test_kv_chunk_payload_kinds_round_trip(kind):
    array = np.arange(2 * 2 * 3 * 1 * 4, dtype=np.float32).reshape(2, 2, 3, 1, 4)
    payload = {
        "bytes": array.tobytes(),
        "bytearray": bytearray(array.tobytes()),
        "memoryview": memoryview(array.tobytes()),
        "numpy": array,
    }[kind]
    msg = kv_chunk(payload)
    got = decode_bytes(encode_bytes(msg))
    assert got == msg
    assert bytes(got.payload) == array.tobytes()
    np.testing.assert_array_equal(got.array(), array)


def test_encode_does_not_copy_the_payload():
    array = np.zeros((2, 2, 3, 1, 4), dtype=np.float32)
    bufs = encode(kv_chunk(array))
    assert len(bufs) == 2 and isinstance(bufs[1], memoryview)
    array[0, 0, 0, 0, 0] = 5.0  # the encoded view sees the change: it is the same memory
    assert np.frombuffer(bufs[1], dtype=np.float32)[0] == 5.0
    assert len(encode(Ping(nonce=1, time=0.0))) == 1


def test_decoded_payload_is_one_buffer_shared_with_the_array():
    got = decode_bytes(encode_bytes(kv_chunk()))
    array = got.array()
    assert np.shares_memory(array, np.frombuffer(got.payload, dtype=np.uint8))


@pytest.mark.parametrize(
    "dtype", ["float64", "float32", "bfloat16", "float16", "int32", "int64", "uint8"]
)
def test_torch_tensor_payload_round_trip(dtype):
    torch = pytest.importorskip("torch")
    t = (torch.arange(2 * 2 * 3 * 2 * 4) % 100).to(getattr(torch, dtype)).reshape(2, 2, 3, 2, 4)
    payload, name, shape = payload_from_tensor(t)
    assert name == dtype and shape == tuple(t.shape)
    msg = kv_chunk(payload, dtype=name, heads=2)
    got = decode_bytes(encode_bytes(msg))
    assert torch.equal(got.tensor(), t)


def test_numpy_helper_and_bfloat16_needs_torch():
    payload, name, shape = payload_from_array(np.ones((1, 2, 1, 1, 2), dtype=np.float16))
    assert (name, shape, payload.nbytes) == ("float16", (1, 2, 1, 1, 2), 8)
    chunk = kv_chunk(bytes(16), dtype="bfloat16", tokens=1, layers=1, dim=4)
    with pytest.raises(PayloadError, match="numpy has no bfloat16"):
        chunk.array()
    with pytest.raises(PayloadError, match="not a wire dtype"):
        payload_from_array(np.ones(3, dtype=np.complex64))


# -- incremental decoding ------------------------------------------------------------------------


def test_stream_fed_one_byte_at_a_time_gives_the_same_messages():
    stream = b"".join(encode_bytes(m) for m in SAMPLES)
    decoder = Decoder()
    got = []
    for i in range(len(stream)):
        got += decoder.feed(stream[i : i + 1])
    assert got == SAMPLES
    decoder.eof()


@pytest.mark.parametrize("seed", range(5))
def test_stream_fed_in_random_splits_gives_the_same_messages(seed):
    rng = random.Random(seed)
    stream = b"".join(encode_bytes(m, checksum=rng.random() < 0.5) for m in SAMPLES)
    decoder = Decoder()
    got, pos = [], 0
    while pos < len(stream):
        step = rng.choice([1, 2, 7, 31, 32, 33, 100, 1000])
        got += decoder.feed(memoryview(stream)[pos : pos + step])
        pos += step
    assert got == SAMPLES
    assert decoder.frames_decoded == len(SAMPLES)


def test_whole_stream_in_one_feed():
    stream = bytearray(b"".join(encode_bytes(m) for m in SAMPLES))
    decoder = Decoder()
    assert decoder.feed(stream) == SAMPLES
    stream[:] = bytes(len(stream))  # decoded messages own their bytes: reusing the buffer is safe
    assert decoder.feed(b"") == []


# -- header failures -----------------------------------------------------------------------------


def test_header_layout_is_as_documented():
    frame = encode_bytes(Ping(nonce=5, time=1.0))
    assert HEADER_SIZE == 32
    assert frame[:4] == b"PDDN" and frame[4] == VERSION and frame[5] == MessageType.PING
    magic, version, code, flags, meta_len, payload_len, phash, crc = HEADER.unpack(frame[:32])
    assert (flags, payload_len, phash) == (0, 0, 0)
    assert meta_len == len(frame) - 32
    assert crc == zlib.crc32(frame[:28])
    header = parse_header(frame[:32])
    assert header.msg_type is MessageType.PING and header.frame_len == len(frame)


def test_truncated_input_is_reported_at_end_of_stream():
    frame = encode_bytes(kv_chunk())
    for cut in (1, 20, HEADER_SIZE, HEADER_SIZE + 5, len(frame) - 1):
        decoder = Decoder()
        assert decoder.feed(frame[:cut]) == []
        with pytest.raises(TruncatedFrame, match="stream ended inside"):
            decoder.eof()
    decoder = Decoder()
    decoder.feed(frame[: len(frame) - 1])
    with pytest.raises(TruncatedFrame, match=r"KV_CHUNK frame: \d+ of \d+ bytes received"):
        decoder.eof()
    Decoder().eof()  # nothing fed: a clean end


def test_bad_magic_is_rejected_on_the_first_byte():
    decoder = Decoder()
    with pytest.raises(FrameError, match="bad magic"):
        decoder.feed(b"G")  # e.g. an HTTP client: "GET / ..."
    assert decode_error(b"PDDX" + bytes(40)).code == "bad_frame"


def test_bad_version():
    err = decode_error(raw_frame(MessageType.PING, {"nonce": 1, "time": 0.0}, version=2))
    assert "unsupported protocol version 2" in str(err)


def test_header_checksum_mismatch():
    frame = bytearray(encode_bytes(Ping(nonce=1, time=0.0)))
    frame[9] ^= 0x01  # a metadata-length bit
    assert "header checksum mismatch" in str(decode_error(bytes(frame)))


def test_unknown_type_and_flags():
    assert "unknown message type 99" in str(decode_error(raw_frame(99, {})))
    err = decode_error(raw_frame(MessageType.PING, {"nonce": 1, "time": 0.0}, flags=0x8))
    assert "unknown flag bits 0x0008" in str(err)
    err = decode_error(raw_frame(MessageType.PING, {"nonce": 1, "time": 0.0}, payload_hash=5))
    assert "no PAYLOAD_CHECKSUM flag" in str(err)


def test_oversize_metadata_rejected_before_buffering():
    limits = Limits(max_metadata_bytes=1000)
    decoder = Decoder(limits)
    head = raw_frame(MessageType.SUBMIT, b"", meta_len=10_000_000)[:HEADER_SIZE]
    with pytest.raises(LimitExceeded, match="metadata of 10000000 bytes exceeds .* limit of 1000"):
        decoder.feed(head)
    assert decoder.allocated_bytes <= HEADER_SIZE


def test_oversize_payload_rejected_before_allocation():
    decoder = Decoder(Limits(max_payload_bytes=1 << 20))
    head = raw_frame(MessageType.KV_CHUNK, b"\x80", payload_len=1 << 40)[:HEADER_SIZE]
    with pytest.raises(LimitExceeded, match=f"payload of {1 << 40} bytes exceeds"):
        decoder.feed(head)
    assert decoder.allocated_bytes <= HEADER_SIZE


def test_payload_on_a_message_without_one():
    err = decode_error(raw_frame(MessageType.PING, {"nonce": 1, "time": 0.0}, b"xyz"))
    assert "PING carries no payload but the header declares 3 bytes" in str(err)


def test_empty_metadata_is_a_frame_error():
    assert "no metadata" in str(decode_error(raw_frame(MessageType.PING, b"")))


# -- payload failures ----------------------------------------------------------------------------


def test_payload_length_mismatch_is_named_and_caught_before_the_payload_arrives():
    meta = meta_of(kv_chunk())
    frame = raw_frame(MessageType.KV_CHUNK, meta, bytes(4000))
    decoder = Decoder()
    with pytest.raises(PayloadError) as info:
        decoder.feed(frame[: len(frame) - 4000])  # header + metadata only
    assert str(info.value) == (
        "KV_CHUNK payload is 4000 bytes but dtype float32 shape [2, 2, 3, 1, 4] needs 192"
    )
    assert decoder.allocated_bytes < 4000


def test_payload_mismatch_at_construction():
    with pytest.raises(PayloadError, match="payload is 10 bytes but dtype float32"):
        kv_chunk(bytes(10))
    with pytest.raises(PayloadError, match="C-contiguous"):
        kv_chunk(np.zeros((2, 2, 3, 1, 8), dtype=np.float32)[..., ::2])
    with pytest.raises(PayloadError, match="bytes-like"):
        kv_chunk([1, 2, 3])


def test_unknown_dtype_and_inconsistent_shape():
    meta = meta_of(kv_chunk())
    meta["dtype"] = "complex64"
    err = decode_error(raw_frame(MessageType.KV_CHUNK, meta, bytes(192)))
    assert isinstance(err, SchemaError) and "'dtype' must be one of 'float64'" in str(err)
    meta = meta_of(kv_chunk())
    meta["shape"] = [2, 2, 4, 1, 3]  # right byte count, wrong token count
    err = decode_error(raw_frame(MessageType.KV_CHUNK, meta, bytes(192)))
    assert "shape [2, 2, 4, 1, 3] does not match layers x K/V x tokens [2, 2, 3]" in str(err)


def test_payload_checksum_mismatch():
    frame = bytearray(encode_bytes(kv_chunk(), checksum=True))
    assert HEADER.unpack(frame[:32])[3] == Flag.PAYLOAD_CHECKSUM
    frame[-1] ^= 0xFF
    assert "payload checksum mismatch" in str(decode_error(bytes(frame)))


def test_every_dtype_size_is_checked():
    for dtype, size in DTYPES.items():
        chunk = kv_chunk(bytes(2 * 2 * 3 * 4 * size), dtype=dtype)
        assert decode_bytes(encode_bytes(chunk)).payload.nbytes == 48 * size


# -- metadata failures ---------------------------------------------------------------------------


def bad_meta(msg: object, **changes: object) -> ProtocolError:
    meta = meta_of(msg)
    for key, value in changes.items():
        if value is KeyError:
            del meta[key]
        else:
            meta[key] = value
    payload = bytes(msg.payload) if isinstance(msg, KvChunk) else b""
    return decode_error(raw_frame(type(msg).TYPE, meta, payload))


def test_missing_and_unknown_fields():
    err = bad_meta(Hello(role="relay", instance_id="r", nonce=NONCE), nonce=KeyError)
    assert isinstance(err, SchemaError) and "HELLO is missing required field 'nonce'" in str(err)
    err = bad_meta(Ping(nonce=1, time=0.0), extra=1)
    assert "PING has unknown field(s) 'extra'" in str(err)


def test_optional_fields_may_be_omitted_by_the_sender():
    meta = meta_of(sample(Submit))
    for key in (
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop_token_ids",
        "ignore_eos",
        "output_token_ids",
        "handoff_mode",
    ):
        del meta[key]
    assert decode_bytes(raw_frame(MessageType.SUBMIT, meta)) == sample(Submit)


def test_bool_is_not_an_int_and_int_is_not_a_bool():
    err = bad_meta(kv_chunk(), chunk_index=True)
    assert "KV_CHUNK field 'chunk_index' must be an int in [0, 2^32-1], got bool True" in str(err)
    err = bad_meta(sample(KvAllocResponse), accepted=1)
    assert "'accepted' must be a bool, got int 1" in str(err)
    err = bad_meta(sample(TokenEvent), token_ids=[1, False])
    assert "'token_ids'[1] must be an int" in str(err)


def test_wrong_field_types():
    assert "'token_end' must be an int" in str(bad_meta(kv_chunk(), token_end="19"))
    assert "'reason' must be a str" in str(bad_meta(sample(Cancel), reason=b"x"))
    assert "'nonce' must be bytes of length 16..64" in str(
        bad_meta(sample(Hello), nonce="0123456789abcdef")
    )
    assert "'mac' must be bytes of length 32" in str(bad_meta(sample(Auth), mac=b"short"))
    assert "'prompt_token_ids' must be a list" in str(bad_meta(sample(Submit), prompt_token_ids=3))
    assert "'time' must be a finite float" in str(bad_meta(sample(Ping), time=float("nan")))
    assert "'time' must be a finite float" in str(bad_meta(sample(Ping), time=None))


def test_ranges_and_patterns():
    assert "got int -1" in str(bad_meta(sample(KvDone), first_token_id=-1))
    assert "got int 2147483648" in str(bad_meta(sample(TokenEvent), token_ids=[2**31]))
    assert "'request_id' must be a str matching" in str(bad_meta(sample(KvDone), request_id="a b"))
    assert "'request_id' must be a str matching" in str(bad_meta(sample(KvDone), request_id=""))
    assert "'role' must be one of" in str(bad_meta(sample(Hello), role="admin"))
    assert "'top_p' must be a finite float in [0.0, 1.0]" in str(
        bad_meta(sample(Submit), top_p=1.5)
    )
    assert "'max_tokens' must be an int in [1," in str(bad_meta(sample(Submit), max_tokens=0))


def test_cross_field_rules():
    assert "num_tokens is 39 but prompt_token_ids has 40" in str(
        bad_meta(sample(KvAllocRequest), num_tokens=39)
    )
    assert "refuses but lists block_ids" in str(bad_meta(sample(KvAllocResponse, 1), block_ids=[1]))
    assert "token range [19, 19) is empty" in str(bad_meta(kv_chunk(), token_start=19))
    assert "one-shot HANDOFF must be a single final message" in str(
        bad_meta(sample(Handoff), final=False)
    )
    with pytest.raises(SchemaError, match="not final must carry at least one token"):
        Handoff(request_id="r", start_index=0, token_ids=[], final=False, mode="streaming")
    with pytest.raises(SchemaError, match="nothing left to generate"):
        Submit(request_id="r", prompt_token_ids=[1], max_tokens=2, output_token_ids=[3, 4])


def test_metadata_that_is_not_a_clean_msgpack_map():
    assert "metadata must be a map, got list" in str(decode_error(raw_frame(MessageType.PING, [1])))
    ext = msgpack.packb({"nonce": msgpack.ExtType(1, b""), "time": 0.0})
    assert "extension type 1" in str(decode_error(raw_frame(MessageType.PING, ext)))
    dup = (
        b"\x83"
        + msgpack.packb("nonce")
        + b"\x01"
        + msgpack.packb("nonce")
        + b"\x02"
        + msgpack.packb("time")
        + msgpack.packb(0.0)
    )
    assert "repeats key 'nonce'" in str(decode_error(raw_frame(MessageType.PING, dup)))
    err = decode_error(raw_frame(MessageType.PING, b"\xc1"))
    assert "PING metadata is not valid msgpack" in str(err)
    err = decode_error(raw_frame(MessageType.PING, msgpack.packb({"nonce": 1}) + b"\x00"))
    assert "not valid msgpack" in str(err) and "ExtraData" in str(err)
    err = decode_error(raw_frame(MessageType.PING, {1: 2}))
    assert "not valid msgpack" in str(err)


def test_msgpack_length_limits_apply():
    limits = Limits(max_array_len=10, max_str_len=32, max_bin_len=16)
    frame = encode_bytes(Submit(request_id="r", prompt_token_ids=list(range(11)), max_tokens=1))
    assert "11 exceeds max_array_len(10)" in str(decode_error(frame, limits))
    frame = encode_bytes(Cancel(request_id="r", reason="x" * 33))
    assert "33 exceeds max_str_len(32)" in str(decode_error(frame, limits))
    frame = encode_bytes(sample(Hello, 1))  # a 64-byte nonce
    assert "64 exceeds max_bin_len(16)" in str(decode_error(frame, limits))
    assert decode_bytes(encode_bytes(sample(Hello)), limits) == sample(Hello)


# -- decoder state -------------------------------------------------------------------------------


def test_error_carries_earlier_messages_and_poisons_the_decoder():
    good = encode_bytes(Ping(nonce=1, time=0.0))
    decoder = Decoder()
    with pytest.raises(FrameError) as info:
        decoder.feed(good + b"JUNK" + good)
    assert info.value.messages == [Ping(nonce=1, time=0.0)]
    assert decoder.poisoned and decoder.error is info.value
    with pytest.raises(DecoderPoisoned, match="poisoned by an earlier error.*bad magic"):
        decoder.feed(good)
    with pytest.raises(DecoderPoisoned):
        decoder.eof()


def test_every_error_is_a_protocol_error_with_a_code():
    for exc in (
        FrameError("x"),
        LimitExceeded("x"),
        TruncatedFrame("x"),
        SchemaError("x"),
        PayloadError("x"),
        DecoderPoisoned("x"),
    ):
        assert isinstance(exc, ProtocolError)
        assert exc.code and exc.code.replace("_", "").isalpha()
    # and the code fits an ERROR message
    err = decode_error(b"junk")
    ErrorMessage(request_id=None, code=err.code, message=str(err), fatal=True)


def test_construction_validates_like_decoding():
    with pytest.raises(SchemaError, match="'nonce' must be bytes"):
        Hello(role="relay", instance_id="r", nonce=b"short")
    with pytest.raises(SchemaError, match="'index' must be an int"):
        TokenEvent(request_id="r", index=True, token_ids=[1], producer="relay", time=0.0)
    with pytest.raises(TypeError):
        Ping(nonce=1)  # a missing constructor argument is a programming error


def test_sender_side_limits():
    with pytest.raises(LimitExceeded, match="payload of 192 bytes exceeds the limit of 100"):
        encode(kv_chunk(), limits=Limits(max_payload_bytes=100))
    with pytest.raises(LimitExceeded, match="metadata of"):
        encode(sample(Submit, 1), limits=Limits(max_metadata_bytes=64))
    with pytest.raises(ProtocolError, match="not a registered message"):
        encode("hello")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("limit", "error"),
    [
        ({"max_payload_bytes": 0}, "max_payload_bytes must be a positive int"),
        ({"max_str_len": 8}, "max_str_len must be >= 19"),
        ({"max_map_len": 2}, "max_map_len must be >="),
    ],
)
def test_limits_must_be_positive(limit, error):
    with pytest.raises(ValueError, match=error):
        Limits(**limit)


def test_messages_of_every_class_are_frozen():
    for msg in SAMPLES:
        with pytest.raises(AttributeError):
            msg.request_id = "other"  # type: ignore[misc]


def test_docs_list_every_message_and_field():
    """docs/protocol.md's tables must match the schemas in messages.py (names, order, types)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    for code, cls in MESSAGE_CLASSES.items():
        match = re.search(
            rf"^### {cls.TYPE.name} \({code}\) .*?(?=^### |^## |\Z)", doc, re.S | re.M
        )
        assert match, f"docs/protocol.md has no section for {cls.TYPE.name}"
        rows = re.findall(r"^\| `(\w+)` \| (.*?) \|", match.group(0), re.M)
        expected = [
            (f.name, f.metadata["spec"].describe().replace("|", "\\|")) for f in cls.schema()
        ]
        assert rows == expected, cls.TYPE.name
