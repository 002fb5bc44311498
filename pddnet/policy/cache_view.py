"""P's view of what MD's radix cache holds (sans-IO).

P needs MD's prefix hit *before* MD answers: to route a request and to choose its pipeline (the
incremental KV is (n - hit) tokens). MD tells P what its cache inserted and evicted in
CACHE_EVENTS notices piggy-backed on frames it sends anyway, as chained block hashes at MD's block
size (``pddnet.kv.block_hash.chained_hashes``); the hash of block i names the whole prefix up to
it, so the estimated hit of a prompt is its longest leading chain of hashes the view knows.

The view is only advice. MD's KV_ALLOC_RESPONSE is authoritative: P sends whatever MD lacks, and
``observe`` compares the answer with the prediction, counts a misprediction and repairs the view
(MD holds the first ``hit`` blocks of this prompt's chain and, when it stopped short of its match
limit, not the next one -- hence nothing deeper in that chain either).

Memory is bounded: at most ``max_hashes`` hashes, least recently used dropped first (a dropped
hash only makes the estimate lower; the next answer teaches it back). "Used" is what MD did, as
MD's own LRU sees it: a notice's inserts, and the prefix an answer says MD matched (and so
touched). A prediction is a pure query: it does not refresh anything (a request that RLD
finishes alone never reaches MD, so MD's tree does not see it either).

Recency is a counter stamped on the hashes, not a reordered list: a view holds about what MD
holds, so the cap is seldom reached, and stamping costs a dict store where relinking cost a list
splice in a dict of 10^5 entries (the simulator's largest single cost). One notice's inserts, or
one answer's matched prefix, share one stamp, as MD's tree gives a matched path one moment:
storing the same int object replaces per-hash int objects that each store had to create and
free. Among hashes of one stamp, the one the view learned last goes first: a chain is learned
root first, so its deepest blocks go first, as MD evicts leaves first, and what stays is still a
leading chain a prediction can use. The oldest are found, when the cap is passed, from a heap of
the stamps built then and used until it runs out.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import repeat, takewhile
from typing import Protocol

from pddnet.kv.block_hash import chained_hashes


class CacheEventsLike(Protocol):
    """protocol.messages.CacheEvents or kv.radix.CacheEventBatch."""

    # read-only members, so that frozen dataclasses (CacheEventBatch) match too
    @property
    def seq(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def inserted(self) -> tuple[int, ...]: ...
    @property
    def evicted(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class HitPrediction:
    """P's estimate of MD's hit for one prompt; hand it back to ``observe`` with MD's answer."""

    num_tokens: int
    hit_tokens: int
    hashes: tuple[int, ...]  # the prompt's chained hashes up to the match limit
    block_size: int
    stale: bool  # the view had missed notices when it predicted


@dataclass(frozen=True)
class Observation:
    """Outcome of comparing a prediction with MD's authoritative hit."""

    predicted_tokens: int
    actual_tokens: int

    @property
    def wrong(self) -> bool:
        return self.predicted_tokens != self.actual_tokens

    @property
    def error_tokens(self) -> int:
        """Signed: > 0 when P believed MD held more than it did (MD had evicted it)."""
        return self.predicted_tokens - self.actual_tokens


class DecodeCacheView:
    """Bounded LRU set of the chained block hashes MD is believed to hold."""

    def __init__(self, block_size: int | None = None, max_hashes: int = 1 << 16) -> None:
        if block_size is not None and block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if max_hashes < 1:
            raise ValueError(f"max_hashes must be >= 1, got {max_hashes}")
        self.block_size = block_size  # MD's; None until its first notice or answer
        self.max_hashes = max_hashes
        self._hashes: dict[int, int] = {}  # hash -> its use stamp (larger: more recent)
        self._clock = 0  # the last stamp given
        # (stamp, -position, hash) of entries, the next to drop first, as of when it was built:
        # see _drop_oldest
        self._oldest: list[tuple[int, int, int]] = []
        self.next_seq = 0
        self.stale = False
        # counters
        self.notices = 0
        self.gaps = 0
        self.duplicates = 0
        self.dropped_by_cap = 0
        self.predictions = 0
        self.wrong = 0
        self.over_predicted = 0  # P expected more than MD had (MD evicted it)
        self.under_predicted = 0  # MD had more than P knew (missed / capped notices)
        self.error_tokens = 0  # sum of |predicted - actual|
        self.max_error_tokens = 0

    # -- what MD says it did -----------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._hashes

    def apply(self, events: CacheEventsLike) -> bool:
        """Apply one CACHE_EVENTS notice; returns False for an old/duplicate notice (ignored).
        A notice whose seq skips ahead marks the view stale: notices were lost, so it may
        believe MD holds prefixes MD evicted (MD's answers will correct that) or miss some."""
        self._adopt_block_size(events.block_size)
        if events.seq < self.next_seq:
            self.duplicates += 1
            return False
        if events.seq > self.next_seq:
            self.gaps += 1
            self.stale = True
        self.next_seq = events.seq + 1
        self.notices += 1
        _consume(map(self._hashes.pop, events.evicted, repeat(None)))
        self._add(events.inserted)
        return True

    def resync(self, block_size: int, hashes: Iterable[int], next_seq: int) -> None:
        """Replace the view by a full snapshot of MD's cache (e.g. RadixCache.snapshot_hashes,
        taken when MD had sent notices up to ``next_seq - 1``); clears ``stale``."""
        self.block_size = None
        self._adopt_block_size(block_size)
        self._hashes.clear()
        self._oldest.clear()
        self._add(hashes)
        self.next_seq = next_seq
        self.stale = False

    # -- prediction and repair ------------------------------------------------------------------

    def predict(
        self, prompt_token_ids: Sequence[int], max_blocks: int | None = None
    ) -> HitPrediction:
        """Estimated MD hit for a prompt: its longest leading chain of known hashes. A pure
        query: the view does not change (``observe`` with MD's answer marks what MD touched).

        ``max_blocks`` defaults to MD's rule in ``Engine.reserve_kv``: never the block holding
        the prompt's last token (MD must compute that token itself for its logits)."""
        n = len(prompt_token_ids)
        if self.block_size is None or n == 0:
            return HitPrediction(n, 0, (), self.block_size or 0, self.stale)
        bs = self.block_size
        limit = (n - 1) // bs if max_blocks is None else max(0, min(max_blocks, n // bs))
        return self._predict(n, tuple(chained_hashes(prompt_token_ids[: limit * bs], bs)))

    def predict_from_hashes(
        self, num_tokens: int, hashes: Sequence[int], block_size: int, max_blocks: int | None = None
    ) -> HitPrediction:
        """``predict`` for a prompt of ``num_tokens`` tokens whose chained block hashes the
        caller already has (at least its full blocks up to the match limit, at ``block_size``,
        e.g. kept per conversation and extended turn by turn): the same prediction, without
        hashing the prompt again."""
        n = num_tokens
        if self.block_size is None or n == 0:
            return HitPrediction(n, 0, (), self.block_size or 0, self.stale)
        if block_size != self.block_size:
            raise ValueError(f"hashes at block size {block_size}, the view's is {self.block_size}")
        bs = self.block_size
        limit = (n - 1) // bs if max_blocks is None else max(0, min(max_blocks, n // bs))
        if len(hashes) < limit:
            raise ValueError(
                f"{len(hashes)} hashes for a {n}-token prompt: the prediction "
                f"needs its first {limit}"
            )
        return self._predict(n, tuple(hashes[:limit]))

    def _predict(self, n: int, hashes: tuple[int, ...]) -> HitPrediction:
        bs = self.block_size
        assert bs is not None, "callers adopted a block size first"
        # the leading run of known hashes (a C-speed loop); nothing is marked used
        hit = len(list(takewhile(self._hashes.__contains__, hashes)))
        return HitPrediction(n, hit * bs, hashes, bs, self.stale)

    def observe(
        self, prediction: HitPrediction, actual_hit_tokens: int, block_size: int | None = None
    ) -> Observation:
        """MD's authoritative answer for a predicted prompt: count, then repair the view."""
        if block_size is not None and block_size != prediction.block_size:
            # MD's block size differs from what the prediction was made with: nothing to
            # compare hash for hash. Adopt MD's size; count the answer, learn nothing else.
            self._adopt_block_size(block_size)
            self._count(prediction.hit_tokens, actual_hit_tokens)
            return Observation(prediction.hit_tokens, actual_hit_tokens)
        if not 0 <= actual_hit_tokens <= prediction.num_tokens:
            raise ValueError(f"MD's hit {actual_hit_tokens} outside 0..{prediction.num_tokens}")
        self._count(prediction.hit_tokens, actual_hit_tokens)
        if not prediction.block_size:
            return Observation(prediction.hit_tokens, actual_hit_tokens)
        held = min(actual_hit_tokens // prediction.block_size, len(prediction.hashes))
        self._add(prediction.hashes[:held])
        if held < len(prediction.hashes):
            # MD matched up to `held` blocks although it could have matched more: it lacks
            # block `held` of this chain, and so every deeper block of it.
            _consume(map(self._hashes.pop, prediction.hashes[held:], repeat(None)))
        return Observation(prediction.hit_tokens, actual_hit_tokens)

    @property
    def mispredict_rate(self) -> float:
        return self.wrong / self.predictions if self.predictions else 0.0

    def counters(self) -> dict[str, int | float | bool]:
        return {
            "hashes": len(self._hashes),
            "stale": self.stale,
            "notices": self.notices,
            "gaps": self.gaps,
            "duplicates": self.duplicates,
            "dropped_by_cap": self.dropped_by_cap,
            "predictions": self.predictions,
            "wrong": self.wrong,
            "over_predicted": self.over_predicted,
            "under_predicted": self.under_predicted,
            "error_tokens": self.error_tokens,
            "max_error_tokens": self.max_error_tokens,
            "mispredict_rate": round(self.mispredict_rate, 6),
        }

    # -- internals ------------------------------------------------------------------------------

    def _adopt_block_size(self, block_size: int) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if self.block_size is not None and block_size != self.block_size:
            # Hashes at another granularity name other prefixes: start over, and say so.
            self._hashes.clear()
            self._oldest.clear()
            self.stale = True
        self.block_size = block_size

    def _add(self, hashes: Iterable[int]) -> None:
        self._stamp(hashes if isinstance(hashes, (tuple, list)) else list(hashes))
        while len(self._hashes) > self.max_hashes:
            self._drop_oldest()
            self.dropped_by_cap += 1

    def _stamp(self, hashes: Sequence[int]) -> None:
        """The hashes become the most recent, together (one stamp), added if missing: one
        C-speed update."""
        c = self._clock + 1
        self._hashes.update(zip(hashes, repeat(c)))
        self._clock = c

    def _drop_oldest(self) -> None:
        """Forget the least recently used hash, of those with the oldest stamp the one learned
        last (the latest in the dict's insertion order). The heap holds every entry's stamp as
        of when it was built; an entry used (or dropped and re-added) since has a newer stamp
        than all of those, so the first valid heap item is the one to drop. Once the heap has no
        valid item left it is rebuilt: O(log n) a drop, amortised."""
        known, heap = self._hashes, self._oldest
        while True:
            if not heap:
                heap.extend((t, -i, h) for i, (h, t) in enumerate(known.items()))
                heapq.heapify(heap)
            t, _, h = heapq.heappop(heap)
            if known.get(h) == t:
                del known[h]
                return

    def _count(self, predicted: int, actual: int) -> None:
        self.predictions += 1
        if predicted != actual:
            self.wrong += 1
            err = abs(predicted - actual)
            self.error_tokens += err
            self.max_error_tokens = max(self.max_error_tokens, err)
            if predicted > actual:
                self.over_predicted += 1
            else:
                self.under_predicted += 1


def _consume(it: Iterable[object]) -> None:
    """Run an iterator to its end at C speed (for map() over a method)."""
    deque(it, maxlen=0)
