"""Hypothesis fuzzing against a live cluster (real daemon processes): the handshake and the wire
codec on P's, RLD's and MD's listening ports, and the router's HTTP API.

Properties, for every generated input:
- before authentication (garbage, truncated / oversized / wrong-type HELLOs, messages that are
  not handshake messages): the daemon answers only with handshake frames, AUTH_FAIL or a fatal
  ERROR, and closes the connection; nothing is processed;
- after authentication (as a peer that holds the secret): a malformed, truncated, oversized or
  wrong-typed frame gets a fatal ERROR naming the fault and the connection is closed; valid
  messages about request ids the daemon does not know are ignored and the connection keeps
  being served (a PING sent after them is answered);
- the HTTP API answers a malformed body with a 4xx in OpenAI's error format, never a 5xx;
- afterwards every daemon still holds its original connections (the router never had to
  reconnect), serves a request token-exact, and holds no KV block, request, fd or segment
  beyond what it held before.

The daemons run in their own event loop in a helper thread, so hypothesis drives plain
synchronous test functions.
"""

from __future__ import annotations

import asyncio
import json
import struct
import threading
import time
import zlib
from collections.abc import Coroutine
from typing import Any

import aiohttp
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pddnet.cluster.local import LocalCluster
from pddnet.protocol import (
    HEADER,
    MAGIC,
    VERSION,
    Auth,
    AuthFail,
    Cancel,
    Decoder,
    ErrorMessage,
    Handoff,
    Hello,
    KvAbort,
    KvDone,
    Limits,
    MessageType,
    Ping,
    PipelineChange,
    PipelineChoice,
    Pong,
    ProtocolError,
    RequestDone,
    Submit,
    Takeover,
    Timeline,
    TokenEvent,
    encode_bytes,
)
from pddnet.protocol.handshake import Handshake, Side
from pddnet.transport.connection import HANDSHAKE_LIMITS, _new_stats, _run_handshake
from tests.chaos.harness import (
    FRESH_BODIES,
    REPORT,
    CaseResult,
    find_leaks,
    fresh_requests,
    install_report,
    is_clear_error,
    precompute_references,
    snapshot,
)
from tests.test_protocol_fuzz import messages

pytestmark = pytest.mark.timeout(170)
FUZZ = settings(
    max_examples=40,
    deadline=None,
    database=None,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.filter_too_much,
        HealthCheck.function_scoped_fixture,
    ],
)
ANSWER_TIMEOUT_S = 8.0  # > the daemons' 5 s handshake deadline: a silent daemon must close
TARGETS = ("prefill", "relay", "main_decode")
# Authenticated peers as which we connect (role, lane): RLD and MD take P's lanes, P the router's.
PEER_AS = {
    "prefill": ("router", "events"),
    "relay": ("prefill", "control"),
    "main_decode": ("prefill", "control"),
}
# Messages about requests: for an id the daemon never saw they must change nothing.
UNKNOWN_REQUEST_MESSAGES = (
    Cancel,
    KvAbort,
    RequestDone,
    KvDone,
    Handoff,
    TokenEvent,
    Timeline,
    PipelineChoice,
    PipelineChange,
    Pong,
)


class LiveCluster:
    """A LocalCluster running in its own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(
            target=self.loop.run_forever, name="fuzz-cluster", daemon=True
        )
        self.thread.start()
        self.cluster = LocalCluster(
            mode="pdd", wan="proxy", rtt_ms=2.0, overrides={"policy.pipeline": "p_rld_md"}
        )
        self.inputs = 0
        self.started = time.monotonic()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def address(self, role: str) -> tuple[str, int]:
        d = self.cluster.daemons[role]
        return d.host, d.port

    @property
    def secret(self) -> bytes:
        return self.cluster.config.secret.encode()

    def close(self, failed: bool) -> None:
        exc = AssertionError("fuzz failed") if failed else None
        try:
            self.run(self.cluster.__aexit__(type(exc) if exc else None, exc, None), 60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            self.loop.close()


@pytest.fixture(scope="module")
def live(request: pytest.FixtureRequest):
    install_report(request.config)
    precompute_references(FRESH_BODIES)
    lc = LiveCluster()
    lc.run(lc.cluster.__aenter__(), 120)
    lc.baseline = lc.run(snapshot(lc.cluster))
    lc.connects = {r: p["connects"] for r, p in lc.run(lc.cluster.stats("router"))["peers"].items()}
    failed = [False]
    lc.failed = failed
    yield lc
    lc.close(failed[0])


def _expect_served_and_clean(live: LiveCluster, case: str) -> None:
    """After a fuzz property: the router never lost a daemon, requests are served token-exact,
    nothing is held beyond the baseline. Recorded in the suite report."""
    cluster = live.cluster
    result = CaseResult(
        suite="fuzz", case=case, fault_kind="fuzz", seed=None, fuzz_inputs=live.inputs
    )
    result.duration_s = round(time.monotonic() - live.started, 2)
    live.inputs, live.started = 0, time.monotonic()
    router = live.run(cluster.stats("router"))
    for role, peer in router["peers"].items():
        if peer["connects"] != live.connects[role] or not peer["connected"]:
            result.problems.append(f"the router lost its connection to {role}: {peer}")
    fresh = live.run(fresh_requests(cluster))
    result.add(fresh)
    result.fresh_ok = all(o.status == "exact" for o in fresh)
    result.leaks = live.run(find_leaks(cluster, live.baseline))
    REPORT.add(result)
    if result.broken():
        live.failed[0] = True
    result.assert_invariants(logs=cluster.run_dir / "logs")


# -- raw bytes on a socket -------------------------------------------------------------------------


async def _exchange(
    host: str, port: int, data: bytes, authenticate: tuple[str, str] | None, secret: bytes
) -> tuple[bytes, bool, str]:
    """Connect (optionally authenticate as (role, lane)), send `data`, half-close, and read
    until the daemon closes: (bytes it sent after the handshake, closed?, lane)."""
    reader, writer = await asyncio.open_connection(host, port)
    lane = "none"
    try:
        if authenticate is not None:
            role, lane = authenticate
            hs = Handshake(
                Side.CONNECTOR, role=role, instance_id="fuzzer", secret=secret, lane=lane
            )
            await asyncio.wait_for(_run_handshake(reader, writer, hs, _new_stats()), 5.0)
        writer.write(data)
        await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
        got = bytearray()
        closed = False
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                while chunk := await reader.read(65536):
                    got += chunk
                closed = True
        except TimeoutError:
            pass
        except ConnectionResetError:
            closed = True
        return bytes(got), closed, lane
    finally:
        writer.close()


def _decode_all(data: bytes, limits: Limits) -> list[Any]:
    dec = Decoder(limits)
    out = dec.feed(data)
    dec.eof()
    return out


def _valid_prefix(data: bytes) -> bool:
    """True when `data` is the start of some valid frame (the codec finds nothing wrong yet)."""
    try:
        Decoder(Limits()).feed(data)
    except ProtocolError:
        return False
    return True


def _header(
    msg_type: int,
    metadata_len: int,
    payload_len: int = 0,
    flags: int = 0,
    version: int = VERSION,
    magic: bytes = MAGIC,
) -> bytes:
    head = HEADER.pack(magic, version, msg_type, flags, metadata_len, payload_len, 0, 0)
    return head[:-4] + struct.pack("!I", zlib.crc32(head[:-4]))


def _wrong_type(value: Any) -> Any:
    """A value of a different msgpack type than `value` (so a schema must refuse it)."""
    if isinstance(value, bool):
        return "not-a-bool"
    if isinstance(value, int):
        return "not-an-int"
    if isinstance(value, float):
        return [1.5]
    if isinstance(value, str):
        return [1, 2]
    if isinstance(value, bytes):
        return 7
    if isinstance(value, (list, tuple)):
        return "not-a-list"
    return {"not": "a scalar"}


@st.composite
def wrong_type_frames(draw, classes: tuple[type, ...]) -> bytes:
    """A valid message's frame with one field replaced by a value of the wrong type (header
    lengths and CRC recomputed, so only the schema can catch it)."""
    msg = draw(messages(classes))
    meta = {f.name: getattr(msg, f.name) for f in msg.schema()}
    meta = {k: list(v) if isinstance(v, tuple) else v for k, v in meta.items()}
    field = draw(st.sampled_from(sorted(meta)))
    meta[field] = _wrong_type(meta[field])
    body = msgpack.packb(meta, use_bin_type=True)
    return _header(int(msg.TYPE), len(body)) + body


def _valid_frame(msg: Any) -> bytes:
    return encode_bytes(msg)


HELLO = Hello(role="prefill", instance_id="fuzzer", nonce=b"n" * 32, lane="control")


# Malformed frames, one strategy a kind: garbage, corrupt headers, oversized declared lengths,
# truncated frames, bad msgpack.
def _ping_frame(draw) -> bytes:
    return _valid_frame(Ping(nonce=draw(st.integers(0, 2**32)), time=1.0))


@st.composite
def _bad_crc(draw) -> bytes:
    good = _ping_frame(draw)
    head = bytearray(good[:32])
    head[draw(st.integers(28, 31))] ^= draw(st.integers(1, 255))
    return bytes(head) + good[32:]


@st.composite
def _oversized_metadata(draw) -> bytes:
    return _header(int(MessageType.PING), draw(st.integers(3 << 20, 2**32 - 1))) + b"\x80"


@st.composite
def _oversized_payload(draw) -> bytes:
    return _header(int(MessageType.KV_CHUNK), 16, draw(st.integers(2 << 30, 2**63))) + b"\x80"


@st.composite
def _truncated(draw) -> bytes:
    frame = _valid_frame(draw(messages(UNKNOWN_REQUEST_MESSAGES)))
    return frame[: draw(st.integers(1, len(frame) - 1))]


@st.composite
def _bad_msgpack(draw) -> bytes:
    body = draw(st.binary(min_size=1, max_size=64))
    return _header(int(MessageType.CANCEL), len(body)) + body


@st.composite
def _unknown_type(draw) -> bytes:
    body = msgpack.packb({"nonce": 1, "time": 1.0})
    return _header(draw(st.integers(200, 255)), len(body)) + body


@st.composite
def _bad_flags(draw) -> bytes:
    body = _ping_frame(draw)[32:]
    return _header(int(MessageType.PING), len(body), flags=draw(st.integers(2, 0xFFFF))) + body


@st.composite
def _bad_version(draw) -> bytes:
    body = _ping_frame(draw)[32:]
    return _header(int(MessageType.PING), len(body), version=draw(st.integers(2, 255))) + body


MALFORMED_FRAMES = st.one_of(
    st.binary(min_size=1, max_size=300),  # garbage
    _bad_crc(),
    _oversized_metadata(),
    _oversized_payload(),
    _truncated(),
    _bad_msgpack(),
    _unknown_type(),
    _bad_flags(),
    _bad_version(),
)


# What an unauthenticated peer might open with, one strategy a kind.
@st.composite
def _hello_then_bad_auth(draw) -> bytes:
    return _valid_frame(HELLO) + _valid_frame(Auth(mac=draw(st.binary(min_size=32, max_size=32))))


@st.composite
def _truncated_hello(draw) -> bytes:
    frame = _valid_frame(HELLO)
    return frame[: draw(st.integers(1, len(frame) - 1))]


def _huge_hello() -> bytes:
    body = msgpack.packb(
        {"role": "prefill", "instance_id": "x" * 10000, "nonce": b"n" * 32, "lane": "control"},
        use_bin_type=True,
    )
    return _header(int(MessageType.HELLO), len(body)) + body


BAD_HANDSHAKES = st.one_of(
    MALFORMED_FRAMES,
    wrong_type_frames((Hello,)),
    messages((Cancel, Submit, Ping, KvAbort, RequestDone)).map(_valid_frame),  # not a handshake
    _hello_then_bad_auth(),
    _truncated_hello(),
    st.just(_huge_hello()),
)


# -- the properties --------------------------------------------------------------------------------


@FUZZ
@given(role=st.sampled_from(TARGETS), data=BAD_HANDSHAKES)
def test_unauthenticated_input_is_refused(live, role, data):
    live.inputs += 1
    got, closed, _ = live.run(_exchange(*live.address(role), data, None, live.secret))
    assert closed, f"{role} kept an unauthenticated connection open after {data[:80]!r}"
    answers = _decode_all(got, HANDSHAKE_LIMITS)
    for msg in answers:
        assert isinstance(msg, (Hello, AuthFail, ErrorMessage)), (
            f"{role} sent {msg.TYPE.name} to an unauthenticated peer"
        )
        if isinstance(msg, ErrorMessage):
            assert msg.fatal and len(msg.message) > 8, msg
        if isinstance(msg, AuthFail):
            assert len(msg.reason) > 8, msg


@FUZZ
@given(
    role=st.sampled_from(TARGETS),
    data=MALFORMED_FRAMES | wrong_type_frames(UNKNOWN_REQUEST_MESSAGES + (Ping,)),
)
def test_authenticated_malformed_frame_closes_that_connection(live, role, data):
    live.inputs += 1
    got, closed, lane = live.run(_exchange(*live.address(role), data, PEER_AS[role], live.secret))
    assert closed, f"{role} kept the {lane} connection open after a malformed frame {data[:80]!r}"
    try:
        answers = _decode_all(got, Limits())
    except ProtocolError as exc:
        raise AssertionError(f"{role} answered with bytes that are not frames: {exc}") from None
    errors = [m for m in answers if isinstance(m, ErrorMessage)]
    # Only a frame cut short may end in silence (the daemon just sees EOF inside it); a frame
    # the codec rejects must be answered with a fatal ERROR that names the fault.
    assert errors or _valid_prefix(data), (
        f"{role} closed without saying why after {data[:80]!r}: {answers}"
    )
    for e in errors:
        assert e.fatal and len(e.message) > 8, e


@FUZZ
@given(
    role=st.sampled_from(("relay", "main_decode")),
    msgs=st.lists(messages(UNKNOWN_REQUEST_MESSAGES), min_size=1, max_size=6),
    nonce=st.integers(0, 2**32),
)
def test_messages_for_unknown_requests_change_nothing(live, role, msgs, nonce):
    """Valid messages about request ids the daemon never saw: ignored, the connection stays
    served (the PING behind them is answered with its PONG)."""
    live.inputs += len(msgs)
    data = b"".join(_valid_frame(m) for m in msgs) + _valid_frame(Ping(nonce=nonce, time=2.0))
    got, _, lane = live.run(_exchange(*live.address(role), data, PEER_AS[role], live.secret))
    answers = _decode_all(got, Limits())
    pongs = [m for m in answers if isinstance(m, Pong) and m.nonce == nonce]
    assert pongs, f"{role} did not answer the PING after {[m.TYPE.name for m in msgs]}: {answers}"
    assert not [m for m in answers if isinstance(m, ErrorMessage) and m.fatal], answers


def test_daemons_still_serve_after_wire_fuzz(live):
    _expect_served_and_clean(live, "wire + handshake fuzz (P, RLD, MD)")


@pytest.mark.heavy
def test_takeover_for_unknown_request_is_not_held_forever(live):
    """A TAKEOVER for a request RLD never allocates: held as an 'early takeover' at most until
    the request's deadline, then dropped (it must not stay in RLD's table for ever)."""
    msg = Takeover(request_id="cmpl-never-allocated", ready_position=4, chunk_tokens=16)
    data = _valid_frame(msg) + _valid_frame(Ping(nonce=1, time=1.0))
    live.run(_exchange(*live.address("relay"), data, ("main_decode", "control"), live.secret))
    live.inputs += 1
    _expect_served_and_clean(live, "TAKEOVER for an unknown request")


# -- the router's HTTP API -------------------------------------------------------------------------

BASE_BODY = {"model": "tiny", "prompt": [256, 1, 2], "max_tokens": 4}
INVALID_FIELDS = {
    "model": [5, None, "no-such-model", ["tiny"]],
    "prompt": [{}, [], [-1], [10**9], [[1, 2], [3]], 3.5, None, [True]],
    "max_tokens": [0, -3, "4", 1.5, 10**9, True],
    "temperature": [-1, 3, "hot", [0]],
    "top_p": [0, 1.5, "p"],
    "top_k": [-2, "k", 2.5],
    "seed": [-1, 2**64, "s"],
    "stream": ["yes", 1, [True]],
    "n": [0, 17, "2"],  # 1..16 choices are served (n > 1 since issue 24)
    "logprobs": [-1, 21, "3"],  # 0..20 top logprobs are served
    "echo": [True],
    "stop_token_ids": ["x", [-1]],
    "handoff_mode": ["sideways", 3],
    "bogus_field": [1],
}

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def bad_bodies(draw) -> bytes:
    kind = draw(st.sampled_from(["not-json", "not-an-object", "no-prompt", "one-bad-field"]))
    if kind == "not-json":
        return draw(st.binary(min_size=1, max_size=200).filter(lambda b: not _is_json(b)))
    if kind == "not-an-object":
        return json.dumps(draw(json_values.filter(lambda v: not isinstance(v, dict)))).encode()
    if kind == "no-prompt":
        body = draw(
            st.dictionaries(
                st.text(max_size=10).filter(lambda k: k != "prompt"), json_values, max_size=5
            )
        )
        return json.dumps(body).encode()
    field = draw(st.sampled_from(sorted(INVALID_FIELDS)))
    body = {**BASE_BODY, field: draw(st.sampled_from(INVALID_FIELDS[field]))}
    return json.dumps(body).encode()


def _is_json(b: bytes) -> bool:
    try:
        json.loads(b)
    except ValueError:
        return False
    return True


async def _post_raw(
    url: str, data: bytes, content_type: str = "application/json"
) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as s,
        s.post(url + "/v1/completions", data=data, headers={"Content-Type": content_type}) as r,
    ):
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


@FUZZ
@given(body=bad_bodies())
def test_router_answers_bad_bodies_with_openai_4xx(live, body):
    live.inputs += 1
    status, answer = live.run(_post_raw(live.cluster.url, body))
    assert 400 <= status < 500, f"HTTP {status} for {body[:200]!r}: {answer}"
    assert is_clear_error(answer, need_code=False), (
        f"HTTP {status} for {body[:200]!r} is not an OpenAI error: {answer}"
    )


def test_router_refuses_oversized_body_with_413(live):
    live.inputs += 1
    limit = live.cluster.config.router.max_body_bytes
    big = json.dumps({**BASE_BODY, "prompt": "x" * (limit + 1000)}).encode()
    status, answer = live.run(_post_raw(live.cluster.url, big))
    assert status == 413, answer
    assert is_clear_error(answer, need_code=False), answer


def test_router_still_serves_after_http_fuzz(live):
    _expect_served_and_clean(live, "HTTP API fuzz (router)")
