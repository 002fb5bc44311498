"""A prefill instance: steps of up to ``chunk_tokens`` tokens, with P's own prefix cache.

It schedules like pddnet's engine (pddnet/engine/scheduler.py) with ``max_seqs`` running
prompts at most: each step first continues the running prompts (a chunked prefill's next
chunk), then admits waiting prompts in arrival order while the step's token budget and
``max_seqs`` allow, the last one admitted chunked to what is left of the budget. A prompt that
arrives while a step runs waits for the step's end: the real engine admits only between steps
(its worker thread runs ``add_request`` between forwards). Every prompt of a step finishes at
the step's end, so batching trades the first prompt's latency for fewer, fuller forwards.
``max_seqs=1`` (the default, what every simulated deployment uses) is one prompt at a time,
FIFO, chunked: the GPU engines the simulator models by default.

P's prefix cache is a real ``RadixCache`` (over workload units): a conversation's next turn
recomputes only what P does not hold (P caches prompts, never outputs, which it does not
compute). Each chunk's end is reported, because the KV of a finished chunk can leave at once
(to RLD over RDMA, to MD over the WAN) while the next chunk computes.

A step's time is the roofline of one forward over all its chunks (``InstanceCost.
prefill_step_time``), plus ``host_step_s`` (default 0) of host time per step (a testbed's
engine loop between forwards; not counted as busy). When the instance shares a host's cores
with others (the cost's ``host``, a ``pddnet.device.cost.SharedHost``; none by default) the
forward is the step's *work*, done at the rate 1 / ``contention()``, re-read every
``contention_tick_s``: a prefill step lasts seconds on a CPU, and the decoders it shares the
cores with start and stop within it (the prompts of the previous step start decoding just as
this one begins).

``export_wait`` (default 0: never) is the share of a step's KV reports that wait for the next
step when P starts one at once (prompts were waiting). On the calibration's CPU testbed the
copy of a finished prompt's KV out of P's pool (to RLD and onto the WAN) runs beside the
engine thread, and when that thread goes straight into the next forward the copy gets through
only once that forward ends (a whole step, seconds there: the first token and the WAN transfer
start that much later, and the delayed prompts reach RLD together with the next step's). A
waiting report is delivered at the next step's end, with that time, before that step's own
reports; which reports wait is drawn from a stream seeded by the chip's and the instance's
names.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pddnet.device.cost import InstanceCost
from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.radix import RadixCache
from pddnet.sim.events import EventLoop

Progress = Callable[[Any, int, float, bool], None]  # (state, computed tokens, time, done)


@dataclass
class _Running:
    """A prompt being prefilled: how far it is, and its cache lock / block table."""

    state: Any
    on_progress: Progress
    pos: int
    handle: Any
    table: list[int] | None
    chunk_end: int = 0  # end of the chunk computing in the current step (0: none)


class PrefillInstance:
    def __init__(
        self,
        loop: EventLoop,
        cost: InstanceCost,
        name: str,
        tokens_per_unit: int,
        block_units: int,
        chunk_tokens: int,
        prefix_cache: bool = True,
        max_seqs: int = 1,
        contention_tick_s: float = 0.05,
        export_wait: float = 0.0,
        host_step_s: float = 0.0,
    ) -> None:
        if chunk_tokens < 1:
            raise ValueError(
                f"{name}: chunk_tokens (a step's token budget) must be >= 1, got {chunk_tokens!r}"
            )
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"{name}: max_seqs must be an int >= 1, got {max_seqs!r}")
        if not contention_tick_s > 0:
            raise ValueError(f"{name}: contention_tick_s must be > 0, got {contention_tick_s!r}")
        if (
            isinstance(export_wait, bool)
            or not isinstance(export_wait, (int, float))
            or not 0 <= export_wait <= 1
        ):
            raise ValueError(f"{name}: export_wait must be a share in [0, 1], got {export_wait!r}")
        if not host_step_s >= 0:
            raise ValueError(f"{name}: host_step_s must be >= 0, got {host_step_s!r}")
        self.loop, self.cost, self.name = loop, cost, name
        self.host_step_s = host_step_s  # each step's host time on top of its forward
        self.export_wait = float(export_wait)
        self._export_rng = random.Random(f"pddnet-sim-export-wait:{cost.chip.name}:{name}")
        self._held: list[tuple[Progress, Any, int, bool]] = []  # reports waiting for a step
        self.exports_held = 0
        self.contention_tick_s = contention_tick_s
        self._work_left = 0.0
        self.q = tokens_per_unit
        self.block_units = block_units
        self.chunk_tokens = chunk_tokens
        self.max_seqs = max_seqs
        self.cache: RadixCache | None = None
        if prefix_cache:
            blocks = cost.kv_capacity_tokens() // (block_units * tokens_per_unit)
            if blocks < 1:
                raise ValueError(f"{name}: no room for a single KV block")
            # Nobody reads P's cache events (only MD's feed P's view): keep no log at all.
            self.cache = RadixCache(BlockAllocator(blocks), block_units, max_pending_events=0)
        self.queue: deque[tuple[Any, Progress]] = deque()
        self.running: list[_Running] = []
        self.busy = False
        self.busy_s = 0.0
        self.steps = 0
        self.tokens_computed = 0
        self.tokens_cached = 0

    @property
    def load(self) -> int:
        return len(self.queue) + len(self.running)

    def submit(self, state: Any, on_progress: Progress) -> None:
        """Queue a prompt; it joins the next step (at once if P is idle)."""
        self.queue.append((state, on_progress))
        if not self.busy:
            self._step()

    # -- steps ------------------------------------------------------------------------------

    def _admit(self, state: Any, on_progress: Progress) -> _Running:
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
        return _Running(state, on_progress, hit, handle, table)

    def _step(self) -> None:
        """Pick the next step's chunks (running prompts first, then waiting ones in order) and
        start it; idle when there is nothing to compute."""
        budget = self.chunk_tokens
        chunks: list[tuple[int, int]] = []
        for r in self.running:
            if budget == 0:
                break
            r.chunk_end = min(r.state.req.prompt_tokens, r.pos + budget)
            chunks.append((r.pos, r.chunk_end))
            budget -= r.chunk_end - r.pos
        while budget > 0 and self.queue and len(self.running) < self.max_seqs:
            r = self._admit(*self.queue.popleft())
            self.running.append(r)
            r.chunk_end = min(r.state.req.prompt_tokens, r.pos + budget)
            chunks.append((r.pos, r.chunk_end))
            budget -= r.chunk_end - r.pos
        if not chunks:
            self.busy = False
            return
        self.busy = True
        dt = self.cost.prefill_step_time(chunks)
        self.steps += 1
        for r in self.running:
            if r.chunk_end:
                self.tokens_computed += r.chunk_end - r.pos
                r.state.last_chunk_tokens = r.chunk_end - r.pos
        if self.cost.host is None:
            self.busy_s += dt
            self.loop.after(dt + self.host_step_s, self._step_done)
            return
        self._work_left = dt
        self._progress()

    def _progress(self) -> None:
        """Shared host: do the step's work at 1 / contention() for a tick (or to its end)."""
        f = self.cost.contention()
        need = self._work_left * f
        if need <= self.contention_tick_s:
            self.busy_s += need
            self.loop.after(need + self.host_step_s, self._step_done)
            return
        self._work_left -= self.contention_tick_s / f
        self.busy_s += self.contention_tick_s
        self.loop.after(self.contention_tick_s, self._progress)

    def _step_done(self) -> None:
        now = self.loop.now
        held, self._held = self._held, []
        for on_progress, state, pos, done in held:  # they waited for this step: out now
            on_progress(state, pos, now, done)
        if self.export_wait > 0:
            self._step_done_holding(now)
            return
        finished = []
        for r in self.running:
            if not r.chunk_end:
                continue
            r.pos, r.chunk_end = r.chunk_end, 0
            if r.pos < r.state.req.prompt_tokens:
                r.on_progress(r.state, r.pos, now, False)
                continue
            if self.cache is not None:
                if r.table is not None:
                    self.cache.insert_finished(r.state.req.units, r.table, r.state.prompt_hashes)
                else:
                    self.cache.unlock(r.handle)
            r.on_progress(r.state, r.pos, now, True)
            finished.append(r)
        if finished:
            gone = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in gone]
        self._step()

    def _step_done_holding(self, now: float) -> None:
        """The step's end with ``export_wait``: the same bookkeeping, but when the next step
        starts at once each report waits for its end with probability ``export_wait``."""
        reports: list[tuple[Progress, Any, int, bool]] = []
        finished = []
        for r in self.running:
            if not r.chunk_end:
                continue
            r.pos, r.chunk_end = r.chunk_end, 0
            done = r.pos >= r.state.req.prompt_tokens
            if done:
                if self.cache is not None:
                    if r.table is not None:
                        self.cache.insert_finished(
                            r.state.req.units, r.table, r.state.prompt_hashes
                        )
                    else:
                        self.cache.unlock(r.handle)
                finished.append(r)
            reports.append((r.on_progress, r.state, r.pos, done))
        if finished:
            ids = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in ids]
        next_at_once = bool(self.running or self.queue)  # what _step() will do
        for rep in reports:
            if next_at_once and self._export_rng.random() < self.export_wait:
                self._held.append(rep)
                self.exports_held += 1
            else:
                rep[0](rep[1], rep[2], now, rep[3])
        self._step()
