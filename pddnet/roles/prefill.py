"""P: prefill once, ship the KV twice (shared memory to RLD, WAN stripes to MD).

Per config.mode: cross-dc -> MD only; same-dc -> RLD only (there the decode instance is a
RelayDaemon that never hands off); pdd -> per request, the pipeline pddnet.policy.planner picks
from P's view of MD's cache and its WAN estimates: P->MD (MD only), P->RLD->MD (RLD first: its
admission answer decides whether MD then hears p_rld_md or, refused, p_md), or P->RLD (the
singular filter: RLD only, the WAN transfer never starts; RLD refusing sends it P->MD). Prefill runs as a prefill-only request in P's
engine (max_tokens=1, keep_blocks=True), chunked by max_num_batched_tokens; after each chunk its
KV goes out at once through the KV backend of the target's path ([transport] intra_dc for RLD:
shm | mooncake; wan for MD: tcp | mooncake; pddnet.transport.kv_backend): the chunk is exported
(copied out of the pool on P's export thread, beside the engine: see `_export`), then written by
the backend off the engine thread -- one-sided into the
target's blocks (shm, mooncake) or as KV_CHUNK frames on the bulk stripes (tcp). A failed write
(dead or hung receiver: a TransferError within transport.deadline_s) takes the usual fallback:
RLD finishes alone when MD's copy fails, otherwise the request fails as `<target>_lost` and the
router replays it by token ids on the other decode tier. Before any KV_ABORT goes to a target,
the request's transfer to it is aborted and quiesced, so no write lands after the receiver may
reuse the blocks. The per-request decisions (what to ship when, when KV_DONE may go, when P's
blocks are free) are pddnet.protocol.request_flow's.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.engine.engine import StepOutput
from pddnet.engine.sampling import TokenLogprob
from pddnet.kv.transfer import ExportedKV, export_kv
from pddnet.policy.pipeline import Pipeline, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner, Plan
from pddnet.protocol import (
    CacheEvents,
    Cancel,
    ErrorMessage,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvDone,
    KvReceived,
    Message,
    PipelineChange,
    PipelineChoice,
    Submit,
)
from pddnet.protocol.request_flow import (
    AbortTarget,
    FailRequest,
    FlowAction,
    PrefillFlow,
    ReleaseBlocks,
    SendKvDone,
    Transfer,
)
from pddnet.transport import Connection
from pddnet.transport.backends.call_thread import CallThread
from pddnet.transport.kv_backend import (
    BadRegion,
    KVTransfer,
    KVWriter,
    PeerUnreachable,
    TransferError,
    TransferTimeout,
    WriteTarget,
    check_descriptor_for,
)
from pddnet.transport.kv_paths import KVPaths
from pddnet.transport.stripes import StripedSender

from .common import Daemon, Serial, kv_done_logprob, log, now, sampling_fields, sampling_of
from .peer import Peer
from .readiness import Link

RELAY, MAIN = "relay", "main_decode"
BULK_LINK = "main-decode bulk"  # the WAN stripes that carry KV_CHUNK to MD (tcp backend)
FIXED_PIPELINES = {ClusterMode.CROSS_DC: Pipeline.P_MD, ClusterMode.SAME_DC: Pipeline.RLD_ONLY}
# Who serves a pipeline, in the order P asks them (MD waits for RLD's admission answer).
TARGETS = {
    Pipeline.P_MD: (MAIN,),
    Pipeline.P_RLD_MD: (RELAY, MAIN),
    Pipeline.RLD_ONLY: (RELAY, MAIN),
}
PATH_OF = {RELAY: "intra_dc", MAIN: "wan"}  # the KV path (and [transport] key) of a target


@dataclass
class _Alloc:
    """A target's answer to KV_ALLOC_REQUEST."""

    block_ids: tuple[int, ...]
    block_size: int
    hit: int
    region: str = ""
    target: WriteTarget | None = None  # where the request's KV goes in the target's pool


@dataclass
class _Request:
    submit: Submit
    flow: PrefillFlow
    serial: dict[str, Serial]  # per target, plus "engine"
    allocs: dict[str, _Alloc] = field(default_factory=dict)
    xfers: dict[str, KVTransfer] = field(default_factory=dict)  # per target, once writing
    wan_bytes: int = 0
    wan_started: float | None = None  # when MD's allocation answer reached P (monotonic)
    started: bool = False  # add_request sent to the engine
    pipeline: Pipeline = Pipeline.P_RLD_MD  # current (may change once, see _relay_answered)
    plan: Plan | None = None  # pdd mode: the planner's decision and inputs
    asked: set[str] = field(default_factory=set)  # targets sent KV_ALLOC_REQUEST
    exporting: int = 0  # exports reading this sequence's blocks right now
    exports_idle: asyncio.Event = field(default_factory=asyncio.Event)
    first_logprob: TokenLogprob | None = None  # index 0's, when the request asks for them


class PrefillDaemon(Daemon):
    role = "prefill"
    section_name = "prefill"

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        mode = config.mode
        self.targets: tuple[str, ...] = {
            ClusterMode.PDD: (RELAY, MAIN),
            ClusterMode.CROSS_DC: (MAIN,),
            ClusterMode.SAME_DC: (RELAY,),
        }[mode]
        self.control: dict[str, Peer] = {}
        self.planner: PipelinePlanner | None = None  # pdd mode, once the engine exists
        self.stripes: StripedSender | None = None
        self.kv_paths: KVPaths | None = None
        # per target: the receiver's region descriptor and our writer to it (one at a time)
        self.writers: dict[str, tuple[str, KVWriter]] = {}
        self._writer_locks = {t: asyncio.Lock() for t in self.targets}
        self.requests: dict[str, _Request] = {}
        # KV exports run here, not in the engine thread, so a finished prefill's copy to RLD
        # does not wait behind the next request's prefill step (see _export)
        self._exporter = CallThread(f"{self.instance_id}-export")

    async def start(self) -> None:
        # The backends first: one that cannot run here fails the start, not the first request.
        paths = tuple(PATH_OF[t] for t in self.targets)
        self.kv_paths = await KVPaths.create(self.config, self.section, "prefill", paths)
        try:
            await super().start()
        except BaseException:
            await self.kv_paths.close()
            raise

    def _make_planner(self) -> PipelinePlanner:
        cfg, pol = self.config, self.config.policy
        mbit = pol.wan_bw_mbit or cfg.wan.bw_mbit or 1000.0
        policy = PipelinePolicy(
            direct_budget_s=pol.direct_budget_s,
            singular_filter=pol.singular_filter,
            singular_margin=pol.singular_margin,
        )
        return PipelinePlanner(
            policy,
            self.engine.pool.spec.bytes_per_token,
            bandwidth_bps=mbit * 1e6 / 8,
            rtt_s=max(cfg.wan.rtt_ms, 1.0) / 1e3,
            rld_step_s=pol.rld_step_s,
        )

    async def dial_peers(self) -> None:
        if self.config.mode is ClusterMode.PDD:
            self.planner = self._make_planner()
        if RELAY in self.targets:
            self.control[RELAY] = self.peer(self.config.relay.dial_address(), "relay control")
            await self.control[RELAY].connect_first()
        if MAIN in self.targets:
            self.control[MAIN] = self.peer(
                self.config.main_decode.dial_address(), "main-decode control", on_up=self._main_up
            )
            await self.control[MAIN].connect_first()

    async def _main_up(self, conn: Connection) -> None:
        """MD's control lane is (re)connected: dial its bulk lanes; a new view of its cache
        starts from the snapshot MD sends first."""
        address = self.config.main_decode.dial_address()
        lanes = [await self.dial_once(address, "bulk") for _ in range(self.config.wan.stripes)]
        old, self.stripes = self.stripes, StripedSender(lanes)
        wan = self.kv_paths.backend("wan") if self.kv_paths is not None else None
        if wan is not None and wan.name == "tcp":
            wan.stripes = self.stripes  # the tcp backend's writers carry KV on these lanes
            self._forget_writer(MAIN)
        if old is not None:
            self.spawn(old.close(), "close old stripes")
        if self.planner is not None:
            self.planner.reset_view()

    def links(self) -> dict[str, Link]:
        """Also MD's bulk stripes, which come and go with its control lane."""
        links = super().links()
        if MAIN in self.control:
            md = links[self.control[MAIN].name]
            up = md.up and self.stripes is not None and self.stripes.alive
            links[BULK_LINK] = Link(up, md.since, "" if up else md.detail or "not dialled yet")
        return links

    def link_changed(self, name: str) -> None:
        super().link_changed(name)
        if MAIN in self.control and name == self.control[MAIN].name:
            super().link_changed(BULK_LINK)

    def on_rtt(self, conn: Connection, rtt_s: float) -> None:
        if conn.peer_role == MAIN and self.planner is not None:
            self.planner.observe_rtt(rtt_s)

    async def close_extra(self) -> None:
        self._exporter.stop()  # after the exports already queued (each a bounded copy)
        await asyncio.to_thread(self._exporter.join, 5.0)
        self.writers.clear()
        if self.kv_paths is not None:
            await self.kv_paths.close()  # its writers first (bounded), then the engines
        if self.stripes is not None:
            await self.stripes.close()

    # -- messages ------------------------------------------------------------------------------

    async def handle(self, conn: Connection, msg: Message) -> None:
        if isinstance(msg, Submit):
            await self._submit(msg)
        elif isinstance(msg, KvAllocResponse):
            self._allocated(self._target_of(conn), msg)
        elif isinstance(msg, CacheEvents):
            self._cache_events(msg)
        elif isinstance(msg, KvReceived):
            self._received(msg)
        elif isinstance(msg, (Cancel, KvAbort)):
            self._cancel(msg.request_id, msg.reason, conn.peer_role)
        elif isinstance(msg, ErrorMessage):
            log.warning(
                "%s: ERROR from %s: %s %s", self.instance_id, conn.peer_role, msg.code, msg.message
            )
            if msg.request_id is not None and msg.request_id in self.requests:
                self._fail(msg.request_id, msg.code, f"{conn.peer_role}: {msg.message}")
        else:
            log.warning(
                "%s: unexpected %s from %s", self.instance_id, msg.TYPE.name, conn.peer_role
            )

    def _target_of(self, conn: Connection) -> str:
        if conn.peer_role not in (RELAY, MAIN):
            raise ValueError(f"KV_ALLOC_RESPONSE from a {conn.peer_role}, not a decode tier")
        return conn.peer_role

    async def _submit(self, sub: Submit) -> None:
        rid = sub.request_id
        if rid in self.requests or rid in self.ended:
            self.error(rid, "duplicate_request", f"request id {rid!r} is already in use")
            return
        if sub.output_token_ids:
            self.error(
                rid,
                "bad_request",
                "P prefills new requests only; a replay with "
                "output_token_ids goes to a decode instance",
            )
            return
        assert self.engine is not None
        if sub.temperature > 0 and sub.seed is None:
            # A concrete seed before the request fans out: every tier then samples alike.
            sub = dataclasses.replace(sub, seed=secrets.randbits(63))
        n = len(sub.prompt_token_ids)
        plan = None
        down = [t for t in self.targets if not self.control[t].alive]
        if self.planner is None:
            if down:  # a baseline has nobody else to send it to
                self.error(
                    rid,
                    f"{down[0]}_lost",
                    f"{down[0]} is unreachable: {self.control[down[0]].last_loss}",
                )
                return
            pipeline = FIXED_PIPELINES[self.config.mode]
        else:
            forced = self.config.policy.pipeline
            force = None if forced == "auto" else Pipeline.from_wire(forced)
            why = None
            if down == [MAIN]:  # RLD is the fallback while MD is unreachable
                force = Pipeline.RLD_ONLY
            elif down == [RELAY]:  # and MD while RLD is
                force = Pipeline.P_MD
            elif down:
                self.error(rid, "no_decode_tier", "neither relay nor main decode is reachable")
                return
            if down:
                link = self.control[down[0]].link()
                why = f"{down[0]} unreachable: {link.describe(self.control[down[0]].name)}"[:300]
            plan = self.planner.plan(sub.prompt_token_ids, sub.max_tokens, force=force, why=why)
            if down:
                self.counters[f"{down[0]}_down_rerouted"] += 1
            pipeline = plan.pipeline
        targets = TARGETS[pipeline] if self.planner is not None else self.targets
        req = _Request(
            sub,
            PrefillFlow(n, targets),
            {name: Serial(f"{rid} -> {name}", self._tasks) for name in (*targets, "engine")},
            pipeline=pipeline,
            plan=plan,
        )
        self.requests[rid] = req
        self.counters["submitted"] += 1
        self.counters[f"pipeline_{pipeline.wire}"] += 1
        if plan is not None:
            self.to_router(pipeline_choice(rid, plan))
        self._ask(req, targets[0])
        req.serial["engine"].submit(lambda: self._start_prefill(req))

    async def _start_prefill(self, req: _Request) -> None:
        sub = req.submit
        if req.flow.over:
            return
        # Set before the call: the engine may step (and fail) before this coroutine resumes.
        req.started = True
        try:
            await self.compute(
                self.engine.add_request,
                sub.prompt_token_ids,
                1,
                sampling_of(sub),
                sub.request_id,
                ignore_eos=True,
                keep_blocks=True,
            )
        except ValueError as exc:
            req.started = False
            self._fail(sub.request_id, "bad_request", f"prefill refused: {exc}")
            return
        self.timeline(sub.request_id, "prefill_start", len(sub.prompt_token_ids), req.pipeline.wire)
        self.wake()

    def _ask(self, req: _Request, target: str) -> None:
        """KV_ALLOC_REQUEST to one target, naming the request's current pipeline."""
        sub, spec = req.submit, self.engine.spec
        req.asked.add(target)
        hit = req.plan.prediction.hit_tokens if req.plan is not None and target == MAIN else 0
        self.control[target].post(
            KvAllocRequest(
                request_id=sub.request_id,
                prompt_token_ids=sub.prompt_token_ids,
                num_tokens=req.flow.num_tokens,
                block_size=spec.block_size,
                dtype=spec.dtype,
                num_layers=spec.num_layers,
                num_kv_heads=spec.num_kv_heads,
                head_dim=spec.head_dim,
                expected_hit_tokens=hit,
                pipeline=req.pipeline.wire,
                handoff_mode=sub.handoff_mode,
                **sampling_fields(sub),
            )
        )

    def _change_pipeline(self, req: _Request, pipeline: Pipeline, reason: str) -> None:
        rid = req.submit.request_id
        self.counters[f"pipeline_{req.pipeline.wire}_to_{pipeline.wire}"] += 1
        req.pipeline = pipeline
        self.to_router(
            PipelineChange(request_id=rid, pipeline=pipeline.wire, reason=reason[:512], time=now())
        )

    def _allocated(self, target: str, msg: KvAllocResponse) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            if msg.accepted:  # the request ended meanwhile: give the blocks back
                self.control[target].post(
                    KvAbort(request_id=msg.request_id, reason="request no longer active")
                )
            return
        if target == RELAY and msg.step_s and self.planner is not None:
            self.planner.observe_rld_step(msg.step_s)
        if not msg.accepted:
            self._refused(req, target, msg.error)
            return
        n = req.flow.num_tokens
        unusable = ""
        write_target = None
        if len(msg.block_ids) * msg.block_size < n:
            unusable = f"{len(msg.block_ids)} blocks of {msg.block_size} cannot hold {n} positions"
        else:
            try:
                check_descriptor_for(self.kv_paths.name(PATH_OF[target]), msg.region)
                write_target = WriteTarget.from_alloc(msg)
            except (BadRegion, ValueError) as exc:
                unusable = str(exc)
        if unusable:  # it did reserve: give that back, then treat the answer as a refusal
            self.control[target].post(
                KvAbort(request_id=msg.request_id, reason=f"unusable allocation: {unusable}")
            )
            self._refused(req, target, f"unusable allocation: {unusable}")
            return
        req.allocs[target] = _Alloc(
            msg.block_ids, msg.block_size, msg.hit_tokens, msg.region, write_target
        )
        if target == MAIN and self.planner is not None and not req.flow.over:
            # MD's hit fixes what will cross: queued ahead of later requests' KV until MD
            # acknowledges it (released by _run once MD's copy is finished, dropped or over)
            self.planner.wan_committed(
                msg.request_id, max(n - msg.hit_tokens, 0) * self.planner.kv_bytes_per_token
            )
            req.wan_started = time.monotonic()
        self._run(req, req.flow.allocated(target, msg.hit_tokens))
        if target == RELAY:
            self._relay_answered(req)
        else:
            self._main_answered(req, msg)

    def _refused(self, req: _Request, target: str, error: str) -> None:
        rid = req.submit.request_id
        if target == RELAY and MAIN in req.flow.targets and MAIN not in req.asked:
            # RLD's admission said no (it is full): the request goes P->MD and waits for its
            # KV there instead of queueing behind RLD.
            self.counters["relay_refused"] += 1
            self.timeline(rid, "relay_refused", None, error[:256])
            self._run(req, req.flow.drop(RELAY, ""))
            self._change_pipeline(req, Pipeline.P_MD, f"RLD refused: {error}")
            self._ask(req, MAIN)
            return
        # Without room on MD, RLD (which decodes to the end when no TAKEOVER comes) serves the
        # request alone; without RLD, MD cannot (it waits for a relay's cut).
        alone = target == MAIN and req.pipeline is Pipeline.P_RLD_MD
        if alone:
            self.counters["main_decode_refused"] += 1
            self.timeline(rid, "main_decode_refused", None, error[:128])
        self._run(req, req.flow.refused(target, error, others_suffice=alone))

    def _relay_answered(self, req: _Request) -> None:
        """RLD admitted the request: MD now hears of it (P->RLD->MD), or never (P->RLD)."""
        if MAIN not in req.flow.targets or MAIN in req.asked:
            return
        if req.pipeline is Pipeline.P_RLD_MD:
            self._ask(req, MAIN)
        else:  # the singular filter: the WAN transfer never starts
            self.counters["wan_transfers_never_started"] += 1
            self._run(req, req.flow.drop(MAIN, ""))

    def _main_answered(self, req: _Request, msg: KvAllocResponse) -> None:
        """MD's hit is authoritative: repair P's view and recheck the pipeline with it."""
        rid = req.submit.request_id
        self.timeline(rid, "prefix_hit_tokens", msg.hit_tokens)  # KV below it stays home
        if req.plan is None or self.planner is None:
            return
        seen = self.planner.md_answered(req.plan, msg.hit_tokens, msg.block_size)
        if seen.wrong:
            self.counters["md_view_wrong"] += 1
            self.timeline(
                rid,
                "md_view_wrong",
                seen.predicted_tokens,
                f"predicted {seen.predicted_tokens}, MD holds {seen.actual_tokens}",
            )
        new = self.planner.recheck(req.plan, msg.hit_tokens)
        if new is not None and req.pipeline is Pipeline.P_RLD_MD:
            req.plan = new
            self._change_pipeline(req, new.pipeline, new.decision.reason)
            self.counters["wan_transfers_cancelled"] += 1
            self._run(req, req.flow.drop(MAIN, f"singular traffic: {new.decision.reason}"))

    def _cache_events(self, msg: CacheEvents) -> None:
        if self.planner is None:
            return
        view = self.planner.view
        if msg.reset:
            view.resync(msg.block_size, msg.inserted, msg.seq)
        else:
            view.apply(msg)

    def _cancel(self, rid: str, reason: str, by: str = "router") -> None:
        req = self.requests.get(rid)
        if req is None:
            self.ended.add(rid)
            return
        relay = req.flow.targets.get(RELAY)
        if (
            by == MAIN
            and req.pipeline is Pipeline.P_RLD_MD
            and relay is not None
            and RELAY in req.allocs
        ):
            # MD dropped its copy (e.g. it lost the relay lane): RLD still serves the request.
            self._change_pipeline(req, Pipeline.RLD_ONLY, f"main decode dropped it: {reason}")
            self._run(req, req.flow.drop(MAIN, ""))
            self._abort_target(req, MAIN, f"acknowledged: {reason}")  # MD may be fencing blocks
            return
        self.ended.add(rid)
        main = req.flow.targets.get(MAIN)
        if by == RELAY and main is not None and main.hit is not None and not main.finished:
            # RLD finished the whole output before MD's copy was complete: stop shipping it.
            self.counters["wan_transfers_cancelled"] += 1
            self.timeline(rid, "wan_cancelled", req.wan_bytes, reason[:256])
        self.counters["cancelled"] += 1
        self._run(req, req.flow.cancel(reason))

    def _fail(self, rid: str, code: str, message: str) -> None:
        req = self.requests.get(rid)
        if req is None or req.flow.over:
            return
        self.counters["failed"] += 1
        self.error(rid, code, message)
        self._run(req, req.flow.cancel(message))

    # -- engine progress ---------------------------------------------------------------------------

    def on_step(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None or req.flow.over:
                continue
            self._run(req, req.flow.computed_upto(out.num_computed_tokens))
            if out.new_token_ids:
                if out.logprobs:
                    req.first_logprob = out.logprobs[0]
                self.timeline(out.request_id, "prefill_end", out.num_computed_tokens)
                self._run(req, req.flow.first_token_sampled(out.new_token_ids[0]))

    def engine_failed(self, reason: str) -> None:
        # Only sequences still prefilling take part in steps (a finished one just keeps blocks).
        for rid, req in list(self.requests.items()):
            if req.started and req.flow.first_token is None:
                self._fail(rid, "engine_failed", reason)

    # -- actions -----------------------------------------------------------------------------------

    def _run(self, req: _Request, actions: list[FlowAction]) -> None:
        rid = req.submit.request_id
        for a in actions:
            if isinstance(a, Transfer):
                req.serial[a.target].submit(lambda a=a: self._transfer(req, a))
            elif isinstance(a, SendKvDone):
                req.serial[a.target].submit(lambda a=a: self._kv_done(req, a))
            elif isinstance(a, AbortTarget):
                self._abort_target(req, a.target, a.reason)
            elif isinstance(a, ReleaseBlocks):
                req.serial["engine"].submit(lambda: self._release(req))
            elif isinstance(a, FailRequest):
                self.counters["failed"] += 1
                self.error(rid, a.code, a.message)
        self._settle_wan_backlog(req)

    def _settle_wan_backlog(self, req: _Request) -> None:
        """Every change of a request's flow goes through _run: once nothing more of its KV
        will cross to MD (MD acknowledged it, MD was dropped or refused, the request was
        cancelled or failed), its bytes leave P's WAN backlog."""
        if self.planner is None:
            return
        main = req.flow.targets.get(MAIN)
        if req.flow.over or main is None or main.finished:
            self.planner.wan_released(req.submit.request_id)

    async def _transfer(self, req: _Request, a: Transfer) -> None:
        if req.flow.over:
            return
        try:
            xfer = await self._transfer_to(req, a.target)
            if xfer is None or req.flow.over:
                return
            exported = await self._export(req, a.start, a.end)
            if req.flow.over:
                return
            written = await xfer.write(exported)
        except TransferError as exc:
            self._transfer_failed(req, a.target, exc)
            return
        self.counters[f"kv_bytes_{PATH_OF[a.target]}"] += written
        if a.target == MAIN:
            req.wan_bytes += written

    async def _transfer_to(self, req: _Request, target: str) -> KVTransfer | None:
        """The request's transfer to `target`, begun on its first write (None: target gone)."""
        xfer = req.xfers.get(target)
        if xfer is not None:
            return xfer
        alloc = req.allocs.get(target)
        if alloc is None or alloc.target is None:
            return None
        writer = await self._writer(target, alloc.region)
        if req.flow.over:
            return None
        xfer = req.xfers[target] = writer.begin(req.submit.request_id, alloc.target)
        self.timeline(req.submit.request_id, "kv_transport", None, f"{target}={writer.backend}")
        return xfer

    async def _writer(self, target: str, descriptor: str) -> KVWriter:
        """The writer to a target's region, opened once per descriptor (a receiver that
        restarted describes a new region: the old writer is closed)."""
        async with self._writer_locks[target]:
            cached = self.writers.get(target)
            if cached is not None and cached[0] == descriptor and not cached[1].closed:
                return cached[1]
            self._forget_writer(target)
            writer = await self.kv_paths.open(PATH_OF[target], descriptor)
            self.writers[target] = (descriptor, writer)
            return writer

    def _forget_writer(self, target: str, writer: KVWriter | None = None) -> None:
        cached = self.writers.get(target)
        if cached is not None and (writer is None or cached[1] is writer):
            del self.writers[target]
            self.spawn(cached[1].close(), f"close {target} writer")

    def _transfer_failed(self, req: _Request, target: str, exc: TransferError) -> None:
        """A write failed: the receiver is dead, hung, or refused it. The usual fallback."""
        rid = req.submit.request_id
        self.counters[f"transfer_errors_{PATH_OF[target]}"] += 1
        why = f"KV transfer to {target} failed ({type(exc).__name__}): {exc}"
        self.timeline(rid, "kv_transfer_failed", None, why[:256])
        xfer = req.xfers.get(target)
        if isinstance(exc, (PeerUnreachable, TransferTimeout)) and xfer is not None:
            self._forget_writer(target, xfer.writer)  # the peer is gone: do not reuse it
        if req.flow.over:
            return
        if target == MAIN and req.pipeline is Pipeline.P_RLD_MD and RELAY in req.allocs:
            # RLD has (or gets) its copy and decodes the request to its end.
            self._change_pipeline(req, Pipeline.RLD_ONLY, why)
            self._run(req, req.flow.drop(MAIN, why))
        else:  # the router replays it by token ids on the other decode tier, or fails it
            self._fail(rid, f"{target}_lost", why)

    def _abort_target(self, req: _Request, target: str, reason: str) -> None:
        """KV_ABORT to a target, after the request's writes to it have stopped."""
        msg = KvAbort(request_id=req.submit.request_id, reason=reason[:4096])
        xfer = req.xfers.get(target)
        if xfer is None:
            self.control[target].post(msg)
            return

        async def abort() -> None:
            if not await xfer.abort(reason):
                self.counters["abort_not_quiescent"] += 1
                log.warning(
                    "%s: %s: a write to %s is still stuck in the engine after the abort grace",
                    self.instance_id,
                    req.submit.request_id,
                    target,
                )
            self.control[target].post(msg)

        self.spawn(abort(), f"abort {req.submit.request_id} -> {target}")

    async def _export(self, req: _Request, start: int, end: int) -> ExportedKV:
        """The KV of positions [start, end) of P's sequence (a copy the backend then writes).

        Not in the engine thread: there it would wait for the step running at that moment --
        typically the next request's whole prefill, seconds on a CPU -- before RLD could have
        its copy and emit the first token. Reading the pool beside a step is safe because the
        positions are computed (the engine never writes them again), a live sequence's block
        table only grows, and its blocks stay referenced until `_release`, which waits for the
        request's exports to end before it frees them."""
        seq = self.engine.get_sequence(req.submit.request_id)
        table = list(seq.block_table)  # append-only while the sequence lives: a safe snapshot
        req.exporting += 1
        req.exports_idle.clear()
        try:
            return await asyncio.wrap_future(
                self._exporter.submit(export_kv, self.engine.pool, table, start, end)
            )
        finally:
            req.exporting -= 1
            if not req.exporting:
                req.exports_idle.set()

    async def _kv_done(self, req: _Request, a: SendKvDone) -> None:
        if req.flow.over:
            return
        rid = req.submit.request_id
        n = req.flow.num_tokens
        xfer = req.xfers.get(a.target)
        c = xfer.completion() if xfer is not None else None  # None: all of it was cached there
        done = KvDone(
            request_id=rid,
            num_tokens=n,
            num_chunks=c.num_chunks if c else 0,
            num_bytes=c.num_bytes if c else 0,
            first_token_id=a.first_token,
            time=now(),
            **kv_done_logprob(req.first_logprob),
        )
        if a.target == MAIN:
            self.timeline(rid, "wan_kv_sent", done.num_bytes)
        self.control[a.target].post(done)
        if a.target == RELAY:  # the one-sided writes are in RLD's memory already
            # P's part towards RLD is over: the router now counts RLD as the request's carrier
            # (were RLD to die before its own rld_kv_complete, nobody else would say so)
            self.timeline(rid, "rld_kv_sent", done.num_bytes)
            self._run(req, req.flow.target_finished(a.target))
        # MD's copy is finished when MD says it has it all (KV_RECEIVED): until then the
        # transfer can still be cancelled (the singular filter) and P still holds the KV.

    def _received(self, msg: KvReceived) -> None:
        req = self.requests.get(msg.request_id)
        if self.planner is not None and req is not None and req.wan_started is not None:
            # The goodput sample is P's delivery rate: the KV's bytes over the time from MD's
            # answer to MD's acknowledgement, what the direct-budget test predicts (the line's
            # share this request got, P's pacing and queueing included), whatever the backend.
            # MD's first-to-last arrival span (KV_RECEIVED's span_*) measures one transfer's
            # share of a busy line instead: it swung 0.06-1.8 GB/s on a 4.25 GB/s line in the
            # simulator's full scenario and let PDD's P99 TTFT reach 8.6x the baseline's (1.0x
            # with this sample; docs/simulator.md).
            self.planner.observe_transfer(msg.num_bytes, time.monotonic() - req.wan_started)
        main = req.flow.targets.get(MAIN) if req is not None else None
        if main is not None and main.done_queued and not main.finished:
            self.timeline(msg.request_id, "wan_kv_acked", msg.num_bytes)
            self._run(req, req.flow.target_finished(MAIN))

    async def _release(self, req: _Request) -> None:
        rid = req.submit.request_id
        if req.exporting:  # an export still reads the blocks (see _export)
            await req.exports_idle.wait()
        if req.started:
            await self.compute(self.engine.abort, rid)  # frees kept blocks or stops prefill
        if self.planner is not None:
            self.planner.wan_released(rid)  # settled already by _run; never left behind
        if self.requests.get(rid) is req:
            del self.requests[rid]
            self.ended.add(rid)
            shipped = all(t.finished for t in req.flow.targets.values())
            self.counters["completed" if shipped else "aborted"] += 1

    def connection_lost(self, conn: Connection) -> None:
        if conn.lane != "control" or conn.peer_role not in (RELAY, MAIN):
            return
        lost = conn.peer_role
        why = f"{lost} control connection closed: {conn.close_reason or 'closed'}"
        if lost == MAIN:
            if self.planner is not None:
                self.planner.reset_view()  # the next connection starts from MD's snapshot
            if self.stripes is not None:
                stripes, self.stripes = self.stripes, None
                self.spawn(stripes.close(), "close stripes")
        for rid, req in list(self.requests.items()):
            t = req.flow.targets.get(lost)
            if t is None or t.finished or req.flow.over:
                continue
            xfer = req.xfers.get(lost)
            if xfer is not None:  # no KV_ABORT can reach it now; stop writing at least
                self.spawn(xfer.abort(why), f"abort {rid} -> {lost}")
            if lost == MAIN and req.pipeline is Pipeline.P_RLD_MD and RELAY in req.allocs:
                # RLD is the fallback: it decodes the request to its end (it sees MD gone too).
                self.counters["main_lost_relay_continues"] += 1
                self._change_pipeline(req, Pipeline.RLD_ONLY, why)
                self._run(req, req.flow.drop(MAIN, ""))
            else:  # the router replays it by token ids on a live decode tier, or fails it
                self._fail(rid, f"{lost}_lost", why)

    # -- stats ---------------------------------------------------------------------------------------

    def request_stats(self) -> dict[str, int]:
        return {
            "active": len(self.requests),
            "submitted": self.counters["submitted"],
            "completed": self.counters["completed"],
            "cancelled": self.counters["cancelled"],
            "failed": self.counters["failed"],
        }

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.planner is not None:
            out["planner"] = self.planner.counters()
        out["pipelines"] = {
            k[len("pipeline_") :]: v
            for k, v in self.counters.items()
            if k.startswith("pipeline_") and "_to_" not in k
        }
        bulk = out["lanes"].get("bulk", {}).get("bytes_out", 0)
        out["wan_bytes"] = {
            "out": {"kv": bulk, "control": out["lanes"].get("control", {}).get("bytes_out", 0)}
        }
        if self.kv_paths is not None:
            out["transport"] = {
                path: {**st, "target": target, "writer_open": target in self.writers}
                for target, path in PATH_OF.items()
                if (st := self.kv_paths.stats().get(path)) is not None
            }
        if self.stripes is not None:
            out["lanes"]["bulk"] = {
                "bytes_out": sum(sum(c.stats["bytes_out"].values()) for c in self.stripes.lanes),
                "chunks": sum(self.stripes.chunks_sent),
            }
        if self.emulation is not None:  # what the target model's KV bytes would have been
            kv = out["lanes"].get("bulk", {}).get("bytes_out", 0)
            out["wan_bytes"]["out"]["kv_target"] = round(kv / self.wire_scale)
        return out


def pipeline_choice(rid: str, plan: Plan) -> PipelineChoice:
    """P's decision and every input of it, as the router's `pdd` object shows them."""
    d, x = plan.decision, plan.inputs
    return PipelineChoice(
        request_id=rid,
        pipeline=d.pipeline.wire,
        reason=d.reason[:1024],
        wan_transfer_s=d.wan_transfer_s,
        incremental_bytes=d.incremental_bytes,
        prompt_tokens=x.prompt_tokens,
        hit_tokens=x.hit_tokens,
        max_tokens=x.max_tokens,
        kv_bytes_per_token=x.kv_bytes_per_token,
        bandwidth_bps=x.bandwidth_bps,
        rtt_s=x.rtt_s,
        rld_s_per_token=x.rld_s_per_token,
        rld_admits=x.rld_admits,
        wan_backlog_bytes=x.wan_backlog_bytes,
        predicted_hit=plan.prediction.hit_tokens,
        view_stale=plan.prediction.stale,
        time=now(),
    )
