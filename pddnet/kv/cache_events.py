"""The log of prefixes a cache inserted and evicted, drained into numbered notices.

MD's RadixCache notes every block it adopts or evicts by its chained hash
(pddnet/kv/block_hash.py); MD drains the log into CACHE_EVENTS notices so that P's view of
MD's cache (pddnet/policy/cache_view.py) follows it. Between two drains a hash inserted and
then evicted (or the reverse) is netted to its latest state. ``max_pending`` bounds the log:
past it the log resets and a notice number is skipped, so the receiver sees the gap and knows
its view is stale; 0 keeps no log, for a cache nobody watches (the simulated P's).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from itertools import compress
from typing import Any


@dataclass(frozen=True)
class CacheEventBatch:
    """Inserted / evicted prefixes since the last drain; field names match protocol CacheEvents
    (``CacheEvents(**dataclasses.asdict(batch))``). The two sets are disjoint (netted)."""

    seq: int
    block_size: int
    inserted: tuple[int, ...]
    evicted: tuple[int, ...]


class CacheEventLog:
    """Pending inserted / evicted hashes of one cache (at one block size) and their numbering."""

    def __init__(self, block_size: int, max_pending: int) -> None:
        if max_pending < 0:
            raise ValueError(f"max_pending_events must be >= 0, got {max_pending}")
        self.block_size = block_size
        self.max_pending = max_pending
        self._pending: dict[int, bool] = {}  # hash -> cached now? (netted per drain)
        self.next_seq = 0  # the number the next notice will carry (a snapshot's resync point)
        self.dropped = 0  # hashes forgotten because nobody drained

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def note_all(self, hashes: list[int], present: bool) -> None:
        """Log that these prefixes were inserted (``present``) or evicted, in order."""
        pending, cap = self._pending, self.max_pending
        if not cap:
            return  # no log kept
        objs: list[Any] = hashes  # (Any: compiled, an int variable would re-box each hash)
        for h in objs:
            pending.pop(h, None)  # re-append: drain order follows the latest change
            pending[h] = present
            if len(pending) > cap:
                # Nobody drains: forget the log and skip a notice number, so the receiver sees
                # a gap and knows its view is stale instead of silently missing events.
                self.dropped += len(pending)
                pending.clear()
                self.next_seq += 1

    def drain(self, max_hashes: int = 1 << 20) -> CacheEventBatch | None:
        """The next notice (at most ``max_hashes`` hashes), or None when nothing changed.
        Notices are numbered 0, 1, ...; a skipped number means events were dropped."""
        if not self._pending:
            return None
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be >= 1, got {max_hashes}")
        pending = self._pending
        if len(pending) <= max_hashes:
            hashes: list[Any] = list(pending)
            flags = list(pending.values())
            pending.clear()
        else:
            hashes = list(itertools.islice(pending, max_hashes))
            flags = [pending.pop(h) for h in hashes]
        seq = self.next_seq
        self.next_seq += 1
        # (C-level selection: the hash objects themselves, not re-boxed copies)
        return CacheEventBatch(
            seq,
            self.block_size,
            tuple(compress(hashes, flags)),
            tuple(compress(hashes, map(operator.not_, flags))),
        )
