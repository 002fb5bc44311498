"""Continuous batching: which sequences compute how many tokens in the next forward.

Pure bookkeeping, no tensors: it decides chunks and allocates their blocks, the runner computes.

Admission reserves a sequence's whole-life block *claim* (prompt + max_tokens - 1 tokens) against
the blocks that are free or evictable, without allocating it; blocks are then allocated on
demand as the sequence grows. Because the sum of outstanding claims never exceeds what is
available, a running sequence can always get its next block, so the scheduler needs no
preemption and never over-allocates. Sequences whose blocks come from outside (imported KV)
bring their claim with them from ``BlockManager.reserve``.

Per step: running sequences first (those one token from sampling, i.e. decodes, ahead of longer
prefill/extend chunks), each capped by its ``max_chunk_tokens`` and by the step's token budget;
then waiting sequences are admitted in arrival order while budget, ``max_num_seqs`` and claims
allow (strict FIFO: a big request at the head is not overtaken, so it cannot starve).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from pddnet.engine.sequence import Sequence, SequenceStatus
from pddnet.kv.allocator import BlockAllocator, OutOfBlocks
from pddnet.kv.hash_cache import HashPrefixCache
from pddnet.kv.prefix_cache import PrefixCache, PrefixMatch
from pddnet.kv.radix import RadixCache

# The engine's prefix cache kinds (the config's "off" means no cache: pddnet/config.py).
_PREFIX_CACHES: dict[str, type[HashPrefixCache] | type[RadixCache]] = {
    "hash": HashPrefixCache,
    "radix": RadixCache,
}


def make_prefix_cache(kind: str, allocator: BlockAllocator, block_size: int) -> PrefixCache:
    """The engine's prefix cache: "hash" (chained block hashes) or "radix" (MD's DRC)."""
    if kind not in _PREFIX_CACHES:
        raise ValueError(
            f"unknown prefix cache kind {kind!r}; expected one of {tuple(_PREFIX_CACHES)}"
        )
    return _PREFIX_CACHES[kind](allocator, block_size)


class BlockManager:
    """The engine's blocks: allocator plus optional prefix cache, and the claim ledger."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_cache: bool = True,
        prefix_cache_kind: str = "hash",
    ) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_cache: PrefixCache | None = None
        if enable_prefix_cache:
            self.prefix_cache = make_prefix_cache(prefix_cache_kind, self.allocator, block_size)
        self.claimed = 0  # blocks promised to admitted sequences / reservations, not yet allocated

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def num_available(self) -> int:
        """Free plus evictable blocks."""
        if self.prefix_cache is None:
            return self.allocator.num_free
        return self.prefix_cache.num_available

    @property
    def num_unclaimed(self) -> int:
        return self.num_available - self.claimed

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match(self, token_ids: Seq[int], max_blocks: int) -> PrefixMatch | None:
        if self.prefix_cache is None or max_blocks <= 0:
            return None
        m = self.prefix_cache.match(token_ids, max_blocks)
        return m if m.num_blocks else None

    def admission_cost(self, total_blocks: int, held: int, match: PrefixMatch | None) -> int:
        """Available blocks consumed by admitting: its future allocations plus matched blocks
        that are evictable right now (taking a reference removes them from the available set)."""
        matched = match.num_blocks if match else 0
        cost = max(0, total_blocks - held - matched)
        if match is not None and self.prefix_cache is not None:
            cost += self.prefix_cache.acquisition_cost(match)
        return cost

    def take_match(self, token_ids: Seq[int], match: PrefixMatch | None) -> None:
        assert self.prefix_cache is not None or match is None
        if self.prefix_cache is not None:
            if match is not None:
                self.prefix_cache.take(match)
            if token_ids:
                self.prefix_cache.record_lookup(len(token_ids), match.num_tokens if match else 0)

    def allocate(self, n: int) -> list[int]:
        if n == 0:
            return []
        if self.prefix_cache is not None:
            return self.prefix_cache.allocate(n)
        return self.allocator.allocate(n)

    def allocate_claimed(self, n: int) -> list[int]:
        """Allocate ``n`` blocks out of an existing claim."""
        if n > self.claimed:
            raise AssertionError(f"allocation of {n} blocks exceeds the claimed {self.claimed}")
        blocks = self.allocate(n)
        self.claimed -= n
        return blocks

    def release(self, block_ids: Seq[int]) -> None:
        if not block_ids:
            return
        if self.prefix_cache is not None:
            self.prefix_cache.release(block_ids)
        else:
            self.allocator.decref(block_ids)

    def register_computed(self, seq: Sequence) -> None:
        """Index the sequence's newly completed full blocks in the prefix cache."""
        if self.prefix_cache is None:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= len(seq.block_hashes):
            return
        seq.block_hashes += self.prefix_cache.insert(
            seq.token_ids[: full * self.block_size], seq.block_table, seq.block_hashes
        )


@dataclass
class ScheduledChunk:
    seq: Sequence
    start: int  # absolute index of the chunk's first token
    num_tokens: int
    sample: bool  # the chunk reaches the sequence's end: sample the next token

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids[self.start : self.start + self.num_tokens]


class Scheduler:
    def __init__(
        self, blocks: BlockManager, max_num_batched_tokens: int, max_num_seqs: int = 256
    ) -> None:
        if max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {max_num_batched_tokens}"
            )
        if max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {max_num_seqs}")
        self.blocks = blocks
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.num_pending_tokens for s in self.running)

    def add_waiting(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence whose claim is already reserved (imported KV) goes straight to running."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Forget a sequence (finished or aborted) and return its unused claim."""
        if seq.status is SequenceStatus.RUNNING:
            self.blocks.claimed -= seq.remaining_claim(self.block_size)
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        # Decodes (one token from sampling) first: they are latency-critical and cost 1 token.
        order = sorted(
            (s for s in self.running if s.num_pending_tokens),
            key=lambda s: s.num_pending_tokens > 1,
        )
        for seq in order:
            if budget == 0:
                break
            chunk = self._chunk(seq, budget)
            chunks.append(chunk)
            budget -= chunk.num_tokens
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.popleft()
            self.add_running(seq)
            if seq.num_pending_tokens:
                chunk = self._chunk(seq, budget)
                chunks.append(chunk)
                budget -= chunk.num_tokens
        return chunks

    def _admit(self, seq: Sequence) -> bool:
        bs = self.block_size
        total = seq.max_blocks(bs)
        held = len(seq.block_table)
        # Reuse only whole blocks, and never the block holding the last token: it must be
        # computed (for its logits) into a block this sequence owns alone.
        match = None
        if not held:
            match = self.blocks.match(seq.token_ids, (seq.num_tokens - 1) // bs)
        if self.blocks.admission_cost(total, held, match) > self.blocks.num_unclaimed:
            return False
        if not held:
            self.blocks.take_match(seq.token_ids, match)
            if match is not None:
                seq.block_table = list(match.block_ids)
                seq.block_hashes = list(match.hashes)
                seq.num_computed_tokens = match.num_tokens
                seq.num_prefix_hit_tokens = match.num_tokens
        self.blocks.claimed += max(0, total - len(seq.block_table))
        return True

    def _chunk(self, seq: Sequence, budget: int) -> ScheduledChunk:
        n = min(seq.num_pending_tokens, budget)
        if seq.max_chunk_tokens is not None:
            n = min(n, seq.max_chunk_tokens)
        start = seq.num_computed_tokens
        need = self.blocks.blocks_for(start + n) - len(seq.block_table)
        if need > 0:
            try:
                seq.block_table += self.blocks.allocate_claimed(need)
            except OutOfBlocks as e:  # the claim ledger makes this unreachable
                raise AssertionError(f"claimed blocks were not available: {e}") from e
        sample = start + n == seq.num_tokens and not seq.hold
        return ScheduledChunk(seq, start, n, sample)
