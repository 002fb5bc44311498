"""The HELLO / AUTH handshake as a sans-IO state machine (messages in, messages out, time passed in).

    connector                                   acceptor
      HELLO(role, instance_id, nonce_c, lane) ─►
                                              ◄─ HELLO(role, instance_id, nonce_a, lane)
      AUTH(mac_c)                             ─►  verify mac_c (constant time)
                                              ◄─ AUTH_OK(mac_a)  or  AUTH_FAIL(reason)

mac_c = HMAC-SHA256(secret, b"pddnet-auth-v1|connector|" + transcript) and mac_a the same with
b"acceptor", where the transcript length-prefixes every field of both HELLOs (connector's first).
Both nonces are fresh, so a recorded AUTH is useless on a new connection; the acceptor also
remembers recently seen connector nonces (`NonceCache`) and refuses a replayed HELLO outright, so a
replay is named as such in the log instead of surfacing as a bad MAC.

Like h11, nothing here touches a socket or a clock: the shell feeds each received message to
`receive()`, sends what it returns, and closes the connection when it raises `HandshakeFailed`
(after sending the failure's `reply`, an AUTH_FAIL or a fatal ERROR). Until `done` is true the
peer's messages are only ever handshake messages; anything else fails the handshake unprocessed.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import os
import struct
from collections import OrderedDict
from collections.abc import Iterable

from pddnet.protocol import Auth, AuthFail, AuthOk, ErrorMessage, Hello, Message

LABEL = b"pddnet-auth-v1|"
NONCE_BYTES = 32


class Side(str, enum.Enum):
    CONNECTOR = "connector"
    ACCEPTOR = "acceptor"


class State(enum.Enum):
    START = "start"  # nothing sent or received yet
    AWAIT_HELLO = "await_hello"  # waiting for the peer's HELLO
    AWAIT_AUTH = "await_auth"  # acceptor: sent HELLO, waiting for AUTH
    AWAIT_AUTH_OK = "await_auth_ok"  # connector: sent AUTH, waiting for AUTH_OK
    DONE = "done"
    FAILED = "failed"


class HandshakeFailed(Exception):
    """The handshake cannot complete. `reason` is for the log; `reply` is what to send the peer
    before closing (AUTH_FAIL or a fatal ERROR), possibly empty; `code` is a snake_case tag."""

    def __init__(self, reason: str, *, code: str, reply: Iterable[Message] = ()) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code
        self.reply = list(reply)


class NonceCache:
    """Connector nonces an acceptor saw recently: a repeat within `ttl` seconds is a replay.

    Bounded in count (oldest forgotten first) so that a flood of handshakes cannot grow memory;
    forgetting is safe because the acceptor's own fresh nonce already defeats a replayed AUTH.
    """

    def __init__(self, capacity: int = 65536, ttl: float = 3600.0) -> None:
        if capacity < 1 or ttl <= 0:
            raise ValueError(f"NonceCache needs capacity >= 1 and ttl > 0, got {capacity}, {ttl}")
        self.capacity = capacity
        self.ttl = ttl
        self._seen: OrderedDict[bytes, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._seen)

    def check_and_remember(self, nonce: bytes, now: float) -> bool:
        """True if `nonce` is fresh (and remember it), False if it was seen within the ttl."""
        while self._seen:
            oldest, when = next(iter(self._seen.items()))
            if now - when < self.ttl:
                break
            del self._seen[oldest]
        if nonce in self._seen:
            return False
        self._seen[nonce] = now
        while len(self._seen) > self.capacity:
            self._seen.popitem(last=False)
        return True


def transcript(connector_hello: Hello, acceptor_hello: Hello) -> bytes:
    """Both HELLOs' fields, each length-prefixed (so no two different HELLO pairs collide)."""
    parts: list[bytes] = []
    for hello in (connector_hello, acceptor_hello):
        for f in Hello.schema():
            value = getattr(hello, f.name)
            data = value if isinstance(value, bytes) else str(value).encode()
            name = f.name.encode()
            parts += [struct.pack("!H", len(name)), name, struct.pack("!I", len(data)), data]
    return b"".join(parts)


def compute_mac(secret: bytes, side: Side, connector_hello: Hello, acceptor_hello: Hello) -> bytes:
    """HMAC-SHA256 proof for `side` (whose label keeps one direction's MAC from passing as the other's)."""
    message = LABEL + side.value.encode() + b"|" + transcript(connector_hello, acceptor_hello)
    return hmac.new(secret, message, hashlib.sha256).digest()


class Handshake:
    """One connection's handshake, for one side. Call `start()` once, then `receive()` per message."""

    def __init__(
        self,
        side: Side | str,
        *,
        role: str,
        instance_id: str,
        secret: bytes,
        lane: str = "control",
        nonce: bytes | None = None,
        nonce_cache: NonceCache | None = None,
        allowed_peer_roles: Iterable[str] | None = None,
    ) -> None:
        if not isinstance(secret, bytes | bytearray) or not secret:
            raise ValueError("the handshake secret must be non-empty bytes")
        self.side = Side(side)
        self.secret = bytes(secret)
        self.hello = Hello(
            role=role,
            instance_id=instance_id,
            nonce=nonce if nonce is not None else os.urandom(NONCE_BYTES),
            lane=lane,
        )
        self.nonce_cache = nonce_cache
        self.allowed_peer_roles = frozenset(allowed_peer_roles) if allowed_peer_roles else None
        self.state = State.START
        self.peer_hello: Hello | None = None
        self.failure: HandshakeFailed | None = None

    @property
    def done(self) -> bool:
        return self.state is State.DONE

    def start(self) -> list[Message]:
        """What to send first: the connector speaks first, the acceptor waits for its HELLO."""
        self._expect(State.START, "start")
        self.state = State.AWAIT_HELLO
        return [self.hello] if self.side is Side.CONNECTOR else []

    def receive(self, msg: Message, now: float = 0.0) -> list[Message]:
        """Feed one message from the peer; return what to send. Raises HandshakeFailed.

        `now` (seconds, any monotonic clock) is only used by the acceptor's replay cache.
        """
        if self.state in (State.DONE, State.FAILED, State.START):
            raise RuntimeError(f"Handshake.receive() called in state {self.state.value}")
        try:
            if isinstance(msg, ErrorMessage):  # the peer gave up on us: say why, send nothing
                raise HandshakeFailed(
                    f"peer reported {msg.code} during the handshake: {msg.message}", code=msg.code
                )
            if self.side is Side.CONNECTOR:
                return self._connector_receive(msg)
            return self._acceptor_receive(msg, now)
        except HandshakeFailed as exc:
            self.state = State.FAILED
            self.failure = exc
            raise

    # -- the two sides ------------------------------------------------------------------------
    def _connector_receive(self, msg: Message) -> list[Message]:
        if isinstance(msg, AuthFail):
            raise HandshakeFailed(f"peer refused the handshake: {msg.reason}", code="auth_failed")
        if self.state is State.AWAIT_HELLO:
            hello = self._peer_hello(msg)
            self.state = State.AWAIT_AUTH_OK
            return [Auth(mac=compute_mac(self.secret, Side.CONNECTOR, self.hello, hello))]
        if not isinstance(msg, AuthOk):
            raise self._out_of_order(msg, "AUTH_OK")
        assert self.peer_hello is not None
        want = compute_mac(self.secret, Side.ACCEPTOR, self.hello, self.peer_hello)
        if not hmac.compare_digest(msg.mac, want):
            # The acceptor does not know the secret (or is an impostor): we send nothing more.
            raise HandshakeFailed(
                "peer's AUTH_OK mac is wrong: it does not hold the cluster secret",
                code="auth_failed",
            )
        self.state = State.DONE
        return []

    def _acceptor_receive(self, msg: Message, now: float) -> list[Message]:
        if self.state is State.AWAIT_HELLO:
            hello = self._peer_hello(msg)
            if self.nonce_cache is not None and not self.nonce_cache.check_and_remember(
                hello.nonce, now
            ):
                raise self._refuse(
                    f"replayed handshake: nonce from {hello.role} "
                    f"{hello.instance_id!r} was already used"
                )
            self.state = State.AWAIT_AUTH
            return [self.hello]
        if not isinstance(msg, Auth):
            raise self._out_of_order(msg, "AUTH")
        assert self.peer_hello is not None
        want = compute_mac(self.secret, Side.CONNECTOR, self.peer_hello, self.hello)
        if not hmac.compare_digest(msg.mac, want):
            raise self._refuse(
                f"bad AUTH mac from {self.peer_hello.role} "
                f"{self.peer_hello.instance_id!r}: wrong secret or replayed AUTH"
            )
        self.state = State.DONE
        return [AuthOk(mac=compute_mac(self.secret, Side.ACCEPTOR, self.peer_hello, self.hello))]

    # -- helpers ------------------------------------------------------------------------------
    def _peer_hello(self, msg: Message) -> Hello:
        if not isinstance(msg, Hello):
            raise self._out_of_order(msg, "HELLO")
        if msg.nonce == self.hello.nonce:
            # Our own nonce reflected back: a peer echoing our HELLO is not a peer.
            raise self._refuse("peer's HELLO reflects our own nonce")
        if self.allowed_peer_roles is not None and msg.role not in self.allowed_peer_roles:
            raise self._refuse(
                f"role {msg.role!r} may not connect here (allowed: "
                f"{', '.join(sorted(self.allowed_peer_roles))})"
            )
        if self.side is Side.ACCEPTOR:
            # The connector chooses the lane; the acceptor's HELLO echoes it.
            self.hello = Hello(
                role=self.hello.role,
                instance_id=self.hello.instance_id,
                nonce=self.hello.nonce,
                lane=msg.lane,
            )
        elif msg.lane != self.hello.lane:
            raise HandshakeFailed(
                f"peer answered lane {msg.lane!r} to our {self.hello.lane!r}", code="bad_handshake"
            )
        self.peer_hello = msg
        return msg

    def _refuse(self, reason: str) -> HandshakeFailed:
        reply = [AuthFail(reason=reason)] if self.side is Side.ACCEPTOR else []
        return HandshakeFailed(reason, code="auth_failed", reply=reply)

    def _out_of_order(self, msg: Message, wanted: str) -> HandshakeFailed:
        reason = (
            f"{msg.TYPE.name} received before authentication (expected {wanted}); "
            "nothing is processed before the handshake completes"
        )
        return HandshakeFailed(
            reason,
            code="unauthenticated",
            reply=[
                ErrorMessage(request_id=None, code="unauthenticated", message=reason, fatal=True)
            ],
        )

    def _expect(self, state: State, what: str) -> None:
        if self.state is not state:
            raise RuntimeError(f"Handshake.{what}() called in state {self.state.value}")
