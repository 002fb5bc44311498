"""RLD's parking place for TAKEOVERs that overtook their request's allocation, sans-IO: the
timer it needs comes out as an ArmTimer action and goes back in as ``expire``."""

from __future__ import annotations

from collections import OrderedDict

from pddnet.lifecycle.actions import ArmTimer, CancelParked, DecodeAction
from pddnet.protocol import Takeover


class TakeoverHold:
    """RLD: TAKEOVERs that came before their request's KV_ALLOC_REQUEST (they come on different
    connections, and P's allocation may still wait for RLD's engine). Each is kept until the
    request is allocated (``claim``), or refused / ended first (``release``: CANCEL to MD, which
    must not wait for a cut), or its own timer expires: an allocation comes within a round trip
    or never. Answering CANCEL at once would turn a request RLD is about to take into one RLD
    decodes alone."""

    def __init__(self, ttl_s: float, limit: int) -> None:
        self.ttl_s = ttl_s
        self.limit = limit
        self._parked: OrderedDict[str, tuple[Takeover, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._parked)

    def __contains__(self, rid: object) -> bool:
        return rid in self._parked

    def park(self, msg: Takeover, now_s: float) -> list[DecodeAction]:
        rid = msg.request_id
        self._parked[rid] = (msg, now_s)
        self._parked.move_to_end(rid)
        out: list[DecodeAction] = [ArmTimer(rid, self.ttl_s, now_s)]
        while len(self._parked) > self.limit:
            out += self.release(next(iter(self._parked)), "relay never received the request")
        return out

    def claim(self, rid: str) -> Takeover | None:
        """The request was allocated: its parked TAKEOVER, to apply now."""
        entry = self._parked.pop(rid, None)
        return entry[0] if entry is not None else None

    def release(self, rid: str, reason: str) -> list[DecodeAction]:
        """The request will not be allocated here."""
        if self._parked.pop(rid, None) is None:
            return []
        return [CancelParked(rid, reason)]

    def release_all(self, reason: str) -> list[DecodeAction]:
        out: list[DecodeAction] = []
        for rid in list(self._parked):
            out += self.release(rid, reason)
        return out

    def expire(self, rid: str, token: float) -> list[DecodeAction]:
        """An ArmTimer fired: release the TAKEOVER if it is still the one parked then."""
        entry = self._parked.get(rid)
        if entry is None or entry[1] != token:
            return []
        return self.release(rid, "relay never received the request")

    def forget_all(self) -> None:
        """MD is gone: nobody to answer."""
        self._parked.clear()
