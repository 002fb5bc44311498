"""A decode instance with continuous batching, simulated in segments of steps.

Stepping one event per decode step is too slow at datacenter scale (tens of millions of steps),
so the batch advances in *segments*: runs of steps with the same members, ending when a member
finishes, a member joins or is cut, an extend is batched in, or after ``segment_steps`` steps (so
the growing context is re-costed). Inside a segment every step costs the roofline time of the
batch at the segment's middle context; a member's tokens are the steps it was in the batch.

Extend (MD recomputing the tokens RLD generated, then sampling the next one) rides in ordinary
steps as extra tokens, at most the member's ``chunk`` per step: a one-shot handoff is one big
extend step (every other member in the batch sees that longer step: the stall), a streaming
one a few small ones.

Inter-token gaps go into the owner's histogram weighted by how many members saw them, so the
cost per segment does not grow with the batch size. A member's first gap on this instance is
measured from the user-visible time of its previous token (``prev_user``), which is how the
handoff gap (RLD's last token to MD's first) and the first-token gap are counted.

An instance across the WAN from the user (MD, cross-DC's D) delivers each step's tokens through
a ``TokenDelivery``: the line's one-way delay plus a jitter draw per step, under the line's
in-order rule, as the live WAN delays the write that carries them. Its steps' gaps then differ
(one per step, still not per member); without jitter every gap of a segment is its step time.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from collections import deque
from collections.abc import Callable
from typing import Any

from pddnet.device.cost import InstanceCost
from pddnet.sim.events import EventLoop
from pddnet.sim.metrics import Histogram


class Member:
    """A request on one decode instance."""

    __slots__ = (
        "state",
        "ctx0",
        "remaining",
        "join_step",
        "finish_step",
        "prev_user",
        "alive",
        "extend_left",
        "extend_chunk",
        "extend_final",
        "extend_done",
        "on_finish",
        "on_digested",
        "cut_requested",
        "extra_made",
    )

    def __init__(
        self,
        state: Any,
        context: int,
        remaining: int,
        prev_user: float,
        on_finish: Callable[[Member, float, int], None],
    ) -> None:
        self.state = state
        self.ctx0 = context  # context tokens when it joins the batch
        self.remaining = remaining  # tokens it still decodes here (one per step)
        self.join_step = -1
        self.finish_step = -1
        self.prev_user = prev_user  # user-visible time of its previous token
        self.alive = True
        self.extend_left = 0
        self.extend_chunk = 0
        self.extend_final = False
        self.extend_done = 0  # tokens digested so far
        self.on_finish = on_finish  # (member, time, tokens made here)
        self.on_digested: Callable[[Member, float], None] | None = None
        self.cut_requested = False
        self.extra_made = 0  # tokens sampled by final extend steps


class TokenDelivery:
    """When a step's tokens reach the user: ``delay_s`` after the step and, with ``jitter_ms``,
    a draw from the line's jitter (normal and uncorrelated: the simulator's line has no other
    kind; the same draws as emulation.effects.JitterSource's) held to the line's in-order
    rule: a step's tokens never arrive before the previous step's. As the live WAN treats the
    write carrying them (one per step: MD writes a step's tokens together); the in-order floor
    is this instance's own, where the live line's is shared by all its traffic. Calls to
    ``arrive`` must come in step order."""

    def __init__(self, delay_s: float = 0.0, jitter_ms: float = 0.0, seed: object = "") -> None:
        if not delay_s >= 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s!r}")
        if not jitter_ms >= 0:
            raise ValueError(f"jitter_ms must be >= 0, got {jitter_ms!r}")
        self.delay_s = delay_s
        self.jitter_ms = jitter_ms
        self.jittered = jitter_ms > 0
        self._rng = random.Random(f"{seed}:tokens")
        self._last = -math.inf

    def arrive(self, emitted: float) -> float:
        """User-visible time of tokens a step emits at ``emitted``."""
        return self.arrivals(emitted, 0.0, 1)[0]

    def arrivals(self, t0: float, tau: float, count: int) -> list[float]:
        """User-visible times of ``count`` steps' tokens, emitted at t0, t0 + tau, ..."""
        delay = self.delay_s
        if not self.jittered:
            return [t0 + j * tau + delay for j in range(count)]
        jitter, last = self.jitter_ms / 1e3, self._last
        out: list[float] = []
        gauss, append = self._rng.gauss, out.append  # (tens of millions of draws at scale)
        for j in range(count):
            d = delay + jitter * gauss()
            own = t0 + j * tau + (d if d > 0.0 else 0.0)
            if own > last:
                last = own
            append(last)
        self._last = last
        return out


class DecodeInstance:
    def __init__(
        self,
        loop: EventLoop,
        cost: InstanceCost,
        name: str,
        max_seqs: int,
        user_delay_s: float,
        itl: Histogram,
        handoff_gap: Histogram | None = None,
        segment_steps: int = 32,
        host_step_s: float = 0.0,
        jitter_ms: float = 0.0,
        seed: object = 0,
    ) -> None:
        if max_seqs < 1:
            raise ValueError(f"max_seqs must be >= 1, got {max_seqs!r}")
        if not host_step_s >= 0:
            raise ValueError(f"host_step_s must be >= 0, got {host_step_s!r}")
        self.loop, self.cost, self.name = loop, cost, name
        # each step's host time on top of its forward: in the step's length, not in the
        # estimate a policy gets (step_time_estimate) nor in busy_s (the device's)
        self.host_step_s = host_step_s
        self.max_seqs = max_seqs
        self.user_delay_s = user_delay_s
        self.delivery = TokenDelivery(user_delay_s, jitter_ms, f"{seed}:{name}")
        # user-visible times of steps _arr_s0, _arr_s0 + 1, ... drawn so far (jittered only)
        self._arr: list[float] = [math.nan]
        self._arr_s0 = 0
        self.itl = itl
        self.handoff_gap = handoff_gap
        self.segment_steps = segment_steps
        self.step = 0  # steps completed
        self.seg_t0 = 0.0
        self.seg_s0 = 0
        self.seg_end = 0  # step at which the current segment ends
        self.tau = 0.0
        self.busy = False
        self._token = 0
        self._seq = itertools.count()
        self._heap: list[tuple[int, int, Member]] = []
        self.n = 0  # members decoding
        self._ctx_base = 0  # sum(ctx0 - join_step) over decoding members
        self._pending: list[Member] = []
        self._waiting: deque[Member] = deque()
        self._fresh: list[Member] = []
        self._dropped: list[Member] = []  # stopped in the segment's last step: no token there
        self._extending: list[Member] = []
        self._step_extend: list[tuple[Member, int]] = []
        self.busy_s = 0.0
        self.tokens = 0
        self.steps = 0

    # -- what the flow calls --------------------------------------------------------------------

    @property
    def load(self) -> int:
        return self.n + len(self._pending) + len(self._waiting) + len(self._extending)

    def add(self, m: Member) -> None:
        """Join the batch at the next step boundary (first token at the end of that step)."""
        if m.remaining <= 0:
            raise ValueError("a member must have tokens to decode")
        self._pending.append(m)
        self._cut_segment()

    def extend(
        self,
        m: Member,
        tokens: int,
        chunk: int,
        final: bool,
        on_digested: Callable[[Member, float], None] | None = None,
    ) -> None:
        """Recompute `tokens` handed-off tokens, at most `chunk` per step. With `final`, the
        last extend step samples the member's next token and it decodes on (``m.remaining``
        more tokens after that one); otherwise ``on_digested`` is called once digested."""
        if tokens <= 0 and final and m.extend_left <= 0:
            # nothing left to recompute: it decodes its next token in an ordinary step
            if m in self._extending:
                self._extending.remove(m)
            m.ctx0 += m.extend_done
            m.remaining += 1
            self.add(m)
            return
        m.extend_left += tokens
        m.extend_chunk = max(1, chunk)
        m.extend_final = final
        m.on_digested = on_digested
        if m not in self._extending:
            self._extending.append(m)
        self._cut_segment()

    def cut(self, m: Member) -> None:
        """Stop the member at the next step boundary (RLD's side of a handoff)."""
        if not m.alive or m.cut_requested:
            return
        m.cut_requested = True
        self._cut_segment()
        if m.join_step >= 0:
            stop = min(m.finish_step, max(self.seg_end, m.join_step))
            if stop != m.finish_step:
                m.finish_step = stop
                heapq.heappush(self._heap, (stop, next(self._seq), m))

    def stop(self, m: Member, t: float) -> tuple[int, float]:
        """Stop the member at ``t`` (RLD's final cut, as the daemon makes it: the HANDOFF
        leaves when TAKEOVER arrives, and the token of the step in flight is dropped, MD
        produces it). Returns (tokens it made here by ``t``, user-visible time of its last
        token). The step in flight still runs for the batch; the member leaves at its end
        without ``on_finish``: the caller has taken its count."""
        made = self.tokens_made(m, t)
        if made > 0:
            # made > 0 while still in the batch: its last token ended the step `done`, inside
            # the current segment (steps before it ended before the segment began)
            last = self._user_time(m.join_step + made)
        else:
            last = m.prev_user
        m.on_finish = _stopped
        self.cut(m)
        if m.join_step >= 0 and m.finish_step - m.join_step > made:
            self._dropped.append(m)  # in the batch for the step in flight, whose token is MD's
        return made, last

    def drop(self, m: Member) -> None:
        """Remove a member without finishing it (its request ended elsewhere)."""
        if not m.alive:
            return
        m.alive = False
        if m in self._extending:
            self._extending.remove(m)
        if m in self._pending:
            self._pending.remove(m)
        elif m in self._waiting:
            self._waiting.remove(m)
        elif m.join_step >= 0:
            self.n -= 1
            self._ctx_base -= m.ctx0 - m.join_step
            self._cut_segment()

    def tokens_made(self, m: Member, t: float) -> int:
        """Tokens the member has produced here by time t (steps completed since it joined)."""
        if m.join_step < 0:
            return 0
        done = self.step
        if self.busy and self.tau > 0 and t > self.seg_t0:
            done = min(self.seg_end, self.seg_s0 + int((t - self.seg_t0) / self.tau + 1e-9))
        return max(0, min(done, m.finish_step) - m.join_step)

    def step_time_estimate(self, extra_context: int = 0) -> float:
        """Cost of one step if a member with `extra_context` joined now."""
        ctx = self._ctx_base + self.n * self.step + extra_context
        # the mean, not a draw: a policy's estimate must not consume the step-jitter stream
        return self.cost.decode_step_time(self.n + 1, ctx, jitter=False)

    # -- segments -------------------------------------------------------------------------------

    def _cut_segment(self) -> None:
        """Something changes at the next step boundary: end the segment there."""
        now = self.loop.now
        if not self.busy:
            self.busy = True
            self.seg_t0, self.seg_s0, self.seg_end, self.tau = now, self.step, self.step, 0.0
            self._token += 1
            self.loop.at(now, self._end_segment, self._token)
            return
        if self.tau <= 0:
            return  # a boundary is already due now
        j = int((now - self.seg_t0) / self.tau + 1e-9)
        boundary = self.seg_s0 + j + 1
        if boundary < self.seg_end:
            self.seg_end = boundary
            self._token += 1
            self.loop.at(self.seg_t0 + (j + 1) * self.tau, self._end_segment, self._token)

    def _end_segment(self, token: int) -> None:
        if token != self._token:
            return
        now = self.loop.now
        k = self.seg_end - self.seg_s0
        tau = self.tau
        if k > 0:
            self._account(k, tau, now)
        self._fresh = []
        self.step = self.seg_end
        s1 = self.step
        # members whose tokens ran out (or were cut) at this boundary
        heap = self._heap
        while heap and heap[0][0] <= s1:
            fs, _, m = heapq.heappop(heap)
            if not m.alive or fs != m.finish_step:
                continue
            self._leave(m, now)
        # extend progress of the step that just ended
        for m, chunk in self._step_extend:
            if not m.alive:
                continue
            m.extend_left -= chunk
            m.extend_done += chunk
            if m.extend_left > 0:
                continue
            self._extending.remove(m)
            if m.extend_final:
                # the extend step sampled the member's next token: it emits now and decodes on
                user = self._user_time(s1) if self.delivery.jittered else now + self.user_delay_s
                gap = user - m.prev_user
                self.itl.add(gap)
                if self.handoff_gap is not None:
                    self.handoff_gap.add(gap)
                m.prev_user = user
                m.ctx0 += m.extend_done + 1
                m.extra_made += 1
                if m.remaining <= 0:
                    m.alive = False
                    m.on_finish(m, now, m.extra_made)
                else:
                    self._join(m, s1, fresh=False)
            elif m.on_digested is not None:
                m.on_digested(m, now)
        self._step_extend = []
        for m in self._pending:
            if self.n < self.max_seqs:
                self._join(m, s1, fresh=True)
            else:
                self._waiting.append(m)
        self._pending = []
        while self._waiting and self.n < self.max_seqs:
            self._join(self._waiting.popleft(), s1, fresh=True)
        self._plan(now)

    def _join(self, m: Member, s1: int, fresh: bool) -> None:
        if m.cut_requested:  # cut before it ever ran here: it made nothing
            m.alive = False
            m.on_finish(m, self.loop.now, m.extra_made)
            return
        m.join_step = s1
        m.finish_step = s1 + m.remaining
        self.n += 1
        self._ctx_base += m.ctx0 - s1
        heapq.heappush(self._heap, (m.finish_step, next(self._seq), m))
        if fresh:
            self._fresh.append(m)

    def _leave(self, m: Member, now: float) -> None:
        made = m.finish_step - m.join_step
        self.n -= 1
        self._ctx_base -= m.ctx0 - m.join_step
        m.alive = False
        if made > 0:
            m.prev_user = (
                self._user_time(self.step) if self.delivery.jittered else now + self.user_delay_s
            )
        m.on_finish(m, now, made + m.extra_made)
        while self._waiting and self.n < self.max_seqs:
            # slots freed: waiting members join at this boundary
            w = self._waiting.popleft()
            self._join(w, self.step, fresh=True)

    def _user_time(self, step: int) -> float:
        """When the tokens of ``step`` (one of the current segment's, or the step it began
        after) reach the user."""
        if not self.delivery.jittered:
            return self.seg_t0 + (step - self.seg_s0) * self.tau + self.user_delay_s
        arr, i = self._arr, step - self._arr_s0
        if not 0 <= i <= self.seg_end - self._arr_s0:
            raise ValueError(f"step {step} is outside the segment {self.seg_s0}..{self.seg_end}")
        if len(arr) <= i:  # draw every step up to it, in order
            first = self._arr_s0 + len(arr) - self.seg_s0  # (steps after the segment's start)
            t0 = self.seg_t0 + first * self.tau
            arr.extend(self.delivery.arrivals(t0, self.tau, i + 1 - len(arr)))
        return arr[i]

    def segment_gaps(self, k: int, tau: float) -> list[float]:
        """The user-visible gaps between the k steps of the segment ending now, the first one
        from the step before it: every one ``tau`` unless delivery jitters."""
        if not self.delivery.jittered:
            return [tau] * k
        self._user_time(self.seg_s0 + k)  # draws the segment's steps
        i0 = self.seg_s0 - self._arr_s0
        times = self._arr[i0 : i0 + k + 1]
        return [b - a for a, b in zip(times, times[1:], strict=False)]

    def member_gaps(self, m: Member, k: int, gaps: list[float]) -> list[float]:
        """The gaps member ``m`` saw in the segment of k steps ending now (``gaps``: its
        ``segment_gaps``): a fresh member's first is from its previous token, and a member
        stopped in the last step saw no token there. ``_account`` counts the same in bulk."""
        fresh, dropped = m in self._fresh, m in self._dropped
        seen = gaps[1 if fresh else 0 : k - 1 if dropped else k]
        if fresh and not (dropped and k == 1):
            seen.insert(0, max(0.0, self._user_time(self.seg_s0 + 1) - m.prev_user))
        return seen

    def _account(self, k: int, tau: float, now: float) -> None:
        """ITL and token counts of a finished segment of k steps with constant membership (the
        step in flight when a member was stopped ran for the batch, but its token was dropped)."""
        n, fresh, dropped = self.n, self._fresh, self._dropped
        # members that saw the first step's gap, and those of them stopped in the last step
        first = n - len(fresh)
        last = len(dropped) if k > 1 else sum(1 for m in dropped if m not in fresh)
        if self.delivery.jittered:  # a weight per step: the members that saw that gap
            gaps = self.segment_gaps(k, tau)
            if k == 1:
                self.itl.add(gaps[0], first - last)
            else:
                self.itl.add(gaps[0], first)
                self.itl.add_each(gaps[1:-1], n)
                self.itl.add(gaps[-1], n - last)
        else:
            steady = n * k - len(fresh) - last
            if steady > 0:
                self.itl.add(tau, steady)
        first_user = self._user_time(self.seg_s0 + 1)
        for m in fresh:  # their first token here: the gap from their previous one
            if k == 1 and m in dropped:
                continue
            self.itl.add(max(0.0, first_user - m.prev_user))
        self._dropped = []
        self.tokens += n * k
        self.steps += k
        self.busy_s += k * (tau - self.host_step_s)

    def _plan(self, now: float) -> None:
        if self.n == 0 and not self._extending:
            self.busy = False
            self.tau = 0.0
            return
        s1 = self.step
        ext_tokens, ext_pairs, ext_ctx = 0, 0.0, 0
        self._step_extend = []
        for m in self._extending:
            c = min(m.extend_chunk, m.extend_left)
            if c <= 0:
                continue
            self._step_extend.append((m, c))
            ext_tokens += c
            ctx = m.ctx0 + m.extend_done
            ext_pairs += c * (ctx + c / 2)
            ext_ctx += ctx
        if ext_tokens or self._pending:
            k = 1
        else:
            k = self.segment_steps
            heap = self._heap
            while heap and (not heap[0][2].alive or heap[0][0] != heap[0][2].finish_step):
                heapq.heappop(heap)
            if heap:
                k = max(1, min(k, heap[0][0] - s1))
        ctx_mid = self._ctx_base + self.n * (s1 + (k - 1) / 2)
        tau = (
            self.cost.decode_step_time(
                self.n,
                ctx_mid,
                ext_tokens,
                ext_pairs,
                extend_seqs=len(self._step_extend),
                extend_context=ext_ctx,
            )
            + self.host_step_s
        )
        if self.delivery.jittered:  # keep only the step this segment begins after
            self._arr = [
                self._arr[s1 - self._arr_s0] if s1 - self._arr_s0 < len(self._arr) else math.nan
            ]
            self._arr_s0 = s1
        self.seg_t0, self.seg_s0, self.seg_end, self.tau = now, s1, s1 + k, tau
        self._token += 1
        self.loop.at(now + k * tau, self._end_segment, self._token)


def _stopped(m: Member, t: float, made: int) -> None:
    """on_finish of a member ``stop`` took out: its count was taken when it was stopped."""
