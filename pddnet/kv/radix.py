"""Decode-side RadixCache (DRC): a radix tree over token ids whose nodes own KV blocks.

MD keeps the KV of finished requests (prompt + generated tokens) so that the next turn of a
conversation only needs its *uncached* KV to cross the WAN. Why a radix tree here and not the
chained-hash PrefixCache: eviction must free only *leaves* (a block whose descendants stay cached
would leave them unreachable yet still holding memory), and the tree makes "leaf" explicit.

Granularity. Only FULL blocks are cached, so every edge spans a whole number of blocks and a node
splits only at block boundaries. Children are keyed by the tokens of their first block (by the
token itself when a block is one token).

Ownership (the same contract as PrefixCache, so the engine can use either):
- the tree holds ONE allocator reference on every block it owns; a block is owned by one node;
- a request using cached blocks holds its own allocator reference on them (``take``/``lock``),
  and drops it with ``release``/``unlock``; pins (``pin``) protect a prefix without a reference;
- a block is *locked* while a request references it (refcount > 1) or it is pinned. A block is
  *evictable* when neither it nor any block below it is locked: repeated leaf eviction can free
  it. ``num_available`` = free + evictable is what an allocation can get.
- eviction takes the least recently used leaf whose tail block is unlocked and frees its blocks
  tail first, one block at a time (the leaf may shrink and then vanish; its parent may become a
  leaf in turn).

Engine interface: ``match / acquisition_cost / acquire / take / pin / unpin / insert / release /
allocate / evict / clear`` with PrefixCache's signatures and ``PrefixMatch`` results, so
``BlockManager`` can hold a RadixCache in place of a PrefixCache. Native (SGLang-style) calls on
top: ``match_prefix`` -> (block_ids, hit_tokens, handle), ``lock``/``unlock`` of a handle,
``insert_finished`` (insert a finished request and drop its references; duplicates freed),
``evict`` returning the freed block ids, hit statistics and an event log of inserted / evicted
prefixes as chained block hashes (``pddnet.kv.prefix_cache.block_hashes``), drained into
CACHE_EVENTS notices for P's view (pddnet/policy/cache_view.py). ``max_pending_events`` bounds
that log (past it the log resets and a notice number is skipped); 0 keeps no log, for a cache
nobody watches (the simulated P's).
"""

from __future__ import annotations

import heapq
import itertools
import operator
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, groupby
from typing import Any, NamedTuple

import xxhash

from pddnet.kv.allocator import BlockAllocator, OutOfBlocks
from pddnet.kv.prefix_cache import PrefixMatch, hash_block

_PARENT = struct.Struct("<Q")
_PARENT_TOKEN = struct.Struct("<Qq")  # (parent hash, one token): a one-token block's bytes
_digest = xxhash.xxh3_64_intdigest


def chained_hashes(token_ids: Sequence[int], block_size: int, parent_hash: int = 0) -> list[int]:
    """``prefix_cache.block_hashes(token_ids, block_size, parent_hash)``, the same values,
    computed faster: the token ids are packed once and each block is one one-shot digest of
    (parent hash || block) -- xxh3 of a concatenation equals the streamed ``hash_block``."""
    full = len(token_ids) // block_size
    if full <= 0:
        return []
    out: list[Any] = []
    h: Any = parent_hash  # (Any: compiled, an int variable would re-box each hash)
    if block_size == 1:  # (the simulator's units: one pack and one digest a block)
        pair = _PARENT_TOKEN.pack
        tokens: Sequence[Any] = token_ids
        for t in tokens:
            h = _digest(pair(h, t))
            out.append(h)
        return out
    step = 8 * block_size
    buf = struct.pack(f"<{full * block_size}q", *token_ids[: full * block_size])
    pack = _PARENT.pack
    for off in range(0, full * step, step):
        h = _digest(pack(h) + buf[off : off + step])
        out.append(h)
    return out


# Per-request hit ratio histogram: the source report's seven intervals. The first is closed
# [0, 20%]; the others are (lo, hi], so the top one is exactly "hit more than 95%".
HIT_INTERVAL_EDGES: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 0.9, 0.95, 1.0)
HIT_INTERVAL_LABELS: tuple[str, ...] = (
    "0-20%",
    "20-40%",
    "40-60%",
    "60-80%",
    "80-90%",
    "90-95%",
    "95-100%",
)


def hit_interval(ratio: float) -> int:
    """Index (0..6) of the interval a hit ratio in [0, 1] falls in."""
    if not 0.0 <= ratio <= 1.0:
        raise ValueError(f"hit ratio must be in [0, 1], got {ratio!r}")
    for i in range(1, len(HIT_INTERVAL_EDGES)):
        if ratio <= HIT_INTERVAL_EDGES[i]:
            return i - 1
    raise AssertionError("unreachable: ratio <= 1.0")


class RadixMatch(NamedTuple):
    """Result of ``match_prefix``; ``handle`` is what ``lock``/``unlock`` take."""

    block_ids: tuple[int, ...]
    hit_tokens: int
    handle: PrefixMatch


@dataclass(frozen=True)
class InsertResult:
    """What ``insert_finished`` did with a finished request's blocks."""

    hashes: tuple[int, ...]  # chained hashes of the request's full blocks
    adopted: tuple[int, ...]  # the request's blocks the tree now owns
    duplicates: tuple[int, ...]  # the request's blocks whose prefix the tree already held
    freed: tuple[int, ...]  # blocks that became free (duplicates, partial tail, ...)

    # (written out: mypyc compiles it; a dataclass's generated one stays interpreted)
    def __init__(
        self,
        hashes: tuple[int, ...],
        adopted: tuple[int, ...],
        duplicates: tuple[int, ...],
        freed: tuple[int, ...],
    ) -> None:
        object.__setattr__(self, "hashes", hashes)
        object.__setattr__(self, "adopted", adopted)
        object.__setattr__(self, "duplicates", duplicates)
        object.__setattr__(self, "freed", freed)


@dataclass(frozen=True)
class CacheEventBatch:
    """Inserted / evicted prefixes since the last drain; field names match protocol CacheEvents
    (``CacheEvents(**dataclasses.asdict(batch))``). The two sets are disjoint (netted)."""

    seq: int
    block_size: int
    inserted: tuple[int, ...]
    evicted: tuple[int, ...]

    # (written out: mypyc compiles it; a dataclass's generated one stays interpreted)
    def __init__(
        self, seq: int, block_size: int, inserted: tuple[int, ...], evicted: tuple[int, ...]
    ) -> None:
        object.__setattr__(self, "seq", seq)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "inserted", inserted)
        object.__setattr__(self, "evicted", evicted)


@dataclass(eq=False)
class _Node:
    uid: int
    parent: _Node | None
    tokens: tuple[int, ...]  # edge label: len(blocks) * block_size tokens
    blocks: list[int]
    hashes: list[int]  # chained hash of each block (names the prefix up to it)
    children: dict[object, _Node] = field(default_factory=dict)  # keyed by _key
    last_access: int = 0
    last_locked: int = -1  # index of the deepest locked block here (-1: none)
    locked_below: int = 0  # strict descendants holding a locked block
    evictable: int = 0  # blocks of this node repeated leaf eviction could free
    heap_at: int = -1  # last_access of its live eviction-heap entry (-1: none)
    heap_epoch: int = 0  # ... in that heap generation

    # (written out: mypyc compiles it; a dataclass's generated one stays interpreted)
    def __init__(
        self,
        uid: int,
        parent: _Node | None,
        tokens: tuple[int, ...],
        blocks: list[int],
        hashes: list[int],
        children: dict[object, _Node] | None = None,
        last_access: int = 0,
        last_locked: int = -1,
        locked_below: int = 0,
        evictable: int = 0,
        heap_at: int = -1,
        heap_epoch: int = 0,
    ) -> None:
        self.uid = uid
        self.parent = parent
        self.tokens = tokens
        self.blocks = blocks
        self.hashes = hashes
        self.children = {} if children is None else children
        self.last_access = last_access
        self.last_locked = last_locked
        self.locked_below = locked_below
        self.evictable = evictable
        self.heap_at = heap_at
        self.heap_epoch = heap_epoch


class _LruEntry:
    """A leaf's place in the eviction heap: (its last_access when pushed, uid). A class with
    its own ``<`` rather than a tuple: compiled, it compares two native ints, where a tuple
    compared the int objects twice (equal? then less?)."""

    __slots__ = ("at", "uid", "node")

    def __init__(self, at: int, uid: int, node: _Node) -> None:
        self.at = at
        self.uid = uid
        self.node = node

    def __lt__(self, other: _LruEntry) -> bool:
        return self.at < other.at or (self.at == other.at and self.uid < other.uid)


class RadixCache:
    """Radix tree of cached full KV blocks on top of a BlockAllocator (see module docstring)."""

    def __init__(
        self, allocator: BlockAllocator, block_size: int, max_pending_events: int = 1 << 16
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        if max_pending_events < 0:
            raise ValueError(f"max_pending_events must be >= 0, got {max_pending_events}")
        self.allocator = allocator
        self.block_size = block_size
        self._uids = itertools.count(1)
        self._root = _Node(0, None, (), [], [])
        # owned block id -> its node (None: not cached), indexed like the allocator's ids
        self._node_of: list[_Node | None] = [None] * allocator.num_blocks
        self._num_cached = 0
        self._pins: dict[int, int] = {}
        self._leaves: set[_Node] = set()
        self._num_evictable = 0
        self._clock = 0
        self._rc = allocator.refcounts()  # read-only fast path for owned ids
        # Eviction order (least recently used evictable leaf) kept incrementally: a heap of
        # (last_access, uid) entries (_LruEntry) pushed when a leaf becomes evictable or is touched,
        # validated when popped (stale ones skipped), rebuilt when stale ones pile up; so an
        # eviction costs O(log leaves), not a pass over every leaf.
        self._lru: list[_LruEntry] = []
        self._lru_epoch = 0
        # statistics
        self.tokens_asked = 0
        self.tokens_hit = 0
        self.num_requests = 0
        self.hit_histogram = [0] * (len(HIT_INTERVAL_EDGES) - 1)
        self.num_evicted = 0
        self.num_inserted = 0
        # event log: hash -> cached now? (netted per drain), and the notice numbering
        self.max_pending_events = max_pending_events
        self._pending: dict[int, bool] = {}
        self._event_seq = 0
        self.events_dropped = 0

    # -- sizes and accounting -------------------------------------------------------------------

    @property
    def num_cached_blocks(self) -> int:
        return self._num_cached

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached * self.block_size

    @property
    def num_evictable(self) -> int:
        return self._num_evictable

    @property
    def num_available(self) -> int:
        """Blocks an allocation can get: free ones plus evictable cached ones."""
        return self.allocator.num_free + self._num_evictable

    @property
    def num_nodes(self) -> int:
        count, stack = 0, list(self._root.children.values())
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values())
        return count

    @property
    def hit_rate(self) -> float:
        return self.tokens_hit / self.tokens_asked if self.tokens_asked else 0.0

    def is_cached(self, block_id: int) -> bool:
        return self._owner(block_id) is not None

    def is_pinned(self, block_id: int) -> bool:
        return self._pins.get(block_id, 0) > 0

    def is_locked(self, block_id: int) -> bool:
        return self._locked(block_id)

    def record_lookup(self, asked_tokens: int, hit_tokens: int) -> None:
        """Count one request's lookup in the statistics (tokens and the ratio histogram)."""
        if asked_tokens <= 0 or not 0 <= hit_tokens <= asked_tokens:
            raise ValueError(f"bad lookup: {hit_tokens} hit of {asked_tokens} asked")
        self.tokens_asked += asked_tokens
        self.tokens_hit += hit_tokens
        self.num_requests += 1
        self.hit_histogram[hit_interval(hit_tokens / asked_tokens)] += 1

    # -- lookup -----------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], max_blocks: int | None = None) -> PrefixMatch:
        """Longest cached chain of leading full blocks (no references, no accounting, no LRU)."""
        return self._match_path(token_ids, max_blocks)[0]

    def _match_path(
        self, token_ids: Sequence[int], max_blocks: int | None
    ) -> tuple[PrefixMatch, list[tuple[_Node, int]]]:
        blocks: list[int] = []
        hashes: list[int] = []
        path = self._walk(tuple(token_ids), self._limit(token_ids, max_blocks))
        for node, m in path:
            if m == len(node.blocks):  # (a whole node: no temporary slice)
                blocks += node.blocks
                hashes += node.hashes
            else:
                blocks += node.blocks[:m]
                hashes += node.hashes[:m]
        return PrefixMatch(tuple(blocks), tuple(hashes), self.block_size), path

    def match_and_lock(self, token_ids: Sequence[int], max_blocks: int | None = None) -> RadixMatch:
        """``match_prefix(token_ids, max_blocks, record=False)`` then ``lock`` of its handle,
        in one walk: the same effect, without re-validating a match just made."""
        m, path = self._match_path(token_ids, max_blocks)
        if path:
            self.allocator.incref_unchecked(list(m.block_ids))  # the tree's own ids
            nodes = [node for node, _ in path]
            self._touch_path(nodes[-1])
            self._relock_nodes(nodes, path=True)
        return RadixMatch(m.block_ids, m.num_tokens, m)

    def match_prefix(
        self, token_ids: Sequence[int], max_blocks: int | None = None, record: bool = True
    ) -> RadixMatch:
        """``match`` plus, with ``record``, the lookup counted in the hit statistics."""
        m = self.match(token_ids, max_blocks)
        if record and len(token_ids):
            self.record_lookup(len(token_ids), m.num_tokens)
        return RadixMatch(m.block_ids, m.num_tokens, m)

    def acquisition_cost(self, match: PrefixMatch) -> int:
        """How many currently available blocks taking references on ``match`` would consume."""
        cost = 0
        for node, m in self._group(match.block_ids):
            cost += max(0, m - (len(node.blocks) - node.evictable))
        return cost

    def acquire(
        self, token_ids: Sequence[int], max_blocks: int | None = None, record: bool = True
    ) -> PrefixMatch:
        """Match and take one reference per matched block (release them later)."""
        m = self.match(token_ids, max_blocks)
        self.take(m)
        if record and len(token_ids):
            self.record_lookup(len(token_ids), m.num_tokens)
        return m

    def take(self, match: PrefixMatch) -> None:
        """Take one reference per block of a still valid match (a request now uses them)."""
        nodes = self._check_valid(match)
        if not nodes:
            return
        self.allocator.incref(match.block_ids)
        self._touch_path(nodes[-1])
        # a match from match() is a root path: then one bottom-up pass recounts it
        path = nodes[0].parent is self._root and all(
            b.parent is a for a, b in zip(nodes, nodes[1:], strict=False)
        )
        self._relock_nodes(nodes, path=path)

    def lock(self, handle: PrefixMatch) -> None:
        """Protect a matched path for a request (one reference per block); see ``unlock``."""
        self.take(handle)

    def unlock(self, handle: PrefixMatch) -> list[int]:
        """Drop the references ``lock`` took; returns blocks that became free (none: the tree
        still holds its own)."""
        self._check_valid(handle)
        return self.release(handle.block_ids)

    def pin(self, match: PrefixMatch) -> None:
        """Keep a matched prefix from eviction until ``unpin`` (pins nest)."""
        self._check_valid(match)
        for b in match.block_ids:
            self._pins[b] = self._pins.get(b, 0) + 1
        self._relock(match.block_ids)

    def unpin(self, match: PrefixMatch) -> None:
        self._check_valid(match)
        for b in match.block_ids:
            if self._pins.get(b, 0) == 0:
                raise ValueError(f"unpin of block {b} that is not pinned")
        for b in match.block_ids:
            self._pins[b] -= 1
            if not self._pins[b]:
                del self._pins[b]
        self._relock(match.block_ids)

    # -- insertion and release --------------------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        first_block: int = 0,
        parent_hash: int = 0,
    ) -> list[int]:
        """Cache the full blocks of a sequence whose KV is computed (PrefixCache's signature).

        ``token_ids``: the sequence's tokens from position 0 (only whole blocks count);
        ``block_ids``: its block table. The tree adopts (takes its own reference on) each block
        whose prefix it does not hold yet; a block whose prefix it already holds under another
        id stays the caller's alone (a duplicate, freed when the caller releases it).
        ``first_block`` / ``parent_hash``: the engine's incremental form (blocks before
        ``first_block`` were inserted earlier; ``parent_hash`` is the hash of block
        ``first_block - 1`` and is checked). Returns the hashes of blocks ``first_block..``.
        """
        tokens = tuple(token_ids)
        full = len(tokens) // self.block_size
        if not 0 <= first_block <= full:
            raise ValueError(f"first_block {first_block} outside 0..{full} full blocks")
        hashes, _, _, _ = self._insert(tokens, block_ids)
        # The insertion itself is driven by the tokens (walked from the root), so it is right
        # even when this check fails; the check catches a caller whose hash chain is broken.
        if first_block and hashes[first_block - 1] != parent_hash:
            raise ValueError(
                f"parent_hash {parent_hash:#x} is not the hash of block "
                f"{first_block - 1} of these tokens"
            )
        return hashes[first_block:]

    def insert_finished(
        self,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        hashes: Sequence[int] | None = None,
    ) -> InsertResult:
        """A request finished: cache its full blocks (prompt + generated tokens with KV), then
        drop its references on all of ``block_ids`` (its locked prefix included). Duplicates and
        the partial last block become free; the tree keeps what it adopted.

        ``hashes``: the chained hashes of ``token_ids``' full blocks (``chained_hashes``; more
        trailing ones are ignored) when the caller keeps them, e.g. per conversation: the tree
        then names its new blocks with them instead of hashing again. Only the last new block's
        hash is checked against its tokens (a misaligned list fails; a wrong value further up
        would only mislead a view of this cache, never a match, which compares tokens)."""
        tokens = tuple(token_ids)
        ids = list(block_ids)
        hashes, adopted, duplicates, owners = self._insert(tokens, ids, hashes)
        unchecked = duplicates + ids[len(tokens) // self.block_size :]
        freed = self._release_inserted(ids, owners, unchecked)
        return InsertResult(tuple(hashes), tuple(adopted), tuple(duplicates), tuple(freed))

    def _release_inserted(
        self, ids: list[int], owners: list[_Node], unchecked: list[int]
    ) -> list[int]:
        """``release(ids)`` right after ``_insert`` of them. That walk found the nodes holding
        any of them (``owners``, in the order ``_nodes(ids)`` gives) and checked every id but
        the duplicates and the partial tail (``unchecked``), so only those are checked here.
        (tests/test_sim_scale.py compares it with ``release``.)"""
        alloc = self.allocator
        # (the walk matched ids by value: a float equal to a block id still needs the checks)
        plain = alloc.plain_ids(unchecked) and not set(map(type, ids)) - {int}
        freed = alloc.decref_plain(ids) if plain else alloc.decref(ids)
        if owners:
            chain = self._touch_paths(owners)
            self._relock_nodes(owners, chain=chain)
        return freed

    def release(self, block_ids: Sequence[int]) -> list[int]:
        """Drop one reference per block (a request finishing); returns blocks that became free.
        Cached blocks become most recently used."""
        ids = list(block_ids)
        freed = self.allocator.decref(ids)
        nodes = self._nodes(ids)
        if nodes:
            chain = self._touch_paths(nodes)
            self._relock_nodes(nodes, chain=chain)
        return freed

    # -- eviction and allocation -------------------------------------------------------------------

    def evict(self, n: int) -> list[int]:
        """Free up to ``n`` evictable blocks, tail blocks of least recently used leaves first;
        returns the freed block ids (now free in the allocator)."""
        if n < 0:
            raise ValueError(f"cannot evict {n} blocks")
        heap = self._lru
        freed: list[int] = []
        while len(freed) < n and heap:
            entry = heapq.heappop(heap)
            at, node = entry.at, entry.node
            if at == node.heap_at and node.heap_epoch == self._lru_epoch:
                node.heap_at = -1  # its live entry is used up
            if at != node.last_access or node.children or not node.evictable or node.parent is None:
                continue  # a stale entry: touched since, no longer a leaf or not evictable
            key = self._key(node.tokens)
            k = min(n - len(freed), node.evictable)
            # the node's k tail blocks, tail first (the order they are noted and freed in)
            if k == len(node.blocks):  # all of them: reversed in place, not copied
                gone, hashes = node.blocks, node.hashes
                gone.reverse()
                hashes.reverse()
                node.blocks, node.hashes = [], []
            else:
                gone, hashes = node.blocks[: -k - 1 : -1], node.hashes[: -k - 1 : -1]
                del node.blocks[-k:], node.hashes[-k:]
            node_of = self._node_of
            for b in gone:
                node_of[b] = None
            self._num_cached -= len(gone)
            self._note_all(hashes, False)
            got = self.allocator.decref_unchecked(gone)  # the tree's own ids
            if got != gone:
                raise AssertionError(
                    f"evicted blocks {sorted(set(gone) - set(got))} were still referenced"
                )
            freed += gone
            if node.blocks:
                node.tokens = node.tokens[: len(node.blocks) * self.block_size]
            else:
                node.tokens = ()
            self._refresh(node)  # re-enters the heap if still evictable
            if not node.blocks:
                self._offer_leaf(self._detach(node, key))
        self.num_evicted += len(freed)
        return freed

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks for a request, evicting when the free list is short."""
        short = n - self.allocator.num_free
        if short > 0:
            if short > self._num_evictable:
                raise OutOfBlocks(n, self.num_available, self.allocator.num_blocks)
            self.evict(short)
        return self.allocator.allocate(n)

    def clear(self) -> int:
        """Evict everything evictable (locked blocks and their ancestors stay); returns how many."""
        return len(self.evict(self._num_evictable))

    # -- event log ---------------------------------------------------------------------------------

    @property
    def num_pending_events(self) -> int:
        return len(self._pending)

    def drain_events(self, max_hashes: int = 1 << 20) -> CacheEventBatch | None:
        """The next notice of inserted / evicted prefixes (at most ``max_hashes`` hashes), or
        None when nothing changed. Notices are numbered 0, 1, ...; a skipped number means
        events were dropped (see ``max_pending_events``) and the receiver's view is stale."""
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
        seq = self._event_seq
        self._event_seq += 1
        # (C-level selection: the hash objects themselves, not re-boxed copies)
        return CacheEventBatch(
            seq,
            self.block_size,
            tuple(compress(hashes, flags)),
            tuple(compress(hashes, map(operator.not_, flags))),
        )

    @property
    def next_event_seq(self) -> int:
        """The number the next notice will carry (a snapshot's resync point)."""
        return self._event_seq

    def snapshot_hashes(self) -> list[int]:
        """Every cached block's chained hash (for a full resync of a stale view)."""
        out: list[int] = []
        stack = [self._root]
        while stack:
            node = stack.pop()
            out += node.hashes
            stack.extend(node.children.values())
        return out

    def _note_all(self, hashes: list[int], present: bool) -> None:
        """Log that these prefixes were inserted (``present``) or evicted, in order."""
        pending, cap = self._pending, self.max_pending_events
        if not cap:
            return  # no log kept (see __init__)
        objs: list[Any] = hashes  # (Any: compiled, an int variable would re-box each hash)
        for h in objs:
            pending.pop(h, None)  # re-append: drain order follows the latest change
            pending[h] = present
            if len(pending) > cap:
                # Nobody drains: forget the log and skip a notice number, so the receiver sees
                # a gap and knows its view is stale instead of silently missing events.
                self.events_dropped += len(pending)
                pending.clear()
                self._event_seq += 1

    # -- invariants (tests and debugging) --------------------------------------------------------------

    def check_invariants(self) -> None:
        """Recompute every derived quantity from scratch; raises AssertionError on a mismatch."""
        bs = self.block_size
        seen: dict[int, _Node] = {}
        total_evictable = 0
        leaves = set()

        def visit(node: _Node, parent_hash: int) -> int:
            nonlocal total_evictable
            locked_below = 0
            for key, child in node.children.items():
                assert child.parent is node, "child's parent link is wrong"
                assert child.blocks, "empty non-root node"
                assert key == self._key(child.tokens), "child keyed by the wrong tokens"
                assert len(child.tokens) == len(child.blocks) * bs == len(child.hashes) * bs
                h = parent_hash if node is not self._root else 0
                h = node.hashes[-1] if node.hashes else h
                for i, b in enumerate(child.blocks):
                    assert b not in seen, f"block {b} owned by two nodes"
                    seen[b] = child
                    h = hash_block(h, child.tokens[i * bs : (i + 1) * bs])
                    assert child.hashes[i] == h, "stored hash is not the chained hash"
                    assert self.allocator.refcount(b) >= 1, f"owned block {b} is free"
                locked = [i for i, b in enumerate(child.blocks) if self._locked(b)]
                assert child.last_locked == (locked[-1] if locked else -1)
                below = visit(child, h)
                assert child.locked_below == below, "locked_below is stale"
                want = 0 if below else len(child.blocks) - (child.last_locked + 1)
                assert child.evictable == want, "evictable count is stale"
                total_evictable += want
                locked_below += below + (1 if locked else 0)
                if not child.children:
                    leaves.add(child)
            return locked_below

        visit(self._root, 0)
        assert seen == {b: n for b, n in enumerate(self._node_of) if n is not None}, (
            "block -> node index is stale"
        )
        assert self._num_cached == len(seen), "cached block count is stale"
        assert total_evictable == self._num_evictable, "evictable total is stale"
        assert leaves == self._leaves, "leaf set is stale"
        assert all(self._owner(b) is not None for b in self._pins), "pin on an uncached block"

    # -- internals -------------------------------------------------------------------------------

    def _limit(self, token_ids: Sequence[int], max_blocks: int | None) -> int:
        full = len(token_ids) // self.block_size
        return full if max_blocks is None else max(0, min(max_blocks, full))

    def _walk(self, tokens: tuple[int, ...], limit: int) -> list[tuple[_Node, int]]:
        """Matched (node, blocks matched in it) from the root; only the last may be partial."""
        bs = self.block_size
        path: list[tuple[_Node, int]] = []
        node, i = self._root, 0
        while i < limit:
            child = node.children.get(tokens[i] if bs == 1 else tokens[i * bs : (i + 1) * bs])
            if child is None:
                break
            nb = len(child.blocks)
            n = nb if nb <= limit - i else limit - i
            if (
                n == 1
                or (child.tokens if n == nb else child.tokens[: n * bs])
                == tokens[i * bs : (i + n) * bs]
            ):
                m = n  # (the first block matched: it is the key)
            else:
                # the longest matching run of blocks, 1 <= m < n: bisect on equal prefixes
                lo, hi = 1, n
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    if child.tokens[: mid * bs] == tokens[i * bs : (i + mid) * bs]:
                        lo = mid
                    else:
                        hi = mid
                m = lo
            path.append((child, m))
            i += m
            if m < nb:
                break
            node = child
        return path

    def _insert(
        self, tokens: tuple[int, ...], block_ids: Sequence[int], known: Sequence[int] | None = None
    ) -> tuple[list[int], list[int], list[int], list[_Node]]:
        """Insert the full blocks of ``tokens``; returns their hashes, the ids adopted, the
        duplicates (ids whose prefix the tree held under other ids) and the nodes now holding
        any of ``block_ids`` (matched ones and the new leaf, in table order)."""
        bs = self.block_size
        full = len(tokens) // bs
        if full > len(block_ids):
            raise ValueError(
                f"{full} full blocks of tokens but the block table has {len(block_ids)}"
            )
        if known is not None and len(known) < full:
            raise ValueError(f"{len(known)} hashes for {full} full blocks of tokens")
        path = self._walk(tokens, full)
        hashes: list[int] = []
        duplicates: list[int] = []
        ids = block_ids if type(block_ids) is list else list(block_ids)
        owners: list[_Node] = []
        i = 0
        for node, m in path:
            hashes += node.hashes if m == len(node.hashes) else node.hashes[:m]
            mine = ids[i : i + m]
            if mine == (node.blocks if m == len(node.blocks) else node.blocks[:m]):
                owners.append(node)
            else:
                dup = [b for b, own in zip(mine, node.blocks, strict=False) if b != own]
                if len(dup) < m:
                    owners.append(node)  # holds the ones that are not duplicates
                duplicates += dup
            i += m
        new = ids[i:full]
        if set(map(type, new)) - {int}:
            new = [int(b) for b in new]  # int subclasses stored as plain ints
        if not new:
            if path:
                self._touch_path(path[-1][0])
            return hashes, [], duplicates, owners
        if known is None:
            new_hashes = chained_hashes(tokens[i * bs : full * bs], bs, hashes[-1] if hashes else 0)
        else:
            new_hashes = list(known[i:full])
            before = known[full - 2] if full > 1 else 0
            if chained_hashes(tokens[(full - 1) * bs : full * bs], bs, before) != new_hashes[-1:]:
                raise ValueError("the given hashes are not the chained hashes of these tokens")
        # Check each new id (in range, not cached, referenced, not repeated) in one pass,
        # marking it as seen; any failure undoes the marks and raises the precise error.
        rc = self._rc
        node_of = self._node_of
        n = len(rc)
        marker = self._root  # owns no block: marks the ids this pass has seen
        for k, b in enumerate(new):
            if b < 0 or b >= n or node_of[b] is not None or rc[b] == 0:
                for u in new[:k]:
                    node_of[u] = None
                self._reject_new(new)
            node_of[b] = marker
        # from here on every id in `new` is a plain, valid, referenced int
        parent = self._root
        if path:  # split only when something hangs below the match point
            last, m = path[-1]
            if m < len(last.blocks):
                parent = self._split(last, m)
                if owners and owners[-1] is last:
                    owners[-1] = parent  # the matched blocks moved up into it
            else:
                parent = last
        self.allocator.incref_unchecked(new)  # the tree's own reference (checked above)
        leaf = _Node(next(self._uids), parent, tokens[i * bs : full * bs], new, new_hashes)
        parent.children[self._key(leaf.tokens)] = leaf
        self._leaves.discard(parent)
        self._leaves.add(leaf)
        for b in new:
            node_of[b] = leaf
        self._num_cached += len(new)
        self._note_all(new_hashes, True)
        self.num_inserted += len(new)
        self._touch_path(leaf)
        self._recount(leaf)  # after the touch: its heap entry gets the new mark
        hashes += new_hashes
        owners.append(leaf)
        return hashes, new, duplicates, owners

    def _reject_new(self, new: list[int]) -> None:
        """Raise the error for the first bad id of ``new`` (ids a finished request brings)."""
        if len(set(new)) != len(new):
            raise ValueError(f"block table repeats a block id: {new}")
        for b in new:
            count = self.allocator.refcount(b)  # (raises for an id out of range)
            if self._node_of[b] is not None:
                raise ValueError(f"block {b} is already cached for another prefix")
            if count == 0:
                raise ValueError(f"cannot cache free block {b}")
        raise AssertionError(f"no bad id in {new}")

    def _split(self, node: _Node, m: int) -> _Node:
        """Cut ``node`` after its first ``m`` blocks; returns the new upper node."""
        bs = self.block_size
        parent = node.parent
        assert parent is not None and 0 < m < len(node.blocks)
        upper = _Node(
            next(self._uids),
            parent,
            node.tokens[: m * bs],
            node.blocks[:m],
            node.hashes[:m],
            last_access=node.last_access,
        )
        parent.children[self._key(upper.tokens)] = upper
        node.tokens, node.blocks, node.hashes = (
            node.tokens[m * bs :],
            node.blocks[m:],
            node.hashes[m:],
        )
        node.parent = upper
        upper.children[self._key(node.tokens)] = node
        for b in upper.blocks:
            self._node_of[b] = upper
        # Recount the two halves; the ancestors now may have one more node with a locked block.
        had_locked = node.last_locked >= 0
        self._num_evictable -= node.evictable
        node.evictable = 0
        self._scan(node)
        self._scan(upper)
        upper.locked_below = node.locked_below + (node.last_locked >= 0)
        self._refresh(node)
        self._refresh(upper)
        delta = int(upper.last_locked >= 0) + int(node.last_locked >= 0) - int(had_locked)
        up: _Node | None = parent
        while up is not self._root and delta:
            assert up is not None
            up.locked_below += delta
            up = up.parent
        return upper

    def _key(self, tokens: tuple[int, ...]) -> object:
        """A child's key in its parent: its first block's tokens (the token itself for
        one-token blocks: an int key hashes and compares without a tuple around it)."""
        return tokens[0] if self.block_size == 1 else tokens[: self.block_size]

    def _detach(self, node: _Node, key: object) -> _Node:
        """Remove an emptied leaf (``key``: its first block's tokens); returns its parent, which
        may become a leaf."""
        parent = node.parent
        assert parent is not None and not node.blocks and not node.children
        del parent.children[key]
        node.parent = None
        self._leaves.discard(node)
        if not parent.children and parent is not self._root:
            self._leaves.add(parent)
        return parent

    def _owner(self, block_id: object) -> _Node | None:
        """The node owning a block id, None when it is not cached (or not a block id at all:
        for ids a caller passed in, unchecked)."""
        if type(block_id) is int and 0 <= block_id < len(self._node_of):
            return self._node_of[block_id]
        return None

    def _locked(self, block_id: int) -> bool:
        return self.allocator.refcount(block_id) > 1 or self._pins.get(block_id, 0) > 0

    def _scan(self, node: _Node) -> None:
        """Recompute a node's deepest locked block, scanning from the tail (a request in use
        locks whole paths, so this usually stops at once). Owned ids are valid: unchecked."""
        blocks, rc, pins = node.blocks, self._rc, self._pins
        last = len(blocks) - 1
        if (
            last >= 0
            and rc[blocks[last]] <= 1
            and not pins
            and max(map(rc.__getitem__, blocks)) <= 1
        ):
            node.last_locked = -1  # nothing locked (a request just let go): C speed
            return
        if pins:
            while last >= 0 and rc[blocks[last]] <= 1 and pins.get(blocks[last], 0) <= 0:
                last -= 1
        else:
            while last >= 0 and rc[blocks[last]] <= 1:
                last -= 1
        node.last_locked = last

    def _refresh(self, node: _Node) -> None:
        want = 0 if node.locked_below else len(node.blocks) - (node.last_locked + 1)
        self._num_evictable += want - node.evictable
        node.evictable = want
        if want and not node.children:
            self._offer_leaf(node)

    def _offer_leaf(self, node: _Node) -> None:
        """Give an evictable leaf its entry in the eviction heap at its current last_access
        (unless it has that entry already)."""
        if (
            node.children
            or not node.evictable
            or node.parent is None
            or (node.heap_at == node.last_access and node.heap_epoch == self._lru_epoch)
        ):
            return
        heap = self._lru
        if len(heap) > 2 * len(self._leaves) + 64:
            # mostly stale entries: rebuild from the evictable leaves (amortised O(1) a push)
            self._lru_epoch += 1
            heap.clear()
            for x in self._leaves:
                if x.evictable and x.parent is not None:
                    x.heap_at, x.heap_epoch = x.last_access, self._lru_epoch
                    heap.append(_LruEntry(x.last_access, x.uid, x))
            heapq.heapify(heap)
            if node.heap_at == node.last_access and node.heap_epoch == self._lru_epoch:
                return
        node.heap_at, node.heap_epoch = node.last_access, self._lru_epoch
        heapq.heappush(heap, _LruEntry(node.last_access, node.uid, node))

    def _recount(self, node: _Node) -> None:
        """A node's lock state may have changed: rescan it, propagate to its ancestors."""
        before = node.last_locked >= 0
        self._scan(node)
        self._refresh(node)
        delta = int(node.last_locked >= 0) - int(before)
        up = node.parent
        while up is not None and up is not self._root:
            if delta:
                up.locked_below += delta
            self._refresh(up)
            up = up.parent

    def _relock(self, block_ids: Iterable[int]) -> None:
        nodes = self._nodes(block_ids)
        if nodes:
            self._relock_nodes(nodes)

    def _nodes(self, block_ids: Iterable[int]) -> list[_Node]:
        """The distinct nodes owning the given (cached) blocks, in first-seen order."""
        # a node's blocks come in runs: group at C speed, then dedupe the (few) runs
        runs = [x for x, _ in groupby(map(self._node_of.__getitem__, block_ids)) if x is not None]
        return list(dict.fromkeys(runs)) if len(runs) > 1 else runs

    def _chain(self, node: _Node) -> list[_Node]:
        """A node and its ancestors below the root, deepest first."""
        chain = []
        root = self._root
        while node is not None and node is not root:
            chain.append(node)
            node = node.parent  # type: ignore[assignment]
        return chain

    def _relock_nodes(
        self, nodes: list[_Node], path: bool = False, chain: list[_Node] | None = None
    ) -> None:
        """Recount nodes whose blocks' lock state may have changed. When they all lie on one
        root path (a request's blocks: the usual case; ``path``: known to be the whole chain
        of the last) this is one bottom-up pass carrying the change in ``locked_below``,
        instead of one walk to the root per node; the result is the same (each node's counts
        depend only on the final lock states). ``chain``: the last node's, when known."""
        if chain is None:
            chain = self._chain(nodes[-1])
        todo = set(nodes)
        if not path and len(todo) > 1 and not todo.issubset(chain):
            for node in nodes:  # not one path: each recount propagates its own delta
                self._recount(node)
            return
        carry, left = 0, len(todo)
        for node in chain:
            if node in todo:
                before = node.last_locked >= 0
                self._scan(node)
                node.locked_below += carry
                self._refresh(node)
                carry += (node.last_locked >= 0) - before
                left -= 1
            elif carry:
                node.locked_below += carry
                self._refresh(node)
            elif not left:
                break

    def _touch_path(self, node: _Node) -> None:
        """Mark a node and its ancestors most recently used (the node itself the newest)."""
        self._mark_chain(self._chain(node))

    def _mark_chain(self, chain: list[_Node]) -> None:
        """Stamp a node's chain (the node first, the root's child last) with the next clock
        values, the root side oldest, and offer the node to the eviction heap."""
        clock = self._clock
        for n in reversed(chain):
            clock += 1
            n.last_access = clock
        self._clock = clock
        if chain:
            self._offer_leaf(chain[0])

    def _touch_paths(self, nodes: list[_Node]) -> list[_Node]:
        """``_touch_path`` of each node in order; returns the last node's chain. When every
        node is an ancestor of the last one (a request's path) only the last touch's marks
        survive: do that one, with the clock advanced exactly as the whole sequence would
        have (same values, one walk)."""
        chain = self._chain(nodes[-1])
        if len(nodes) > 1:
            depth = {n: len(chain) - i for i, n in enumerate(chain)}
            if not all(n in depth for n in nodes):
                for node in nodes[:-1]:
                    self._touch_path(node)
            else:
                self._clock += sum(depth[n] for n in nodes[:-1])
        self._mark_chain(chain)
        return chain

    def _group(self, block_ids: Sequence[int]) -> list[tuple[_Node, int]]:
        """(node, number of the given blocks in it) for cached blocks, in first-seen order."""
        out: dict[_Node, int] = {}
        for b in block_ids:
            node = self._owner(b)
            if node is not None:
                out[node] = out.get(node, 0) + 1
        return list(out.items())

    def _check_valid(self, match: PrefixMatch) -> list[_Node]:
        """Raise unless the match still names cached blocks; returns the nodes it covers."""
        if match.block_size != self.block_size:
            raise ValueError(
                f"match at block size {match.block_size}, cache uses {self.block_size}"
            )
        ids, hashes = list(match.block_ids), list(match.hashes)
        if len(ids) != len(hashes):
            raise ValueError("prefix match has different numbers of blocks and hashes")
        # A match runs from the root, so it covers whole nodes from their first block on.
        i = 0
        nodes = []
        while i < len(ids):
            node = self._owner(ids[i])
            k = min(len(node.blocks), len(ids) - i) if node is not None else 0
            if (
                node is None
                or node.blocks[:k] != ids[i : i + k]
                or node.hashes[:k] != hashes[i : i + k]
            ):
                raise ValueError(
                    f"prefix match is stale: block {ids[i]} is no longer cached for that prefix"
                )
            nodes.append(node)
            i += k
        return nodes
