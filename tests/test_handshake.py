"""The sans-IO HELLO/AUTH state machine: no sockets, messages in, messages out."""

from __future__ import annotations

import pytest

from pddnet.protocol import (
    Auth,
    AuthFail,
    AuthOk,
    ErrorMessage,
    Hello,
    Ping,
    decode_bytes,
    encode_bytes,
)
from pddnet.protocol.handshake import (
    Handshake,
    HandshakeFailed,
    NonceCache,
    Side,
    State,
    compute_mac,
    transcript,
)

SECRET = b"s3cret"


def pair(
    connector_secret: bytes = SECRET,
    acceptor_secret: bytes = SECRET,
    cache=None,
    lane: str = "bulk",
    **acceptor_kw,
):
    c = Handshake(
        Side.CONNECTOR, role="prefill", instance_id="p-0", secret=connector_secret, lane=lane
    )
    a = Handshake(
        Side.ACCEPTOR,
        role="main_decode",
        instance_id="md-0",
        secret=acceptor_secret,
        nonce_cache=cache,
        **acceptor_kw,
    )
    return c, a


def wire(msgs):
    """Every message crosses as real bytes, as on a socket."""
    return [decode_bytes(encode_bytes(m)) for m in msgs]


def run(c: Handshake, a: Handshake):
    """Drive both sides to the end; return the transcript of messages exchanged."""
    log = []
    to_a = wire(c.start())
    assert a.start() == []
    while to_a:
        log += to_a
        to_c = []
        for m in to_a:
            to_c += wire(a.receive(m, now=1.0))
        log += to_c
        to_a = []
        for m in to_c:
            to_a += wire(c.receive(m))
    return log


def test_successful_handshake_both_sides_done_and_lane_agreed():
    c, a = pair()
    log = run(c, a)
    assert [type(m) for m in log] == [Hello, Hello, Auth, AuthOk]
    assert c.done and a.done
    assert c.peer_hello.role == "main_decode" and a.peer_hello.instance_id == "p-0"
    assert a.peer_hello.lane == "bulk" and c.peer_hello.lane == "bulk"  # the acceptor echoes
    assert c.hello.nonce != a.hello.nonce and len(c.hello.nonce) == 32


def hellos_crossed(**pair_options):
    """A started pair (`pair`'s options) whose HELLOs have crossed: the connector, the acceptor
    and what the connector answered (its AUTH)."""
    c, a = pair(**pair_options)
    c.start()
    a.start()
    hello_back = a.receive(c.hello)
    return c, a, c.receive(hello_back[0])


def test_wrong_secret_gets_auth_fail():
    c, a, auth = hellos_crossed(connector_secret=b"other")
    with pytest.raises(HandshakeFailed, match="bad AUTH mac") as exc:
        a.receive(auth[0])
    assert a.state is State.FAILED and not a.done
    assert [type(m) for m in exc.value.reply] == [AuthFail]
    # The connector learns the reason from AUTH_FAIL.
    with pytest.raises(HandshakeFailed, match="peer refused the handshake: bad AUTH mac"):
        c.receive(exc.value.reply[0])


def test_impostor_acceptor_is_detected_by_the_connector():
    c, a, auth = hellos_crossed(acceptor_secret=b"impostor")
    # The impostor cannot produce mac_a; fake an AUTH_OK with its own key.
    fake = AuthOk(mac=compute_mac(b"impostor", Side.ACCEPTOR, c.hello, a.hello))
    with pytest.raises(HandshakeFailed, match="AUTH_OK mac is wrong"):
        c.receive(fake)
    assert not c.done and auth


def test_replayed_auth_fails_against_a_fresh_acceptor_nonce():
    c, a = pair()
    run(c, a)
    recorded_hello, recorded_auth = (
        c.hello,
        Auth(mac=compute_mac(SECRET, Side.CONNECTOR, c.hello, a.hello)),
    )
    # Without a replay cache the fresh acceptor nonce alone defeats the replay.
    _, a2 = pair()
    a2.start()
    a2.receive(recorded_hello)
    with pytest.raises(HandshakeFailed, match="bad AUTH mac"):
        a2.receive(recorded_auth)


def test_replayed_hello_refused_by_the_nonce_cache():
    cache = NonceCache()
    c, a = pair(cache=cache)
    run(c, a)
    _, a2 = pair(cache=cache)
    a2.start()
    with pytest.raises(HandshakeFailed, match="replayed handshake") as exc:
        a2.receive(c.hello, now=2.0)
    assert isinstance(exc.value.reply[0], AuthFail)


def test_nonce_cache_ttl_and_capacity():
    cache = NonceCache(capacity=2, ttl=10.0)
    assert cache.check_and_remember(b"a" * 16, 0.0)
    assert not cache.check_and_remember(b"a" * 16, 5.0)
    assert cache.check_and_remember(b"a" * 16, 10.5)  # expired, fresh again
    assert cache.check_and_remember(b"b" * 16, 11.0)
    assert cache.check_and_remember(b"c" * 16, 11.0)
    assert len(cache) == 2  # bounded: the oldest was forgotten
    with pytest.raises(ValueError):
        NonceCache(capacity=0)


def test_reflected_nonce_refused():
    _, a = pair()
    a.start()
    mirror = Hello(role="prefill", instance_id="evil", nonce=a.hello.nonce)
    with pytest.raises(HandshakeFailed, match="reflects our own nonce"):
        a.receive(mirror)


@pytest.mark.parametrize("stage", ["hello", "auth"])
def test_any_other_message_before_authentication_fails_unprocessed(stage):
    c, a = pair()
    a.start()
    c.start()
    if stage == "auth":
        a.receive(c.hello)
    with pytest.raises(HandshakeFailed, match="PING received before authentication") as exc:
        a.receive(Ping(nonce=1, time=0.0))
    assert exc.value.code == "unauthenticated"
    reply = exc.value.reply[0]
    assert isinstance(reply, ErrorMessage) and reply.fatal and reply.code == "unauthenticated"


def test_role_allow_list():
    c, a = pair(allowed_peer_roles={"router"})
    a.start()
    c.start()
    with pytest.raises(HandshakeFailed, match="role 'prefill' may not connect"):
        a.receive(c.hello)


def test_macs_differ_by_direction_and_by_every_hello_field():
    c = Hello(role="prefill", instance_id="p", nonce=b"1" * 16, lane="control")
    a = Hello(role="relay", instance_id="r", nonce=b"2" * 16, lane="control")
    base = compute_mac(SECRET, Side.CONNECTOR, c, a)
    assert base != compute_mac(SECRET, Side.ACCEPTOR, c, a)
    for changed in (
        Hello(role="router", instance_id="p", nonce=b"1" * 16, lane="control"),
        Hello(role="prefill", instance_id="q", nonce=b"1" * 16, lane="control"),
        Hello(role="prefill", instance_id="p", nonce=b"3" * 16, lane="control"),
        Hello(role="prefill", instance_id="p", nonce=b"1" * 16, lane="bulk"),
    ):
        assert compute_mac(SECRET, Side.CONNECTOR, changed, a) != base
    assert transcript(c, a) != transcript(a, c)


def test_misuse_is_a_clear_error():
    c, a = pair()
    with pytest.raises(RuntimeError, match="state start"):
        c.receive(Ping(nonce=1, time=0.0))
    c.start()
    with pytest.raises(RuntimeError, match="start\\(\\) called in state await_hello"):
        c.start()
    with pytest.raises(ValueError, match="non-empty"):
        Handshake(Side.CONNECTOR, role="prefill", instance_id="p", secret=b"")
    with pytest.raises(ValueError):
        Handshake("sideways", role="prefill", instance_id="p", secret=SECRET)
