"""A prefill instance: FIFO, one request at a time, chunked, with P's own prefix cache.

P's prefix cache is a real ``RadixCache`` (over workload units): a conversation's next turn
recomputes only what P does not hold (P caches prompts, never outputs, which it does not
compute). Each chunk's end is reported, because the KV of a finished chunk can leave at once
(to RLD over RDMA, to MD over the WAN) while the next chunk computes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.radix import RadixCache
from pddnet.sim.cost import InstanceCost
from pddnet.sim.events import EventLoop

Progress = Callable[[Any, int, float, bool], None]   # (state, computed tokens, time, done)


class PrefillInstance:
    def __init__(self, loop: EventLoop, cost: InstanceCost, name: str, tokens_per_unit: int,
                 block_units: int, chunk_tokens: int, prefix_cache: bool = True) -> None:
        self.loop, self.cost, self.name = loop, cost, name
        self.q = tokens_per_unit
        self.block_units = block_units
        self.chunk_tokens = chunk_tokens
        self.cache: RadixCache | None = None
        if prefix_cache:
            blocks = cost.kv_capacity_tokens() // (block_units * tokens_per_unit)
            if blocks < 1:
                raise ValueError(f"{name}: no room for a single KV block")
            # Nobody reads P's cache events (only MD's feed P's view): keep the log at one
            # entry instead of filling 64K entries per P before it resets (memory only).
            self.cache = RadixCache(BlockAllocator(blocks), block_units, max_pending_events=1)
        self.queue: deque[tuple[Any, Progress]] = deque()
        self.busy = False
        self.busy_s = 0.0
        self.tokens_computed = 0
        self.tokens_cached = 0

    @property
    def load(self) -> int:
        return len(self.queue) + self.busy

    def submit(self, state: Any, on_progress: Progress) -> None:
        self.queue.append((state, on_progress))
        if not self.busy:
            self._next()

    def _next(self) -> None:
        if not self.queue:
            self.busy = False
            return
        self.busy = True
        state, on_progress = self.queue.popleft()
        req = state.req
        hit, handle, table = 0, None, None
        if self.cache is not None:
            bs = self.block_units
            m = self.cache.match_and_lock(req.units, max_blocks=(len(req.units) - 1) // bs)
            if req.units:
                self.cache.record_lookup(len(req.units), m.hit_tokens)
            handle = m.handle
            hit = min(m.hit_tokens * self.q, req.prompt_tokens - 1)
            need = -(-len(req.units) // bs) - len(m.block_ids)
            if self.cache.num_available >= need:
                table = list(m.block_ids) + self.cache.allocate(need)
        state.p_hit = hit
        state.prefill_start = self.loop.now
        self.tokens_cached += hit
        on_progress(state, hit, self.loop.now, False)
        self._chunk(state, on_progress, hit, handle, table)

    def _chunk(self, state: Any, on_progress: Progress, pos: int, handle: Any,
               table: list[int] | None) -> None:
        end = min(state.req.prompt_tokens, pos + self.chunk_tokens)
        dt = self.cost.prefill_chunk_time(pos, end)
        self.busy_s += dt
        self.tokens_computed += end - pos
        state.last_chunk_tokens = end - pos
        self.loop.after(dt, self._chunk_done, state, on_progress, end, handle, table)

    def _chunk_done(self, state: Any, on_progress: Progress, pos: int, handle: Any,
                    table: list[int] | None) -> None:
        if pos < state.req.prompt_tokens:
            on_progress(state, pos, self.loop.now, False)
            self._chunk(state, on_progress, pos, handle, table)
            return
        if self.cache is not None:
            if table is not None:
                self.cache.insert_finished(state.req.units, table)
            else:
                self.cache.unlock(handle)
        on_progress(state, pos, self.loop.now, True)
        self._next()
