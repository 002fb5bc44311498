"""MD's decode-side RadixCache (DRC) as P sees it: CACHE_EVENTS notices of what the tree inserted
and evicted, drained in the engine thread within calls MD makes anyway (reserve, import, stop)
and posted to every P just before MD's next frame to it; a new P connection first gets a
snapshot (reset=True)."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from pddnet.engine.engine import Engine
from pddnet.kv.hit_histogram import HIT_INTERVAL_LABELS
from pddnet.kv.radix import RadixCache
from pddnet.protocol import CacheEvents

from .outbox import Outbox


class CacheNotices:
    def __init__(self, engine: Callable[[], Engine | None]) -> None:
        self._engine = engine
        # CACHE_EVENTS drained in the engine thread, posted to every P from the event loop
        self._queue: deque[CacheEvents] = deque()

    @property
    def radix(self) -> RadixCache | None:
        engine = self._engine()
        cache = engine.prefix_cache if engine is not None else None
        return cache if isinstance(cache, RadixCache) else None

    def snapshot(self) -> CacheEvents:
        """In the engine thread: the whole tree; `seq` is the next incremental notice's number
        (events still pending are in the snapshot already and harmless to apply again)."""
        radix = self.radix
        assert radix is not None
        return CacheEvents(
            seq=radix.events.next_seq,
            block_size=radix.block_size,
            inserted=tuple(radix.snapshot_hashes()),
            evicted=(),
            reset=True,
        )

    def drain(self) -> None:
        """In the engine thread, inside a call MD makes anyway: queue what the tree did."""
        radix = self.radix
        if radix is None:
            return
        while (batch := radix.drain_events()) is not None:
            self._queue.append(
                CacheEvents(
                    seq=batch.seq,
                    block_size=batch.block_size,
                    inserted=batch.inserted,
                    evicted=batch.evicted,
                )
            )

    def post(self, boxes: Iterable[Outbox]) -> None:
        """Piggy-back the queued notices on the frame MD is about to send to P."""
        boxes = list(boxes)
        while self._queue:
            notice = self._queue.popleft()
            for box in boxes:
                box.post(notice)

    def stats(self) -> dict[str, Any] | None:
        radix = self.radix
        if radix is None:
            return None
        return {
            "lookups": radix.num_requests,
            "lookup_tokens": radix.tokens_asked,
            "hit_tokens": radix.tokens_hit,
            "hit_rate": round(radix.hit_rate, 6),
            "cached_blocks": radix.num_cached_blocks,
            "evictable_blocks": radix.num_evictable,
            "inserted_blocks": radix.num_inserted,
            "evicted_blocks": radix.num_evicted,
            "hit_intervals": dict(zip(HIT_INTERVAL_LABELS, radix.hit_histogram, strict=True)),
            "notices_sent": radix.events.next_seq,
            "events_dropped": radix.events.dropped,
        }
