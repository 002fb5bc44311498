"""One simulated system serving one workload: the request flow of docs/architecture.md.

Systems (same workload, same seed):
- ``same-dc``: homogeneous PD in datacenter A (the baseline): P -> D over RDMA, D keeps a
  prefix cache, tokens reach the user with no WAN in between.
- ``cross-dc``: naive cross-datacenter PD: P in A, MD in B, every request P -> MD over the WAN
  (incremental KV thanks to MD's DRC); the user waits for the KV crossing. In this model it is
  also "PDD without RLD" (``pdd-no-rld`` is an alias).
- ``pdd``: the full design: P's pipeline choice (the daemons' PipelinePlanner: PipelinePolicy
  with P's DecodeCacheView of MD's RadixCache, the WAN estimators fed as the daemons feed them,
  and each P's backlog of unacknowledged WAN KV bytes), RLD admission (RelayAdmission), eager
  RLD decoding, token-id handoff (HandoffPolicy), DRC on MD.
- ``pdd-no-drc``: PDD with MD caching nothing, so the whole KV of every prompt crosses.
- ``cross-dc-no-drc``: cross-dc without the DRC (the whole prompt's KV crosses for every
  request): against ``cross-dc`` it isolates the DRC's bandwidth cut.

What crosses the WAN goes through ``WanLine`` (the emulator's link model): KV pieces and every
control message (KV_ALLOC request and answer with the piggy-backed CACHE_EVENTS, TAKEOVER,
HANDOFF with token ids, cancel). Tokens MD emits reach the router in A one line delay later.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from pddnet.device.cost import InstanceCost
from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.block_hash import chained_hashes
from pddnet.kv.cache_events import CacheEventBatch
from pddnet.kv.hit_histogram import HIT_INTERVAL_LABELS
from pddnet.kv.prefix_cache import PrefixMatch
from pddnet.kv.radix import RadixCache
from pddnet.policy.admission import RelayAdmission
from pddnet.policy.cache_view import DecodeCacheView, HitPrediction
from pddnet.policy.estimators import BandwidthEstimator, RttEstimator, WanBacklog
from pddnet.policy.handoff import HandoffMode, HandoffPolicy
from pddnet.policy.pipeline import Pipeline, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner
from pddnet.sim.config import Deployment, SimConfig
from pddnet.sim.decode import DecodeInstance, Member
from pddnet.sim.events import EventLoop
from pddnet.sim.handoff import (
    TAKEOVER_CUT,
    TAKEOVER_PARK,
    first_cut,
    md_extend_chunk,
    takeover_step,
)
from pddnet.sim.metrics import Histogram, Series
from pddnet.sim.prefill import PrefillInstance
from pddnet.sim.wan import Transfer, WanLine
from pddnet.workload.units import SimRequest

# Conversations whose last prompt's chained block hashes are kept, so a next turn (its prompt
# extends the previous one) hashes only what it appends. Speed only: the hashes are the same.
HASH_MEMO_CONVERSATIONS = 1 << 12

# Control message sizes on the wire (bytes): a header, plus payload where it has one.
HEADER_BYTES = 64
TOKEN_ID_BYTES = 4
HASH_BYTES = 8


@dataclass(slots=True, eq=False)
class ReqState:
    """The simulator's record of one request as it moves through the system."""

    req: SimRequest
    p: int = 0  # its prefill instance, MD and RLD (set when it arrives)
    md_idx: int = 0
    rld_idx: int = -1
    pipeline: Pipeline | None = None
    first_user: float = -1.0
    last_user: float = -1.0
    rld_tokens: int = 0
    md_tokens: int = 0
    finished: bool = False
    transfer: Transfer | None = None
    table: list[int] | None = None
    handle: PrefixMatch | None = None
    prediction: HitPrediction | None = None
    md_hit: int = 0
    p_hit: int = 0
    p_progress: int = 0
    prefill_done: float = -1.0
    prefill_start: float = -1.0
    last_chunk_tokens: int = 0
    alloc_sent: float = 0.0
    md_member: Member | None = None
    rld_member: Member | None = None
    mode: HandoffMode | None = None
    sent_ids: int = 0
    rld_started: bool = False
    takeover_pending: bool = False
    md_allocated: bool = False
    kv_at_md: bool = False
    rld_done: bool = False
    wan_bytes: int = 0
    p_estimate: float = 0.0
    # chained hashes of the prompt's full blocks (set on arrival when a cache uses them)
    prompt_hashes: list[int] | None = None


class DecodeSide:
    """A decode instance plus its KV pool: MD (with the DRC) or the baseline's D."""

    def __init__(self, inst: DecodeInstance, cache: RadixCache, use_cache: bool) -> None:
        self.inst = inst
        self.cache = cache
        self.use_cache = use_cache
        self.waiting: list[ReqState] = []


class SimulatedSystem:
    def __init__(self, config: SimConfig, system: str) -> None:
        if system == "pdd-no-rld":
            system = "cross-dc"
        self.cfg = config
        self.system = system
        self.loop = EventLoop()
        c, e, pol = config, config.engine, config.policy
        self.q = c.tokens_per_unit
        self.block_units = max(1, e.block_tokens // self.q)
        self.block_tokens = self.block_units * self.q
        self.kvpt = c.model.kv_bytes_per_token
        self.cross = system != "same-dc"
        self.use_rld = system in ("pdd", "pdd-no-drc")
        self.use_drc = system not in ("pdd-no-drc", "cross-dc-no-drc")
        dep: Deployment = c.pdd if self.cross else c.baseline
        self.deployment = dep
        # statistics
        self.ttft = Histogram()
        self.tpot = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.handoff_gap = Histogram()
        self.ttft_by_pipeline = {p.value: Histogram() for p in Pipeline}
        self.deferral = Histogram()  # how long deferred turns waited for their predecessor
        self.rld_depth = Series(interval_s=0.5, max_points=512)
        self.pipelines = {p.value: 0 for p in Pipeline}
        self.handoffs = {HandoffMode.ONE_SHOT.value: 0, HandoffMode.STREAMING.value: 0}
        self.counts = {
            "requests": 0,
            "finished": 0,
            "good": 0,
            "rld_tokens": 0,
            "md_tokens": 0,
            "prompt_tokens": 0,
            "md_hit_tokens": 0,
            "p_hit_tokens": 0,
            "cancelled_transfers": 0,
            "md_alloc_waits": 0,
            "rld_refused": 0,
            "overlapping_turns": 0,
            "deferred_turns": 0,
        }
        self.first_arrival: float | None = None
        self.last_arrival = 0.0
        self.last_done = 0.0
        owd = c.line.rtt_ms / 2
        if self.cross:
            self.wan = WanLine(
                self.loop,
                rate_mbit=c.line.bw_gbit * 1e3,
                delay_ms=owd,
                jitter_ms=c.line.jitter_ms,
                queue_bytes=None if c.line.queue_mb is None else int(c.line.queue_mb * (1 << 20)),
                piece_bytes=c.line.piece_bytes(),
                seed=c.seed,
            )
            self.bw_est = BandwidthEstimator(initial_bps=c.line.bw_gbit * 1e9 / 8)
            self.rtt_est = RttEstimator(initial_s=max(c.line.rtt_ms, 0.01) / 1e3)
        mu = e.memory_utilisation
        pc = InstanceCost(dep.prefill.chip, c.model, dep.prefill.gpus, mu)
        host_step = e.host_latency_per_step_us / 1e6
        self.prefill = [
            PrefillInstance(
                self.loop,
                pc,
                f"P{i}",
                self.q,
                self.block_units,
                e.chunk_tokens,
                e.p_prefix_cache,
                max_seqs=e.p_max_seqs,
                host_step_s=host_step,
            )
            for i in range(dep.prefill.instances)
        ]
        self.rdma_latency = e.rdma_latency_us / 1e6
        self.host_latency = e.host_latency_us / 1e6
        self.host_latency_per_token = e.host_latency_per_token_us / 1e6
        dc = InstanceCost(dep.decode.chip, c.model, dep.decode.gpus, mu)
        user_delay = owd / 1e3 if self.cross else 0.0
        blocks = dc.kv_capacity_tokens() // self.block_tokens
        self.decode = [
            DecodeSide(
                DecodeInstance(
                    self.loop,
                    dc,
                    f"D{i}",
                    e.max_seqs,
                    user_delay,
                    self.itl,
                    self.handoff_gap,
                    e.segment_steps,
                    host_step,
                    jitter_ms=c.line.jitter_ms if self.cross else 0.0,
                    seed=c.seed,
                ),
                RadixCache(BlockAllocator(blocks), self.block_units),
                self.use_drc,
            )
            for i in range(dep.decode.instances)
        ]
        self.views = [DecodeCacheView(max_hashes=max(1024, blocks)) for _ in self.decode]
        self._hashing = e.p_prefix_cache or self.use_drc  # a cache names blocks by hashes
        self.relay: list[DecodeInstance] = []
        self.admission: list[RelayAdmission] = []
        if self.use_rld:
            if dep.relay is None:
                raise ValueError(f"system {system!r} needs a [pdd].relay pool")
            rc = InstanceCost(dep.relay.chip, c.model, dep.relay.gpus, mu)
            cap = rc.kv_capacity_tokens()
            for i in range(dep.relay.instances):
                self.relay.append(
                    DecodeInstance(
                        self.loop,
                        rc,
                        f"RLD{i}",
                        e.max_seqs,
                        0.0,
                        self.itl,
                        None,
                        e.segment_steps,
                        host_step,
                    )
                )
                self.admission.append(
                    RelayAdmission(
                        max_running_tokens=cap,
                        max_blocks=max(1, cap // e.block_tokens),
                        max_requests=pol.rld_max_requests,
                    )
                )
        self.pipeline_policy = PipelinePolicy(
            pol.direct_budget_s, pol.singular_filter, pol.singular_margin
        )
        # P's planning is the daemons' PipelinePlanner, one per (P, MD) pair (a P daemon plans
        # towards its MD), created on first use. The pair's planner holds that MD's view (shared
        # by every P: the simulated views are per MD) and the line's estimators (shared too);
        # its backlog is the P's own unacknowledged WAN KV bytes, towards any MD: they all
        # leave P on the one line ahead of its next request's.
        self.wan_backlogs = [WanBacklog() for _ in self.prefill] if self.cross else []
        self.planners: dict[tuple[int, int], PipelinePlanner] = {}
        self.handoff_policy = HandoffPolicy(
            HandoffMode.parse(pol.handoff),
            pol.handoff_threshold,
            pol.handoff_chunk,
            pol.rld_load_limit,
        )
        self._p_of: dict[int, tuple[int, int]] = {}  # conversation -> (P, last prompt tokens)
        self._d_of: dict[int, int] = {}
        # The routers' load signals, kept up to date instead of scanned per arrival: estimated
        # prefill seconds routed to each P and not done yet; requests on each MD / D.
        self._p_backlog = [0.0] * len(self.prefill)
        self._d_load = [0] * len(self.decode)
        self._rld_held = 0
        self._hash_memo: OrderedDict[int, tuple[tuple[int, ...], list[int]]] = OrderedDict()
        self.on_request_done: Any = None  # the runner's hook: a conversation may go on
        # with a list: every plan P's planner makes, as the daemons' `pdd.pipeline_decision`
        # (PipelineDecision.record) with the request's rid (pdd bench reproduce compares them)
        self.plan_records: list[dict[str, Any]] | None = None
        # with a list: every finished request's own figures (its rid, TTFT, TPOT, end to end,
        # pipeline, tokens by tier), so that a benchmark beside the simulator can take its
        # statistics over the requests the way it takes the live ones (the histograms' are
        # bucketed nearest-rank quantiles, built for millions of requests)
        self.request_records: list[dict[str, Any]] | None = None

    # -- routing ----------------------------------------------------------------------------

    def _route_decode(self, conv: int) -> int:
        """MD / D: the conversation's instance (its prefix is cached there), else the one with
        the fewest requests (a counter per instance, so one C-speed ``min``)."""
        if conv >= 0:
            j = self._d_of.get(conv)
            if j is not None:
                return j
        loads = self._d_load
        i = loads.index(min(loads))
        if conv >= 0:
            self._d_of[conv] = i
        return i

    def _route_prefill(self, req: SimRequest) -> tuple[int, float]:
        """P: cache-aware by estimated work. The conversation's P (where its previous prompt
        is likely cached) unless starting on the least backlogged P, without that prefix,
        would give the first token sooner. Returns (instance, estimated prefill seconds)."""
        backlog = self._p_backlog
        i = backlog.index(min(backlog))
        cost = self.prefill[i].cost
        chunk = self.cfg.engine.chunk_tokens
        n = req.prompt_tokens
        fresh = cost.prefill_time(0, n, chunk)
        conv = req.conversation
        j, cached = self._p_of.get(conv, (-1, 0)) if conv >= 0 else (-1, 0)
        if j >= 0:
            cached = min(cached, n - 1)
            warm = cost.prefill_time(cached, n, chunk)
            if backlog[j] + warm <= backlog[i] + fresh:
                i, fresh = j, warm
        if conv >= 0:
            self._p_of[conv] = (i, n)
        return i, fresh

    # -- arrival ----------------------------------------------------------------------------

    def arrive(self, req: SimRequest) -> None:
        """The client sends ``req`` now (its TTFT counts from here); it enters the system once
        the host path is done ([engine] host_latency_us + host_latency_per_token_us x prompt)."""
        now = self.loop.now
        self.counts["requests"] += 1
        self.counts["prompt_tokens"] += req.prompt_tokens
        if self.first_arrival is None:
            self.first_arrival = now
        self.last_arrival = now
        host = self.host_latency + self.host_latency_per_token * req.prompt_tokens
        if host > 0:
            self.loop.at(now + host, self._enter, req)
        else:
            self._enter(req)

    def _enter(self, req: SimRequest) -> None:
        """``req`` reaches the routers: P's and MD's chosen, the pipeline planned, P queues it
        and (cross-DC) its KV_ALLOC leaves for MD."""
        now = self.loop.now
        st = ReqState(req)
        st.p, st.p_estimate = self._route_prefill(req)
        st.md_idx = self._route_decode(req.conversation)
        if self._hashing:
            st.prompt_hashes = self._hashes_for(req.conversation, req.units)
        self._p_backlog[st.p] += st.p_estimate
        self._d_load[st.md_idx] += 1
        if not self.cross:
            st.pipeline = Pipeline.P_MD
            self._alloc(st)
        else:
            st.pipeline = self._choose_pipeline(st)
            if st.pipeline is not Pipeline.RLD_ONLY:
                st.alloc_sent = now
                self.wan.message(
                    "a_to_b", HEADER_BYTES + TOKEN_ID_BYTES * req.prompt_tokens, self._md_alloc, st
                )
        self.pipelines[st.pipeline.value] += 1
        self.prefill[st.p].submit(st, self._on_prefill)

    def _choose_pipeline(self, st: ReqState) -> Pipeline:
        req = st.req
        if not self.use_rld:
            return Pipeline.P_MD
        planner = self.planner(st.p, st.md_idx)
        r = min(range(len(self.relay)), key=lambda i: (self.admission[i].load, i))
        # what RLD's last allocation answer would have told P (KV_ALLOC_RESPONSE.step_s)
        planner.observe_rld_step(self.relay[r].step_time_estimate(req.prompt_tokens))
        if self.use_drc:
            # predicted from the hashes kept per conversation (the view counts in units)
            assert st.prompt_hashes is not None, "use_drc: hashed on arrival"
            st.prediction = planner.view.predict_from_hashes(
                len(req.units), st.prompt_hashes, self.block_units
            )
            plan = planner.plan_predicted(
                req.prompt_tokens,
                st.prediction,
                req.output_tokens,
                hit_tokens=min(st.prediction.hit_tokens * self.q, req.prompt_tokens),
            )
        else:
            plan = planner.plan_predicted(
                req.prompt_tokens, HitPrediction(len(req.units), 0, (), 0, False), req.output_tokens
            )
        if self.plan_records is not None:
            self.plan_records.append({"rid": req.rid, **plan.decision.record(plan.inputs)})
        if plan.pipeline is Pipeline.P_MD:
            return Pipeline.P_MD
        total, block = req.prompt_tokens + req.output_tokens, self.cfg.engine.block_tokens
        # as RLD admits (RelayDaemon._alloc): requests it will finish alone (the singular
        # filter's) may hold only their share of it
        adm = self.admission[r].try_admit(
            str(req.rid),
            total,
            -(-(total - 1) // block),
            singular=plan.pipeline is Pipeline.RLD_ONLY,
        )
        if not adm.admitted:
            # as the prefill daemon does: RLD refused, so P->MD (wait for the KV on MD)
            self.counts["rld_refused"] += 1
            if self.plan_records is not None:
                self.plan_records[-1]["rld_refused"] = True
            return Pipeline.P_MD
        st.rld_idx = r
        self._rld_held += 1
        self.rld_depth.observe(self.loop.now, self._rld_held)
        return plan.pipeline

    def planner(self, p: int, md: int) -> PipelinePlanner:
        """P ``p``'s planner towards MD ``md`` (see __init__)."""
        planner = self.planners.get((p, md))
        if planner is None:
            planner = self.planners[(p, md)] = PipelinePlanner(
                self.pipeline_policy,
                self.kvpt,
                self.bw_est.initial_bps,
                view=self.views[md],
                bandwidth=self.bw_est,
                rtt=self.rtt_est,
                backlog=self.wan_backlogs[p],
            )
        return planner

    def _with_kv_hashes(self, st: ReqState, with_kv: tuple[int, ...]) -> list[int]:
        """The chained hashes of what a finished request leaves in MD's tree (its prompt, then
        its output): the prompt's, kept since it arrived, extended by the blocks after them."""
        bs = self.block_units
        hashes = st.prompt_hashes
        assert hashes is not None, "a cache is on: hashed on arrival"
        done = len(st.req.units) // bs  # (the kept list may have grown since: appends only)
        return hashes[:done] + chained_hashes(
            with_kv[done * bs :], bs, hashes[done - 1] if done else 0
        )

    def _hashes_for(self, conv: int, units: tuple[int, ...]) -> list[int]:
        """Chained hashes of the full blocks of ``units`` (the caches' block size), extending
        the ones kept for the conversation when ``units`` starts with what they hashed, and
        kept for its next turn. Lists handed out are only ever appended to, so a holder's first
        hashes stay valid. (Besides hashing once, not three times, this gives P's and MD's
        trees and P's view the same hash objects: dict lookups of equal keys then stop at
        identity instead of comparing two ints far apart in memory.)"""
        bs = self.block_units
        memo = self._hash_memo
        known = memo.pop(conv, None) if conv >= 0 else None
        if known is not None and len(units) >= len(known[0]) and units[: len(known[0])] == known[0]:
            hashes = known[1]
            done = len(hashes)
            hashes += chained_hashes(units[done * bs :], bs, hashes[-1] if done else 0)
        else:
            hashes = chained_hashes(units, bs)
        if conv >= 0:
            memo[conv] = (units, hashes)
            if len(memo) > HASH_MEMO_CONVERSATIONS:
                memo.popitem(last=False)
        return hashes

    # -- P --------------------------------------------------------------------------------------

    def _on_prefill(self, st: ReqState, computed: int, t: float, done: bool) -> None:
        st.p_progress = computed
        if st.transfer is not None:
            self.wan.make_sendable(st.transfer, (computed - st.md_hit) * self.kvpt)
        if not done:
            return
        st.prefill_done = t
        # max(): float sums do not cancel exactly, and an idle P must not look busy
        self._p_backlog[st.p] = max(0.0, self._p_backlog[st.p] - st.p_estimate)
        self.counts["p_hit_tokens"] += st.p_hit
        if st.pipeline is Pipeline.P_MD and self.cross:
            return  # the WAN transfer carries it on
        # RDMA to RLD (all of the prompt's KV) or to D (what D's cache lacks); chunks left as
        # they were computed, so the last one arrives a chunk's transfer after the prefill.
        nbytes = (st.req.prompt_tokens - (st.md_hit if not self.cross else 0)) * self.kvpt
        bw = self.prefill[st.p].cost.rdma_bytes_per_s
        arrive = (
            max(t + st.last_chunk_tokens * self.kvpt / bw, st.prefill_start + nbytes / bw)
            + self.rdma_latency
        )
        if self.cross:
            self.loop.at(arrive, self._rld_start, st)
        else:
            st.wan_bytes = 0
            self.loop.at(arrive, self._d_kv_ready, st)

    # -- MD / D allocation and the DRC -----------------------------------------------------

    def _alloc(self, st: ReqState, queue: bool = True) -> bool:
        """Reserve MD's (or D's) blocks: match and lock the cached prefix, allocate the rest.
        Short of blocks, or with requests already waiting, the request waits in the instance's
        FIFO (``queue``; counted once in ``md_alloc_waits``) or, when it is the head of that FIFO
        retried, stays there (MD's daemon keeps the same FIFO of KV_ALLOCs)."""
        side = self.decode[st.md_idx]
        req, bs = st.req, self.block_units
        cache = side.cache
        if queue:
            while side.waiting and side.waiting[0].finished:
                side.waiting.pop(0)
            if side.waiting:  # first come first served, as MD's daemon: no overtaking
                self.counts["md_alloc_waits"] += 1
                side.waiting.append(st)
                return False
        hit_blocks: tuple[int, ...] = ()
        handle = None
        if side.use_cache:
            m = cache.match_and_lock(req.units, max_blocks=(len(req.units) - 1) // bs)
            hit_blocks, handle = m.block_ids, m.handle
        need = -(-(len(req.units) + len(req.output_units)) // bs) - len(hit_blocks)
        if cache.num_available < need:
            if handle is not None:
                cache.unlock(handle)
            if need > cache.allocator.num_blocks:
                raise ValueError(
                    f"request {req.rid} needs {need} KV blocks, more than a "
                    f"whole decode instance holds ({cache.allocator.num_blocks})"
                )
            if queue:
                self.counts["md_alloc_waits"] += 1
                side.waiting.append(st)
            return False
        st.table = list(hit_blocks) + cache.allocate(need)
        st.handle = handle
        st.md_hit = min(len(hit_blocks) * bs * self.q, req.prompt_tokens - 1)
        st.md_allocated = True
        if side.use_cache:
            cache.record_lookup(len(req.units), len(hit_blocks) * bs)
        self.counts["md_hit_tokens"] += st.md_hit
        return True

    def _md_alloc(self, now: float, st: ReqState) -> None:
        if st.finished:
            return
        if self._alloc(st):
            self._md_answer(st)

    def _md_answer(self, st: ReqState) -> None:
        side = self.decode[st.md_idx]
        events = side.cache.drain_events() if side.use_cache else None
        self.wan.message("b_to_a", self._notice_bytes(events), self._p_alloc_answer, st, events)

    @staticmethod
    def _notice_bytes(events: CacheEventBatch | None) -> int:
        """A control message's size with the CACHE_EVENTS notice it carries."""
        if events is None:
            return HEADER_BYTES
        return HEADER_BYTES + HASH_BYTES * (len(events.inserted) + len(events.evicted))

    def _p_cache_notice(self, md_idx: int, events: CacheEventBatch) -> None:
        self.views[md_idx].apply(events)

    def _release(self, st: ReqState, keep: bool, last_user: float | None = None) -> None:
        """A request leaves MD / D: with ``keep`` its KV enters the DRC (prompt and output,
        but the last token, which was sampled and never computed). ``last_user``: when its
        last token reaches A, which MD's cache notice does not trail."""
        if not st.md_allocated:
            return
        st.md_allocated = False
        side = self.decode[st.md_idx]
        req = st.req
        table = st.table
        assert table is not None, "an allocated request has its block table"
        if keep and side.use_cache:
            with_kv = req.units + req.output_units[:-1]
            side.cache.insert_finished(with_kv, table, self._with_kv_hashes(st, with_kv))
        else:
            side.cache.release(table)
        st.table = None
        if self.cross and side.use_cache:
            # As MD does at every request's end: what the request left in the tree is what the
            # conversation's next turn will hit, so P hears of it now, not with MD's next
            # answer (which may be that very turn's). MD posts it just before the last token,
            # in the same in-order stream, so it reaches A with that token (jitter and all;
            # outside the link's queue: a few hashes), and P applies it before a turn the
            # client sends on that token can arrive (callers release before they finish the
            # request). A request with no last token here: one line delay from now.
            events = side.cache.drain_events()
            if events is not None:
                at = self.loop.now + side.inst.user_delay_s if last_user is None else last_user
                self.loop.at(max(at, self.loop.now), self._p_cache_notice, st.md_idx, events)
        while side.waiting:
            nxt = side.waiting[0]
            if nxt.finished:
                side.waiting.pop(0)
                continue
            if not self._alloc(nxt, queue=False):
                break
            side.waiting.pop(0)
            if self.cross:
                self._md_answer(nxt)
            else:
                self._d_allocated(nxt)

    # -- P learns MD's answer; the WAN transfer ---------------------------------------------

    def _p_alloc_answer(self, now: float, st: ReqState, events: Any) -> None:
        self.rtt_est.observe(now - st.alloc_sent)
        view = self.views[st.md_idx]
        if events is not None:
            view.apply(events)
        if st.prediction is not None:
            view.observe(st.prediction, st.md_hit // self.q)
        if st.finished or st.rld_done:
            self._cancel_md(st)
            return
        total = (st.req.prompt_tokens - st.md_hit) * self.kvpt
        st.wan_bytes = total
        if self.use_rld:  # as the prefill daemon: MD's answer fixes what crosses
            self.wan_backlogs[st.p].commit(st.req.rid, total)
        # one sender per (P, MD) pair, as the prefill daemon's stripes to that MD
        st.transfer = self.wan.start_transfer(
            total, lambda t: self._kv_at_md(t, st), sender=(st.p, st.md_idx)
        )
        self.wan.make_sendable(st.transfer, (st.p_progress - st.md_hit) * self.kvpt)

    def _cancel_md(self, st: ReqState) -> None:
        if self.use_rld:
            self.wan_backlogs[st.p].release(st.req.rid)
        if st.transfer is not None and st.transfer.done_at is None:
            self.wan.cancel(st.transfer)  # (a finished one has nothing left to stop)
            self.counts["cancelled_transfers"] += 1
        self.wan.message("a_to_b", HEADER_BYTES, self._md_cancelled, st)

    def _md_cancelled(self, now: float, st: ReqState) -> None:
        if st.md_member is not None:
            self.decode[st.md_idx].inst.drop(st.md_member)
            # unlinked, as _md_finished does: else the request and the member it was
            # streaming into (RLD finished it first) hold each other until a collection
            st.md_member = None
        self._release(st, keep=False)

    def _kv_at_md(self, t: float, st: ReqState) -> None:
        # KV_RECEIVED to P: there the transfer leaves P's backlog and P's delivery rate feeds
        # the goodput estimate, as in the prefill daemon (see _p_kv_received)
        self.wan.message("b_to_a", HEADER_BYTES, self._p_kv_received, st)
        if st.finished or st.rld_done:
            return
        st.kv_at_md = True
        if st.pipeline is Pipeline.P_MD:
            user = t + self.decode[st.md_idx].inst.user_delay_s
            self._first_token(st, user)
            st.md_tokens = 1
            self._md_decode(st, user)
        else:
            self.wan.message("b_to_a", HEADER_BYTES, self._rld_takeover, st)

    def _p_kv_received(self, now: float, st: ReqState) -> None:
        """P hears MD has the whole KV (KV_RECEIVED): the backlog drops it, and the goodput
        sample is the prefill daemon's, P's delivery rate (the KV's bytes over the time from
        MD's answer to this acknowledgement). MD's first-to-last arrival span, which the
        daemons used before, measures one transfer's share of a busy line and let PDD's P99
        TTFT reach 8.6x the baseline's in the full scenario (docs/simulator.md)."""
        if not self.use_rld:
            return
        self.wan_backlogs[st.p].release(st.req.rid)
        tr = st.transfer
        assert tr is not None, "the KV arrived by this transfer"
        self.bw_est.observe(tr.total, now - tr.started_at)

    def _md_decode(self, st: ReqState, user: float) -> None:
        remaining = st.req.output_tokens - 1
        if remaining <= 0:
            self._release(st, keep=True, last_user=user)
            self._finish(st, user)
            return
        m = Member(st, st.req.prompt_tokens, remaining, user, self._md_finished)
        st.md_member = m
        self._cache_prompt(st)
        self.decode[st.md_idx].inst.add(m)

    def _cache_prompt(self, st: ReqState) -> None:
        """MD (or D) starts computing the request: its prompt's full blocks enter the DRC now,
        not only when it finishes, as the daemon's engine indexes every block it completes
        (``register_computed`` after each step: the whole prompt at its first). A request
        sharing that prefix (another conversation's turn on the same system prompt) then hits
        it while this one decodes; at the end ``_release`` adds the output's blocks."""
        side = self.decode[st.md_idx]
        if not side.use_cache or st.table is None:
            return
        assert st.prompt_hashes is not None, "a cache is on: hashed on arrival"
        side.cache.insert_running(st.req.units, st.table, st.prompt_hashes)

    def _md_finished(self, m: Member, t: float, made: int) -> None:
        st = m.state
        # MD is done with it (a later cancel's drop would be a no-op on the finished member):
        # unlinked, the request and its member are freed as soon as nothing else holds them
        st.md_member = None
        st.md_tokens += made
        self._release(st, keep=True, last_user=m.prev_user)
        self._finish(st, m.prev_user)

    # -- same-DC D ---------------------------------------------------------------------------

    def _d_allocated(self, st: ReqState) -> None:
        if st.prefill_done >= 0 and st.kv_at_md:
            self._d_start(st)

    def _d_kv_ready(self, st: ReqState) -> None:
        st.kv_at_md = True
        if st.md_allocated:
            self._d_start(st)

    def _d_start(self, st: ReqState) -> None:
        now = self.loop.now
        self._first_token(st, now)
        st.md_tokens = 1
        self._md_decode(st, now)

    # -- RLD ---------------------------------------------------------------------------------

    def _rld_start(self, st: ReqState) -> None:
        now = self.loop.now
        st.rld_started = True
        self._first_token(st, now)
        st.rld_tokens = 1
        remaining = st.req.output_tokens - 1
        if remaining <= 0:
            self._rld_left(st, now, done=True)
            return
        m = Member(st, st.req.prompt_tokens, remaining, now, self._rld_finished)
        st.rld_member = m
        self.relay[st.rld_idx].add(m)
        if st.takeover_pending:
            self._rld_takeover(now, st)

    def _rld_takeover(self, now: float, st: ReqState) -> None:
        """MD has the KV (first TAKEOVER) or has digested what it got (streaming)."""
        if st.finished or st.rld_done:
            return
        step = takeover_step(st.rld_started, st.mode)
        if step == TAKEOVER_PARK:
            st.takeover_pending = True
            return
        if step == TAKEOVER_CUT:  # streaming: MD caught up, make the final cut
            self._rld_cut(now, st)
            return
        assert st.rld_member is not None, "a takeover's request decodes on RLD"
        backlog = 1 + self.relay[st.rld_idx].tokens_made(st.rld_member, now)
        mode, cut_now = first_cut(self.handoff_policy, backlog, self.admission[st.rld_idx].load)
        st.mode = mode
        self.handoffs[mode.value] += 1
        if cut_now:
            self._rld_cut(now, st)
        else:
            st.sent_ids = backlog
            self.wan.message(
                "a_to_b",
                HEADER_BYTES + TOKEN_ID_BYTES * backlog,
                self._md_handoff,
                st,
                backlog,
                False,
            )

    def _rld_cut(self, now: float, st: ReqState) -> None:
        """The final cut, made when TAKEOVER arrives (RelayHandoff's): RLD's tokens are the
        ones it emitted by now, the final HANDOFF leaves now."""
        m = st.rld_member
        assert m is not None, "a cut request decodes on RLD"
        made, last = self.relay[st.rld_idx].stop(m, now)
        st.rld_tokens = 1 + made
        st.last_user = last
        # (its last token may end exactly now: then it is RLD's whole reply)
        self._rld_left(st, now, done=st.rld_tokens >= st.req.output_tokens)

    def _rld_finished(self, m: Member, t: float, made: int) -> None:
        st = m.state
        st.rld_tokens = 1 + made
        st.last_user = m.prev_user
        self._rld_left(st, t, done=st.rld_tokens >= st.req.output_tokens)

    def _rld_left(self, st: ReqState, t: float, done: bool) -> None:
        st.rld_done = True
        st.rld_member = None  # nothing reads it once RLD is done (see _md_finished)
        self.admission[st.rld_idx].release(str(st.req.rid))
        self._rld_held -= 1
        self.rld_depth.observe(t, self._rld_held)
        if done:  # RLD produced every token
            last = st.last_user if st.last_user >= 0 else t
            self._finish(st, last)
            if st.pipeline is not Pipeline.RLD_ONLY:
                self._cancel_md(st)
            return
        # cut: the final HANDOFF carries the ids MD has not been sent yet
        ids = st.rld_tokens - st.sent_ids
        st.sent_ids = st.rld_tokens
        self.wan.message(
            "a_to_b", HEADER_BYTES + TOKEN_ID_BYTES * ids, self._md_handoff, st, ids, True
        )

    def _md_handoff(self, now: float, st: ReqState, ids: int, final: bool) -> None:
        if st.finished:
            return
        inst = self.decode[st.md_idx].inst
        m = st.md_member
        if m is None:
            m = Member(st, st.req.prompt_tokens, 0, -1.0, self._md_finished)
            st.md_member = m
            self._cache_prompt(st)
        assert st.mode is not None, "decided before any HANDOFF leaves"
        chunk = md_extend_chunk(st.mode, ids, self.handoff_policy.chunk)
        if final:
            m.remaining = st.req.output_tokens - st.rld_tokens - 1
            m.prev_user = st.last_user
            inst.extend(m, ids, chunk, True)
        else:
            inst.extend(m, ids, chunk, False, self._md_digested)

    def _md_digested(self, m: Member, t: float) -> None:
        self.wan.message("b_to_a", HEADER_BYTES, self._rld_takeover, m.state)

    # -- completion ----------------------------------------------------------------------------

    def _first_token(self, st: ReqState, user: float) -> None:
        st.first_user = user
        ttft = max(0.0, user - st.req.arrival_s)
        self.ttft.add(ttft)
        assert st.pipeline is not None, "chosen when it arrived"
        self.ttft_by_pipeline[st.pipeline.value].add(ttft)

    def _finish(self, st: ReqState, last_user: float) -> None:
        if st.finished:
            return
        st.finished = True
        self._d_load[st.md_idx] -= 1
        req = st.req
        last_user = max(last_user, st.first_user)
        tpot = (
            (last_user - st.first_user) / (req.output_tokens - 1) if req.output_tokens > 1 else 0.0
        )
        ttft = st.first_user - req.arrival_s
        self.tpot.add(tpot)
        self.e2e.add(last_user - req.arrival_s)
        c = self.counts
        c["finished"] += 1
        c["rld_tokens"] += st.rld_tokens
        # every token RLD did not make came from MD (or D)
        c["md_tokens"] += req.output_tokens - st.rld_tokens
        if ttft <= self.cfg.sla.ttft_s and tpot <= self.cfg.sla.tpot_s:
            c["good"] += 1
        if self.request_records is not None:
            assert st.pipeline is not None, "chosen when it arrived"
            self.request_records.append(
                {
                    "rid": req.rid,
                    "arrival_s": req.arrival_s,
                    "ttft_s": ttft,
                    "tpot_s": tpot if req.output_tokens > 1 else None,  # (vLLM's: none)
                    "e2e_s": last_user - req.arrival_s,
                    "pipeline": st.pipeline.value,
                    "rld_tokens": st.rld_tokens,
                    "md_tokens": req.output_tokens - st.rld_tokens,
                    "md_hit_tokens": st.md_hit,
                    "p_hit_tokens": st.p_hit,
                }
            )
        self.last_done = max(self.last_done, last_user)
        if self.on_request_done is not None:
            self.on_request_done(req, last_user)

    # -- reporting -------------------------------------------------------------------------------

    def hardware_cost_per_hour(self) -> float:
        gpus = sum(p.num_gpus * p.chip.price_per_hour for p in self.deployment.pools().values())
        line = self.cfg.line.bw_gbit * self.cfg.line.price_per_gbit_hour if self.cross else 0.0
        return gpus + line

    def hit_histogram(self) -> dict[str, int]:
        counts = [0] * len(HIT_INTERVAL_LABELS)
        for d in self.decode:
            for i, c in enumerate(d.cache.hit_histogram):
                counts[i] += c
        return dict(zip(HIT_INTERVAL_LABELS, counts, strict=True))
