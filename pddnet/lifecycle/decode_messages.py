"""The messages a decode tier sends for one request, built from its machine's actions: KV_RECEIVED
to P (MD), HANDOFF to MD (RLD), TAKEOVER to RLD (MD). Sans-IO; the daemon only posts them."""

from __future__ import annotations

from pddnet.lifecycle.actions import SendHandoff, SendKvReceived, SendTakeover
from pddnet.protocol import Handoff, KvReceived, Takeover


def kv_received(rid: str, a: SendKvReceived) -> KvReceived:
    """MD -> P: the whole copy arrived, with the span P estimates the WAN's goodput from."""
    return KvReceived(
        request_id=rid, num_bytes=a.num_bytes, span_bytes=a.span_bytes, span_s=a.span_s
    )


def handoff(rid: str, a: SendHandoff) -> Handoff:
    """RLD -> MD: the tokens RLD decoded from ``start_index`` on (``final``: the last ones)."""
    return Handoff(
        request_id=rid,
        start_index=a.start_index,
        token_ids=a.token_ids,
        final=a.final,
        mode=a.mode,
    )


def takeover(rid: str, a: SendTakeover) -> Takeover:
    """MD -> RLD: MD holds the KV and is ready to take the request over."""
    return Takeover(request_id=rid, ready_position=a.ready_position, chunk_tokens=a.chunk_tokens)
