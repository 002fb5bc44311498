"""Every message pddnet daemons exchange, with its field schema, in one place.

A message is a frozen, keyword-only dataclass with a `TYPE` code. Each field carries a `Spec`
(its wire type and range) in its dataclass metadata; the same specs validate a message when a
sender builds it and when a receiver decodes it, so a bad value is caught on the side that made
it. Field names are snake_case and stable: they are the keys of the msgpack metadata map.

Wire conventions shared by all messages (docs/protocol.md has the full tables and the flow):

- `request_id`: the router's id for a client request, 1..128 chars of [A-Za-z0-9._:-].
- Output token *index* i counts generated tokens: index 0 is the first output token (sampled
  by P from its last prefill logits); a token's *position* in the sequence is
  len(prompt) + index.
- Times are float seconds on the sender's clock (the sans-IO layer never reads a clock: the
  caller passes them in).
- Only KV_CHUNK carries a payload: raw KV bytes in layout [layers, 2 (K, V), tokens,
  kv_heads, head_dim], C order, of the declared dtype.

No message type ever carries pickled or otherwise executable data.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from pddnet.int_lists import all_ints_within
from pddnet.lanes import LANES  # HELLO.lane: what a connection carries

from .errors import PayloadError, SchemaError

# ---------------------------------------------------------------------------------------------
# Field specs: the wire types. Each check() returns the normalised value or raises SchemaError.
# ---------------------------------------------------------------------------------------------

U32_MAX = 2**32 - 1
U64_MAX = 2**64 - 1
TOKEN_ID_MAX = 2**31 - 1  # token ids must fit an int32 tensor
MAX_TOKEN_LIST = 1 << 20  # longest token id list a message may carry (prompts, handoffs)
MAX_BLOCK_LIST = 1 << 20
MAX_TEXT = 4096
MAX_TOP_LOGPROBS = 20  # top log-probabilities per token (pddnet.engine.sampling)
MAX_LOGPROB_TOKENS = 4096  # tokens of one TOKEN_EVENT that carries log-probabilities
LOGPROB_MIN = -9999.0  # -inf is reported as this (as vLLM does)


def _describe_value(value: object) -> str:
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return f"{type(value).__name__} {text}"


def _bound(n: int) -> str:
    """Spell the usual limits readably in errors and docs: 2^32-1 rather than 4294967295."""
    for bits in (64, 32, 31):
        if n == 2**bits - 1:
            return f"2^{bits}-1"
    return f"2^{n.bit_length() - 1}" if n >= 1024 and n & (n - 1) == 0 else str(n)


def _is_int(value: object) -> bool:
    # bool is a subclass of int in Python; on the wire a bool is never a number.
    return type(value) is int


class Spec:
    """One field's wire type. `describe()` is what docs and error messages show."""

    def check(self, where: str, value: object) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:  # pragma: no cover - abstract
        raise NotImplementedError

    def _fail(self, where: str, value: object) -> SchemaError:
        return SchemaError(f"{where} must be {self.describe()}, got {_describe_value(value)}")


@dataclass(frozen=True)
class UInt(Spec):
    lo: int = 0
    hi: int = U32_MAX

    def check(self, where: str, value: object) -> int:
        if not _is_int(value) or not self.lo <= value <= self.hi:  # type: ignore[operator]
            raise self._fail(where, value)
        return value  # type: ignore[return-value]

    def describe(self) -> str:
        return f"an int in [{_bound(self.lo)}, {_bound(self.hi)}]"


@dataclass(frozen=True)
class Float(Spec):
    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False  # the lower bound itself is excluded: (lo, hi]

    def ok(self, value: object) -> bool:
        return (
            type(value) is float
            and math.isfinite(value)  # type: ignore[arg-type]
            and (self.lo < value if self.lo_open else self.lo <= value)  # type: ignore[operator]
            and value <= self.hi
        )  # type: ignore[operator]

    def check(self, where: str, value: object) -> float:
        # An int is accepted for a float field (a sender writing `0` for a time is not wrong);
        # a bool, NaN or infinity is.
        if _is_int(value):
            value = float(value)  # type: ignore[arg-type]
        if not self.ok(value):
            raise self._fail(where, value)
        return value  # type: ignore[return-value]

    def describe(self) -> str:
        if math.isinf(self.lo) and math.isinf(self.hi):
            return "a finite float"
        return f"a finite float in {'(' if self.lo_open else '['}{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class FloatList(Spec):
    """A list of finite floats in [lo, hi]; normalised to a tuple (ints become floats)."""

    lo: float = -math.inf
    hi: float = math.inf
    max_len: int = MAX_TOKEN_LIST

    def check(self, where: str, value: object) -> tuple[float, ...]:
        if type(value) not in (list, tuple) or len(value) > self.max_len:  # type: ignore[arg-type]
            raise self._fail(where, value)
        item_spec = Float(self.lo, self.hi)
        out = []
        for i, item in enumerate(value):  # type: ignore[arg-type]
            if _is_int(item):
                item = float(item)
            if not item_spec.ok(item):
                raise SchemaError(
                    f"{where}[{i}] must be {item_spec.describe()}, got {_describe_value(item)}"
                )
            out.append(item)
        return tuple(out)

    def describe(self) -> str:
        return f"a list of 0..{_bound(self.max_len)} finite floats in [{self.lo}, {self.hi}]"


@dataclass(frozen=True)
class Bool(Spec):
    def check(self, where: str, value: object) -> bool:
        if type(value) is not bool:
            raise self._fail(where, value)
        return value

    def describe(self) -> str:
        return "a bool"


@dataclass(frozen=True)
class Str(Spec):
    max_len: int = MAX_TEXT
    pattern: str | None = None  # a regex the whole string must match
    choices: tuple[str, ...] | None = None

    def check(self, where: str, value: object) -> str:
        if type(value) is not str or len(value) > self.max_len:
            raise self._fail(where, value)
        if self.choices is not None and value not in self.choices:
            raise self._fail(where, value)
        if self.pattern is not None and re.fullmatch(self.pattern, value) is None:
            raise self._fail(where, value)
        return value

    def describe(self) -> str:
        if self.choices is not None:
            return "one of " + ", ".join(repr(c) for c in self.choices)
        if self.pattern is not None:
            return f"a str matching {self.pattern}"
        return f"a str of at most {self.max_len} chars"


@dataclass(frozen=True)
class Bytes(Spec):
    min_len: int = 0
    max_len: int = 1024

    def check(self, where: str, value: object) -> bytes:
        if type(value) is not bytes or not self.min_len <= len(value) <= self.max_len:
            raise self._fail(where, value)
        return value

    def describe(self) -> str:
        if self.min_len == self.max_len:
            return f"bytes of length {self.min_len}"
        return f"bytes of length {self.min_len}..{self.max_len}"


# The long tuples that passed a UIntList check lately, with their bound: a tuple is immutable,
# so a message built from another's field (P's KV_ALLOC_REQUEST from the SUBMIT's prompt) does
# not walk the same ids again. A ring: slots are overwritten in turn (thread-safe under the GIL).
_CHECKED: list[tuple[tuple[int, ...], int] | None] = [None] * 16
_CHECKED_NEXT = itertools.count()
_REMEMBER_FROM = 1024  # shorter lists are cheap to check again


def _checked_before(value: object, hi: int) -> bool:
    for entry in _CHECKED:
        if entry is not None and entry[0] is value and entry[1] <= hi:
            return True
    return False


@dataclass(frozen=True)
class UIntList(Spec):
    """A list of ints; normalised to a tuple so that messages stay immutable and comparable."""

    hi: int = U32_MAX
    max_len: int = MAX_TOKEN_LIST
    min_len: int = 0

    def check(self, where: str, value: object) -> tuple[int, ...]:
        if type(value) not in (list, tuple) or not self.min_len <= len(value) <= self.max_len:  # type: ignore[arg-type]
            raise self._fail(where, value)
        if len(value) < _REMEMBER_FROM:  # type: ignore[arg-type]
            return self._check_items(where, value)  # type: ignore[arg-type]
        if _checked_before(value, self.hi):
            return value  # type: ignore[return-value]
        if all_ints_within(value, self.hi):  # type: ignore[arg-type]
            out = tuple(value)  # type: ignore[arg-type]
        else:
            out = self._check_items(where, value)  # type: ignore[arg-type]
        _CHECKED[next(_CHECKED_NEXT) % len(_CHECKED)] = (out, self.hi)
        return out

    def _check_items(self, where: str, value: Sequence[object]) -> tuple[int, ...]:
        hi = self.hi
        for i, item in enumerate(value):
            if type(item) is not int or not 0 <= item <= hi:
                raise SchemaError(
                    f"{where}[{i}] must be an int in [0, {_bound(hi)}], got {_describe_value(item)}"
                )
        return tuple(value)  # type: ignore[arg-type]

    def describe(self) -> str:
        count = (
            str(self.min_len)
            if self.min_len == self.max_len
            else f"{self.min_len}..{_bound(self.max_len)}"
        )
        return f"a list of {count} ints in [0, {_bound(self.hi)}]"


@dataclass(frozen=True)
class Nullable(Spec):
    inner: Spec

    def check(self, where: str, value: object) -> Any:
        return None if value is None else self.inner.check(where, value)

    def describe(self) -> str:
        return f"null or {self.inner.describe()}"


def field(spec: Spec, default: object = dataclasses.MISSING, doc: str = "") -> Any:
    """A message field: its wire spec, its default (omitted = required) and one line of doc."""
    return dataclasses.field(default=default, metadata={"spec": spec, "doc": doc})


# Shared vocabularies ---------------------------------------------------------------------------

ID_PATTERN = r"[A-Za-z0-9._:\-]{1,128}"
CODE_PATTERN = r"[a-z][a-z0-9_]{0,63}"
# A pipeline's wire name: a code no longer than its field's 32 characters (a pattern that allowed
# more than max_len made the schema contradict itself; the fuzzer found it)
PIPELINE_PATTERN = r"[a-z][a-z0-9_]{0,31}"
ROLES = ("router", "prefill", "relay", "main_decode", "client")
PRODUCERS = ("prefill", "relay", "main_decode")
DONE_REASONS = ("eos", "stop", "length", "cancel", "error")
HANDOFF_MODES = ("one-shot", "streaming")  # the spelling of pddnet.policy.handoff.HandoffMode

# KV dtypes: name -> bytes per element. A closed set: anything else is a protocol error.
DTYPES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "int32": 4,
    "int64": 8,
    "uint8": 1,
}
MAX_SHAPE_DIMS = 8

REQUEST_ID = Str(max_len=128, pattern=ID_PATTERN)
INSTANCE_ID = Str(max_len=128, pattern=ID_PATTERN)
TOKEN_IDS = UIntList(hi=TOKEN_ID_MAX, max_len=MAX_TOKEN_LIST)
COUNT = UInt(0, U32_MAX)
DTYPE = Str(max_len=16, choices=tuple(DTYPES))
NONCE = Bytes(16, 64)
MAC = Bytes(32, 32)  # HMAC-SHA256
TIME = Float()
REASON = Str(max_len=MAX_TEXT)
HANDOFF_OVERRIDE = Nullable(Str(max_len=16, choices=(*HANDOFF_MODES, "dynamic")))  # null: policy's


def dtype_itemsize(dtype: str) -> int:
    try:
        return DTYPES[dtype]
    except KeyError:
        raise PayloadError(
            f"unknown dtype {dtype!r}; expected one of {', '.join(DTYPES)}"
        ) from None


# ---------------------------------------------------------------------------------------------
# Type codes and the base class
# ---------------------------------------------------------------------------------------------


class MessageType(enum.IntEnum):
    # connection: handshake, liveness, errors
    HELLO = 1
    AUTH = 2
    AUTH_OK = 3
    AUTH_FAIL = 4
    PING = 5
    PONG = 6
    ERROR = 7
    LINK_STATE = 8
    # request lifecycle (router <-> daemons)
    SUBMIT = 16
    CANCEL = 17
    TOKEN_EVENT = 18
    REQUEST_DONE = 19
    TIMELINE = 20
    PIPELINE_CHOICE = 21
    PIPELINE_CHANGE = 22
    # KV transfer (P -> RLD / MD) and the decode-side cache view (MD -> P)
    KV_ALLOC_REQUEST = 32
    KV_ALLOC_RESPONSE = 33
    KV_CHUNK = 34
    KV_DONE = 35
    KV_ABORT = 36
    CACHE_EVENTS = 37
    KV_RECEIVED = 38
    # RLD <-> MD handoff by token ids
    RELAY_TOKENS = 48
    TAKEOVER = 49
    HANDOFF = 50


def _normalise(cls: type, values: Mapping[str, object]) -> dict[str, object]:
    """Check every schema field of `cls` in `values`; return the normalised values."""
    name = cls.TYPE.name
    out: dict[str, object] = {}
    for f in cls.schema():
        out[f.name] = f.metadata["spec"].check(f"{name} field {f.name!r}", values[f.name])
    return out


_SCHEMAS: dict[type, tuple[dataclasses.Field, ...]] = {}


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of all messages. Subclasses set TYPE (and HAS_PAYLOAD for KV_CHUNK)."""

    TYPE: ClassVar[MessageType]
    HAS_PAYLOAD: ClassVar[bool] = False

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in self.schema()}
        for key, value in _normalise(type(self), values).items():
            object.__setattr__(self, key, value)
        self._cross_check(vars(self))

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        """Rules between fields (e.g. ranges that must be ordered). Override per message."""

    @classmethod
    def schema(cls) -> tuple[dataclasses.Field, ...]:
        """The metadata fields (everything except the payload), in declaration order."""
        cached = _SCHEMAS.get(cls)
        if cached is None:  # per-class cache: schema() runs on every construction
            cached = _SCHEMAS[cls] = tuple(
                f for f in dataclasses.fields(cls) if "spec" in f.metadata
            )
        return cached

    def to_metadata(self) -> dict[str, object]:
        """The msgpack metadata map: every schema field, defaults included (explicit on the wire)."""
        return {f.name: getattr(self, f.name) for f in self.schema()}

    @classmethod
    def check_metadata(cls, meta: Mapping[str, object]) -> dict[str, object]:
        """Validate a decoded metadata map against the schema; return constructor arguments.

        Required fields must be present, unknown keys are rejected (a peer that sends a field
        we do not know speaks another protocol version and must bump the header version), and
        fields omitted by the sender take their documented defaults.
        """
        name = cls.TYPE.name
        fields = cls.schema()
        known = {f.name for f in fields}
        unknown = sorted(str(k) for k in meta if k not in known)
        if unknown:
            raise SchemaError(f"{name} has unknown field(s) {', '.join(map(repr, unknown))}")
        values: dict[str, object] = {}
        for f in fields:
            if f.name in meta:
                values[f.name] = meta[f.name]
            elif f.default is not dataclasses.MISSING:
                values[f.name] = f.default
            else:
                raise SchemaError(f"{name} is missing required field {f.name!r}")
        values = _normalise(cls, values)
        cls._cross_check(values)
        return values

    @classmethod
    def expected_payload_len(cls, values: Mapping[str, object]) -> int:
        """How many payload bytes a frame with these (checked) metadata values must carry."""
        return 0

    @classmethod
    def _from_checked(
        cls, values: Mapping[str, object], payload: memoryview | None = None
    ) -> Message:
        """Build from values check_metadata() already validated, without validating twice
        (a 64K-token prompt list is worth checking once). The decoder's only constructor."""
        msg = object.__new__(cls)
        for key, value in values.items():
            object.__setattr__(msg, key, value)
        if cls.HAS_PAYLOAD:
            object.__setattr__(msg, "payload", payload)
        return msg


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise SchemaError(message)


# ---------------------------------------------------------------------------------------------
# Connection: handshake, liveness, errors
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Hello(Message):
    """Both ends -> peer, first frame on every connection (the connector first, then the acceptor).

    Handshake (issue 8): A -> HELLO(nonce_a); B -> HELLO(nonce_b); A -> AUTH(mac_a);
    B -> AUTH_OK(mac_b) or AUTH_FAIL. Nothing else is processed before AUTH_OK.
    """

    TYPE = MessageType.HELLO
    role: str = field(Str(max_len=16, choices=ROLES), doc="sender's role")
    instance_id: str = field(INSTANCE_ID, doc="sender's instance name, unique in the cluster")
    nonce: bytes = field(NONCE, doc="fresh random bytes from the sender (16..64)")
    lane: str = field(
        Str(max_len=16, choices=LANES),
        default="control",
        doc="what the connection carries: events, control or bulk (KV_CHUNK only)",
    )


@dataclass(frozen=True, kw_only=True)
class Auth(Message):
    """Connector -> acceptor, after both HELLOs: proof that it holds the cluster secret.

    mac = HMAC-SHA256(secret, b"pddnet-auth-v1|connector|" + connector HELLO fields + acceptor
    HELLO fields), compared in constant time. Fresh acceptor nonces make a replayed AUTH fail.
    """

    TYPE = MessageType.AUTH
    mac: bytes = field(MAC, doc="HMAC-SHA256 over both HELLOs, connector direction")


@dataclass(frozen=True, kw_only=True)
class AuthOk(Message):
    """Acceptor -> connector: accepted; `mac` proves the acceptor holds the secret too."""

    TYPE = MessageType.AUTH_OK
    mac: bytes = field(MAC, doc="HMAC-SHA256 over both HELLOs, acceptor direction")


@dataclass(frozen=True, kw_only=True)
class AuthFail(Message):
    """Acceptor -> connector: refused (bad mac, unknown role...); the acceptor then closes."""

    TYPE = MessageType.AUTH_FAIL
    reason: str = field(REASON, doc="why, for the connector's log")


@dataclass(frozen=True, kw_only=True)
class Ping(Message):
    """Either side -> peer on a control connection: heartbeat; the peer answers PONG at once."""

    TYPE = MessageType.PING
    nonce: int = field(UInt(0, U64_MAX), doc="sender's counter, echoed by PONG")
    time: float = field(TIME, doc="sender's clock when sent, echoed by PONG (RTT = now - time)")


@dataclass(frozen=True, kw_only=True)
class Pong(Message):
    """Answer to PING: echoes its nonce and time."""

    TYPE = MessageType.PONG
    nonce: int = field(UInt(0, U64_MAX), doc="the PING's nonce")
    time: float = field(TIME, doc="the PING's time, unchanged")


@dataclass(frozen=True, kw_only=True)
class ErrorMessage(Message):
    """Any daemon -> peer: something failed. Per request, or (request_id null) the connection.

    After a ProtocolError the receiver sends ERROR(code=err.code, fatal=True) and closes.
    """

    TYPE = MessageType.ERROR
    request_id: str | None = field(Nullable(REQUEST_ID), doc="the request concerned, or null")
    code: str = field(Str(max_len=64, pattern=CODE_PATTERN), doc="snake_case machine tag")
    message: str = field(REASON, doc="human-readable cause")
    fatal: bool = field(Bool(), default=False, doc="the sender closes the connection after it")


@dataclass(frozen=True, kw_only=True)
class LinkState(Message):
    """P, RLD or MD -> router on the events lane: one link the daemon needs (a lane it dials)
    went up or down. Sent on every change, and for every link when the router connects, so
    the router's /health says ready only when every daemon has all its links up."""

    TYPE = MessageType.LINK_STATE
    link: str = field(Str(max_len=64), doc='which link, e.g. "main-decode control"')
    up: bool = field(Bool(), doc="the link is up now")
    since: float = field(TIME, doc="when it went up or down (sender's clock)")
    detail: str = field(REASON, default="", doc='why it is down (its last loss), or ""')
    ready: bool = field(Bool(), doc="every link the sender needs is up, this one included")


# ---------------------------------------------------------------------------------------------
# Request lifecycle
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class SamplingFields:
    """How the decode tier samples; shared by SUBMIT and KV_ALLOC_REQUEST (the decoder needs it).

    Randomness is a function of (seed, position) only, so every instance samples alike.
    """

    max_tokens: int = field(UInt(1, MAX_TOKEN_LIST), doc="output tokens at most (index 0 included)")
    temperature: float = field(Float(0.0, 100.0), default=0.0, doc="0 = greedy")
    top_p: float = field(Float(0.0, 1.0), default=1.0, doc="nucleus mass; 1 = off")
    top_k: int = field(UInt(0, U32_MAX), default=0, doc="0 = off")
    seed: int | None = field(Nullable(UInt(0, U64_MAX)), default=None, doc="request seed")
    stop_token_ids: tuple[int, ...] = field(
        UIntList(hi=TOKEN_ID_MAX, max_len=256), default=(), doc="extra stop tokens besides EOS"
    )
    ignore_eos: bool = field(Bool(), default=False, doc="do not stop on EOS")
    min_tokens: int = field(
        UInt(0, MAX_TOKEN_LIST),
        default=0,
        doc="EOS and stop_token_ids masked until this many outputs",
    )
    presence_penalty: float = field(
        Float(-2.0, 2.0), default=0.0, doc="minus this once per token present in the output"
    )
    frequency_penalty: float = field(
        Float(-2.0, 2.0), default=0.0, doc="minus this per occurrence in the output"
    )
    repetition_penalty: float = field(
        Float(0.0, 100.0, lo_open=True),
        default=1.0,
        doc="prompt + output tokens: logit / it (> 0) or x it; 1 = off",
    )
    logprobs: int | None = field(
        Nullable(UInt(0, MAX_TOP_LOGPROBS)),
        default=None,
        doc="return each token's logprob and this many top ones",
    )


SAMPLING_FIELD_NAMES = tuple(f.name for f in dataclasses.fields(SamplingFields))


def _check_sampling(name: str, v: Mapping[str, Any]) -> None:
    _require(
        v["min_tokens"] <= v["max_tokens"],
        f"{name} min_tokens {v['min_tokens']} exceeds max_tokens {v['max_tokens']}",
    )


@dataclass(frozen=True, kw_only=True)
class Submit(SamplingFields, Message):
    """Router -> P: a new request. Also router -> a decode instance to replay a request after a
    failure (issue 8): `output_token_ids` then holds the tokens the client already has, which the
    instance recomputes by one extend before it continues at index len(output_token_ids)."""

    TYPE = MessageType.SUBMIT
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    prompt_token_ids: tuple[int, ...] = field(UIntList(hi=TOKEN_ID_MAX, min_len=1), doc="prompt")
    output_token_ids: tuple[int, ...] = field(TOKEN_IDS, default=(), doc="already streamed")
    handoff_mode: str | None = field(
        HANDOFF_OVERRIDE, default=None, doc="override the cluster's handoff policy for this request"
    )

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        _check_sampling("SUBMIT", v)
        _require(
            len(v["output_token_ids"]) < v["max_tokens"],
            f"SUBMIT output_token_ids has {len(v['output_token_ids'])} tokens but max_tokens is "
            f"{v['max_tokens']}: nothing left to generate",
        )


@dataclass(frozen=True, kw_only=True)
class Cancel(Message):
    """Router -> P, RLD, MD (client went away), or P -> MD (singular-traffic filter: the WAN
    copy is not needed): stop the request and free everything it holds. Between the decode
    tiers: RLD -> MD (RLD finished the request: MD's copy is not needed), MD -> RLD (MD failed
    its copy: before the cut RLD finishes the request alone, as when MD is lost)."""

    TYPE = MessageType.CANCEL
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    reason: str = field(REASON, doc="e.g. 'client disconnected'")


@dataclass(frozen=True, kw_only=True)
class TokenEvent(Message):
    """RLD or MD -> router: consecutive output tokens starting at `index`, as produced. The router
    places them by index, so each index reaches the client once and in order."""

    TYPE = MessageType.TOKEN_EVENT
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    index: int = field(COUNT, doc="output index of token_ids[0]")
    token_ids: tuple[int, ...] = field(
        UIntList(hi=TOKEN_ID_MAX, min_len=1), doc="the tokens, in index order"
    )
    producer: str = field(Str(max_len=16, choices=PRODUCERS), doc="who computed the tokens")
    time: float = field(TIME, doc="when they were produced (producer's clock)")
    logprobs: tuple[float, ...] = field(
        FloatList(LOGPROB_MIN, 0.0, MAX_LOGPROB_TOKENS),
        default=(),
        doc="per token its raw logprob ([] = not requested)",
    )
    top_logprob_ids: tuple[int, ...] = field(
        UIntList(hi=TOKEN_ID_MAX, max_len=MAX_TOP_LOGPROBS * MAX_LOGPROB_TOKENS),
        default=(),
        doc="k per token, token after token: the top-k ids",
    )
    top_logprobs: tuple[float, ...] = field(
        FloatList(LOGPROB_MIN, 0.0, MAX_TOP_LOGPROBS * MAX_LOGPROB_TOKENS),
        default=(),
        doc="their logprobs, same layout",
    )

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        n, lps, top = len(v["token_ids"]), v["logprobs"], v["top_logprob_ids"]
        _require(
            not lps or len(lps) == n, f"TOKEN_EVENT carries {len(lps)} logprobs for {n} tokens"
        )
        _require(
            len(v["top_logprobs"]) == len(top),
            f"TOKEN_EVENT has {len(top)} top_logprob_ids but {len(v['top_logprobs'])} top_logprobs",
        )
        _require(
            not top or (lps and len(top) % n == 0 and len(top) // n <= MAX_TOP_LOGPROBS),
            f"TOKEN_EVENT top logprobs ({len(top)}) must be k per token (k <= "
            f"{MAX_TOP_LOGPROBS}) for its {n} tokens, with their logprobs",
        )


@dataclass(frozen=True, kw_only=True)
class RequestDone(Message):
    """The instance that produced the last token -> router (and -> the other tier holding the
    request's KV, which then frees it): the request is over."""

    TYPE = MessageType.REQUEST_DONE
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    reason: str = field(Str(max_len=16, choices=DONE_REASONS), doc="why it ended")
    num_prompt_tokens: int = field(COUNT, doc="prompt length")
    num_output_tokens: int = field(COUNT, doc="index of the last token + 1")
    producer: str = field(Str(max_len=16, choices=PRODUCERS), doc="who made the last token")
    time: float = field(TIME, doc="when it ended (sender's clock)")


@dataclass(frozen=True, kw_only=True)
class Timeline(Message):
    """P, RLD or MD -> router on the events lane: one milestone of a request, for the `pdd`
    object's timeline (prefill_start, prefill_end, rld_kv_complete, md_kv_complete,
    handoff_start, handoff_end, first_md_token, wan_kv_sent, ...). `detail_int` / `detail_str`
    carry the milestone's figure or label, e.g. wan_kv_bytes or the handoff mode."""

    TYPE = MessageType.TIMELINE
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    event: str = field(Str(max_len=64, pattern=CODE_PATTERN), doc="snake_case milestone name")
    time: float = field(TIME, doc="when it happened (sender's clock)")
    producer: str = field(Str(max_len=16, choices=PRODUCERS), doc="who reports it")
    detail_int: int | None = field(
        Nullable(UInt(0, U64_MAX)), default=None, doc="a count or size, e.g. bytes or tokens"
    )
    detail_str: str = field(
        Str(max_len=2048),
        default="",
        doc="a label, e.g. the handoff mode or the pipeline",
    )


@dataclass(frozen=True, kw_only=True)
class PipelineChoice(Message):
    """P -> router on the events lane: the pipeline P chose for a request and every input of
    the choice (pddnet.policy.pipeline), for the `pdd` object's `pipeline_decision`."""

    TYPE = MessageType.PIPELINE_CHOICE
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    pipeline: str = field(Str(max_len=32, pattern=PIPELINE_PATTERN), doc="p_md, p_rld_md, p_rld")
    reason: str = field(REASON, doc="why, in words (which rule, or which link was down)")
    wan_transfer_s: float = field(Float(0.0), doc="when MD would hold the KV")
    incremental_bytes: int = field(UInt(0, U64_MAX), doc="KV bytes MD does not hold")
    prompt_tokens: int = field(COUNT, doc="the prompt's length")
    hit_tokens: int = field(COUNT, doc="P's view of MD's prefix hit")
    max_tokens: int = field(COUNT, doc="the request's max_tokens")
    kv_bytes_per_token: int = field(UInt(0, U64_MAX), doc="KV bytes per token on the wire")
    bandwidth_bps: float = field(Float(0.0), doc="estimated WAN goodput, bytes/s")
    rtt_s: float = field(Float(0.0), doc="estimated WAN round trip")
    rld_s_per_token: float = field(Float(0.0), doc="RLD's estimated time per output token")
    rld_admits: bool = field(Bool(), doc="RLD's admission answer (or P's view of it)")
    wan_backlog_bytes: int = field(UInt(0, U64_MAX), doc="P's unacknowledged bytes towards MD")
    predicted_hit: int = field(COUNT, doc="the hit P's view of MD's cache predicted")
    view_stale: bool = field(Bool(), doc="that view was older than its freshness bound")
    time: float = field(TIME, doc="when P chose (sender's clock)")


@dataclass(frozen=True, kw_only=True)
class PipelineChange(Message):
    """P -> router on the events lane: a request's pipeline changed after the decision (MD's
    answer, RLD's refusal, a lost peer), and why."""

    TYPE = MessageType.PIPELINE_CHANGE
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    pipeline: str = field(Str(max_len=32, pattern=PIPELINE_PATTERN), doc="the new pipeline")
    reason: str = field(REASON, doc="why it changed")
    time: float = field(TIME, doc="when it changed (sender's clock)")


# ---------------------------------------------------------------------------------------------
# KV transfer
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KvAllocRequest(SamplingFields, Message):
    """P -> RLD (local socket) and P -> MD (WAN control lane): reserve blocks for a request's KV.

    The receiver matches `prompt_token_ids` against its prefix cache, pins the hit and allocates
    blocks for the rest. It also keeps the sampling fields: it is the one that decodes.
    """

    TYPE = MessageType.KV_ALLOC_REQUEST
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    prompt_token_ids: tuple[int, ...] = field(
        UIntList(hi=TOKEN_ID_MAX, min_len=1),
        doc="the whole prompt (the receiver matches its cache)",
    )
    num_tokens: int = field(UInt(1, MAX_TOKEN_LIST), doc="KV positions P will deliver (= prompt)")
    block_size: int = field(UInt(1, 1 << 16), doc="P's block size (receiver may differ)")
    dtype: str = field(DTYPE, doc="dtype of the KV P sends")
    num_layers: int = field(UInt(1, 1024), doc="model shape, checked by the receiver")
    num_kv_heads: int = field(UInt(1, 1024), doc="model shape")
    head_dim: int = field(UInt(1, 1 << 14), doc="model shape")
    expected_hit_tokens: int = field(COUNT, doc="P's view of the receiver's prefix hit")
    pipeline: str = field(
        Str(max_len=32, pattern=PIPELINE_PATTERN),
        default="pdd",
        doc="P's pipeline choice, e.g. p_md, p_rld_md (recorded only)",
    )
    handoff_mode: str | None = field(
        HANDOFF_OVERRIDE,
        default=None,
        doc="the request's handoff-policy override (from SUBMIT); null = the cluster's policy",
    )

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        _check_sampling("KV_ALLOC_REQUEST", v)
        n = len(v["prompt_token_ids"])
        _require(
            v["num_tokens"] == n,
            f"KV_ALLOC_REQUEST num_tokens is {v['num_tokens']} but prompt_token_ids has {n}",
        )
        _require(
            v["expected_hit_tokens"] <= n,
            f"KV_ALLOC_REQUEST expected_hit_tokens {v['expected_hit_tokens']} exceeds the "
            f"{n} prompt tokens",
        )


@dataclass(frozen=True, kw_only=True)
class KvAllocResponse(Message):
    """RLD / MD -> P: the receiver's (authoritative) answer to KV_ALLOC_REQUEST.

    block_ids is the receiver's block table for positions [0, num_tokens) at *its* block size:
    block_ids[i] holds positions [i*block_size, (i+1)*block_size). P sends (or, for RLD's shared
    memory region, writes) only positions >= hit_tokens.
    """

    TYPE = MessageType.KV_ALLOC_RESPONSE
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    accepted: bool = field(Bool(), doc="false: no blocks reserved, see error")
    hit_tokens: int = field(COUNT, doc="prefix tokens the receiver already holds (pinned)")
    block_ids: tuple[int, ...] = field(
        UIntList(hi=U32_MAX, max_len=MAX_BLOCK_LIST),
        doc="receiver's block table for [0, num_tokens)",
    )
    block_size: int = field(UInt(1, 1 << 16), doc="receiver's block size")
    dtype: str = field(DTYPE, doc="receiver's KV dtype (it converts on arrival)")
    region: str = field(
        Str(max_len=128),
        default="",
        doc="RLD: its shared-memory pool name for one-sided writes; MD: ''",
    )
    error: str = field(REASON, default="", doc="why not accepted ('' when accepted)")
    step_s: float = field(
        Float(0.0, 3600.0),
        default=0.0,
        doc="receiver's recent decode seconds per output token (0 = unknown)",
    )

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        if v["accepted"]:
            _require(v["error"] == "", "KV_ALLOC_RESPONSE is accepted but carries an error")
            _require(
                v["hit_tokens"] <= len(v["block_ids"]) * v["block_size"],
                f"KV_ALLOC_RESPONSE hit_tokens {v['hit_tokens']} exceeds its "
                f"{len(v['block_ids'])} blocks of {v['block_size']}",
            )
        else:
            _require(v["error"] != "", "KV_ALLOC_RESPONSE refuses without an error")
            _require(not v["block_ids"], "KV_ALLOC_RESPONSE refuses but lists block_ids")


@dataclass(frozen=True, kw_only=True)
class KvChunk(Message):
    """P -> MD on a WAN bulk lane: the KV of positions [token_start, token_end) for layers
    [layer_start, layer_end). Payload layout [layers, 2, tokens, kv_heads, head_dim], C order.

    Chunks of one request may arrive in any order over parallel lanes; `chunk_index` numbers
    them and KV_DONE says how many there are. `block_ids` are the receiver's blocks the chunk
    touches (from KV_ALLOC_RESPONSE), so the receiver can bounds-check them against the request.
    """

    TYPE = MessageType.KV_CHUNK
    HAS_PAYLOAD = True
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    chunk_index: int = field(COUNT, doc="0, 1, ... per request (any arrival order)")
    token_start: int = field(COUNT, doc="first position carried")
    token_end: int = field(COUNT, doc="one past the last position")
    layer_start: int = field(UInt(0, 1024), doc="first layer carried")
    layer_end: int = field(UInt(1, 1024), doc="one past the last layer")
    block_ids: tuple[int, ...] = field(
        UIntList(hi=U32_MAX, max_len=MAX_BLOCK_LIST),
        default=(),
        doc="receiver blocks touched (for its bounds check)",
    )
    dtype: str = field(DTYPE, doc="element type of the payload")
    shape: tuple[int, ...] = field(
        UIntList(hi=U32_MAX, min_len=5, max_len=5), doc="[layers, 2, tokens, kv_heads, head_dim]"
    )
    payload: memoryview = dataclasses.field(compare=True)  # bytes-like; kept as a flat view

    def __post_init__(self) -> None:
        object.__setattr__(self, "payload", as_payload(self.payload))
        super().__post_init__()
        need = self.expected_payload_len(vars(self))
        if len(self.payload) != need:
            raise PayloadError(payload_mismatch(self.payload.nbytes, self.dtype, self.shape, need))

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        _require(
            v["token_end"] > v["token_start"],
            f"KV_CHUNK token range [{v['token_start']}, {v['token_end']}) is empty",
        )
        _require(
            v["layer_end"] > v["layer_start"],
            f"KV_CHUNK layer range [{v['layer_start']}, {v['layer_end']}) is empty",
        )
        layers, kv, tokens, heads, dim = v["shape"]
        want = (v["layer_end"] - v["layer_start"], 2, v["token_end"] - v["token_start"])
        _require(
            (layers, kv, tokens) == want and heads > 0 and dim > 0,
            f"KV_CHUNK shape {list(v['shape'])} does not match layers x K/V x tokens "
            f"{list(want)} x kv_heads x head_dim",
        )

    @classmethod
    def expected_payload_len(cls, values: Mapping[str, object]) -> int:
        return math.prod(values["shape"]) * DTYPES[values["dtype"]]  # type: ignore[arg-type, index]

    def array(self) -> Any:
        """The payload as a numpy array (shares memory). bfloat16 has no numpy dtype: use tensor()."""
        return array_from_payload(self.payload, self.dtype, self.shape)

    def tensor(self) -> Any:
        """The payload as a torch tensor (shares memory when the payload is writable)."""
        return tensor_from_payload(self.payload, self.dtype, self.shape)


@dataclass(frozen=True, kw_only=True)
class KvDone(Message):
    """P -> RLD / MD on the control connection: all of the request's KV has been sent.

    For RLD this is the completion of P's one-sided writes into its shared memory
    (num_chunks = 0). For MD it may overtake chunks still on bulk lanes: MD's copy is complete
    when it has received `num_chunks` chunks totalling `num_bytes` payload bytes.
    """

    TYPE = MessageType.KV_DONE
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    num_tokens: int = field(UInt(1, MAX_TOKEN_LIST), doc="KV now covers positions [0, num_tokens)")
    num_chunks: int = field(COUNT, doc="KV_CHUNK frames sent (0 over shared memory)")
    num_bytes: int = field(UInt(0, U64_MAX), doc="KV payload bytes sent or written")
    first_token_id: int = field(UInt(0, TOKEN_ID_MAX), doc="output index 0, sampled by P")
    time: float = field(TIME, doc="when P finished sending")
    first_logprob: float | None = field(
        Nullable(Float(LOGPROB_MIN, 0.0)),
        default=None,
        doc="its raw logprob, when the request asks for them",
    )
    first_top_ids: tuple[int, ...] = field(
        UIntList(hi=TOKEN_ID_MAX, max_len=MAX_TOP_LOGPROBS),
        default=(),
        doc="the top-k token ids at index 0",
    )
    first_top_logprobs: tuple[float, ...] = field(
        FloatList(LOGPROB_MIN, 0.0, MAX_TOP_LOGPROBS), default=(), doc="their logprobs"
    )

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        top = v["first_top_ids"]
        _require(
            len(v["first_top_logprobs"]) == len(top),
            f"KV_DONE has {len(top)} first_top_ids but {len(v['first_top_logprobs'])} "
            f"first_top_logprobs",
        )
        _require(
            not top or v["first_logprob"] is not None,
            "KV_DONE carries top logprobs without first_logprob",
        )


@dataclass(frozen=True, kw_only=True)
class KvAbort(Message):
    """P -> RLD / MD, or RLD / MD -> P: the transfer is abandoned (failure, deadline, or the
    singular-traffic filter); the receiver frees the request's blocks and pins."""

    TYPE = MessageType.KV_ABORT
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    reason: str = field(REASON, doc="why, e.g. 'deadline', 'singular traffic'")


@dataclass(frozen=True, kw_only=True)
class CacheEvents(Message):
    """MD -> P on the control connection, sent along with MD's other frames: what MD's radix
    cache inserted and evicted since the last notice, as chained hashes of full blocks at MD's
    block size. `seq` increases by one per notice; a gap tells P its view is stale (resync)."""

    TYPE = MessageType.CACHE_EVENTS
    seq: int = field(UInt(0, U64_MAX), doc="notice number, +1 each time")
    block_size: int = field(UInt(1, 1 << 16), doc="MD's block size (hash granularity)")
    inserted: tuple[int, ...] = field(
        UIntList(hi=U64_MAX, max_len=MAX_BLOCK_LIST), doc="chained block hashes now cached"
    )
    evicted: tuple[int, ...] = field(
        UIntList(hi=U64_MAX, max_len=MAX_BLOCK_LIST), doc="chained block hashes dropped"
    )
    reset: bool = field(
        Bool(),
        default=False,
        doc="true: `inserted` is MD's whole cache (a snapshot); P replaces its view",
    )


@dataclass(frozen=True, kw_only=True)
class KvReceived(Message):
    """MD -> P on the control connection: MD's copy of a request's KV is complete. It carries
    what P's bandwidth estimator needs, measured on MD's clock only (no clock sync): the bytes
    that arrived after the first chunk and the time between the first and the last chunk."""

    TYPE = MessageType.KV_RECEIVED
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    num_bytes: int = field(UInt(0, U64_MAX), doc="KV payload bytes received")
    span_bytes: int = field(UInt(0, U64_MAX), doc="bytes received after the first chunk")
    span_s: float = field(Float(0.0, 86400.0), doc="seconds from the first to the last chunk")


# ---------------------------------------------------------------------------------------------
# RLD <-> MD handoff by token ids
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RelayTokens(Message):
    """RLD -> MD while MD's copy is still crossing: the eager tokens RLD has produced so far.

    Advisory only (the binding cut is HANDOFF): it lets MD extend tokens early and, if RLD dies,
    hold the tokens it needs for a replay without asking the router.
    """

    TYPE = MessageType.RELAY_TOKENS
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    start_index: int = field(COUNT, doc="output index of token_ids[0]")
    token_ids: tuple[int, ...] = field(
        UIntList(hi=TOKEN_ID_MAX, min_len=1), doc="tokens RLD produced, in index order"
    )


@dataclass(frozen=True, kw_only=True)
class Takeover(Message):
    """MD -> RLD: MD holds the request's whole KV and asks RLD to hand over."""

    TYPE = MessageType.TAKEOVER
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    ready_position: int = field(COUNT, doc="MD holds KV for positions [0, ready_position)")
    chunk_tokens: int = field(UInt(1, MAX_TOKEN_LIST), doc="most tokens MD extends per step")


@dataclass(frozen=True, kw_only=True)
class Handoff(Message):
    """RLD -> MD: RLD's cut, by token ids. One-shot: a single message with final=True.
    Streaming: several with final=False while RLD keeps decoding, then one final=True. After
    the final message RLD produces nothing more for the request; MD continues at
    start_index + len(token_ids)."""

    TYPE = MessageType.HANDOFF
    request_id: str = field(REQUEST_ID, doc="the router's request id")
    start_index: int = field(COUNT, doc="output index of token_ids[0]")
    token_ids: tuple[int, ...] = field(
        TOKEN_IDS, doc="RLD's tokens MD must extend (may be empty if final)"
    )
    final: bool = field(Bool(), doc="the cut: RLD stops after this")
    mode: str = field(
        Str(max_len=16, choices=HANDOFF_MODES), doc="RLD's handoff mode for the request"
    )

    @classmethod
    def _cross_check(cls, v: Mapping[str, Any]) -> None:
        _require(
            v["final"] or len(v["token_ids"]) > 0,
            "HANDOFF that is not final must carry at least one token",
        )
        _require(
            v["final"] or v["mode"] == "streaming",
            "one-shot HANDOFF must be a single final message",
        )


# ---------------------------------------------------------------------------------------------
# Registry and payload helpers
# ---------------------------------------------------------------------------------------------

MESSAGE_CLASSES: dict[int, type[Message]] = {
    cls.TYPE.value: cls
    for cls in (
        Hello,
        Auth,
        AuthOk,
        AuthFail,
        Ping,
        Pong,
        ErrorMessage,
        LinkState,
        Submit,
        Cancel,
        TokenEvent,
        RequestDone,
        Timeline,
        PipelineChoice,
        PipelineChange,
        KvAllocRequest,
        KvAllocResponse,
        KvChunk,
        KvDone,
        KvAbort,
        CacheEvents,
        KvReceived,
        RelayTokens,
        Takeover,
        Handoff,
    )
}
assert set(MESSAGE_CLASSES) == {t.value for t in MessageType}, "every type code needs a class"


def message_class(code: int) -> type[Message] | None:
    return MESSAGE_CLASSES.get(code)


def payload_mismatch(got: int, dtype: str, shape: tuple[int, ...], need: int) -> str:
    return f"KV_CHUNK payload is {got} bytes but dtype {dtype} shape {list(shape)} needs {need}"


def as_payload(obj: object) -> memoryview:
    """A flat byte view of bytes, bytearray, memoryview or a C-contiguous numpy array (no copy)."""
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        raise PayloadError(
            f"payload must be a bytes-like object or numpy array, got {type(obj).__name__} "
            "(for a torch tensor use payload_from_tensor)"
        ) from None
    if not view.c_contiguous:
        raise PayloadError("payload must be C-contiguous (call .copy() / .contiguous() first)")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def payload_from_array(array: Any) -> tuple[memoryview, str, tuple[int, ...]]:
    """(payload, dtype name, shape) for a numpy array, without copying it."""
    name = str(array.dtype)
    if name not in DTYPES:
        raise PayloadError(f"numpy dtype {name} is not a wire dtype ({', '.join(DTYPES)})")
    return as_payload(array), name, tuple(int(d) for d in array.shape)


def payload_from_tensor(tensor: Any) -> tuple[memoryview, str, tuple[int, ...]]:
    """(payload, dtype name, shape) for a CPU torch tensor; copies only if not contiguous."""
    import torch  # lazily: the codec itself never needs torch

    name = str(tensor.dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise PayloadError(f"torch dtype {name} is not a wire dtype ({', '.join(DTYPES)})")
    t = tensor.detach().contiguous()
    shape = tuple(int(d) for d in t.shape)
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: ship its 16-bit pattern
        t = t.view(torch.int16)
    return as_payload(t.numpy()), name, shape


def array_from_payload(payload: memoryview | bytes, dtype: str, shape: tuple[int, ...]) -> Any:
    import numpy as np

    if dtype == "bfloat16":
        raise PayloadError("numpy has no bfloat16; use tensor_from_payload for bfloat16 KV")
    return np.frombuffer(payload, dtype=np.dtype(dtype)).reshape(shape)


def tensor_from_payload(payload: memoryview | bytes, dtype: str, shape: tuple[int, ...]) -> Any:
    import torch

    dtype_itemsize(dtype)
    view = memoryview(payload)
    if view.readonly:  # torch.frombuffer wants a writable buffer; copy once rather than warn
        view = memoryview(bytearray(view))
    if view.nbytes == 0:
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.frombuffer(view, dtype=getattr(torch, dtype)).reshape(shape)
