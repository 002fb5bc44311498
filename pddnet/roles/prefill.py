"""P: prefill once, ship the KV twice (shared memory to RLD, WAN stripes to MD).

Per config.mode: cross-dc -> MD only; same-dc -> RLD only (there the decode instance is a
RelayDaemon that never hands off); pdd -> per request, the pipeline pddnet.policy.planner picks
from P's view of MD's cache and its WAN estimates: P->MD (MD only), P->RLD->MD (RLD first: its
admission answer decides whether MD then hears p_rld_md or, refused, p_md), or P->RLD (the
singular filter: RLD only, the WAN transfer never starts; RLD refusing sends it P->MD). Prefill runs as a prefill-only request in P's
engine (max_tokens=1, keep_blocks=True), chunked by max_num_batched_tokens; after each chunk its
KV goes out at once: one-sided writes into RLD's blocks, KV_CHUNK frames (wan.chunk_tokens
tokens each, all layers) queued on the bulk stripes. The per-request decisions (what to ship
when, when KV_DONE may go, when P's blocks are free) are pddnet.protocol.request_flow's.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.engine.engine import StepOutput
from pddnet.kv.transfer import export_kv
from pddnet.policy.pipeline import Pipeline, PipelinePolicy
from pddnet.policy.planner import PipelinePlanner, Plan
from pddnet.protocol import (
    CacheEvents,
    Cancel,
    ErrorMessage,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvChunk,
    KvDone,
    KvReceived,
    Message,
    Submit,
    payload_from_tensor,
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
from pddnet.transport.shm_region import RemoteKVRegion
from pddnet.transport.stripes import StripedSender

from .common import Daemon, Serial, log, now, sampling_of
from .peer import Peer

RELAY, MAIN = "relay", "main_decode"
FIXED_PIPELINES = {ClusterMode.CROSS_DC: Pipeline.P_MD, ClusterMode.SAME_DC: Pipeline.RLD_ONLY}
# Who serves a pipeline, in the order P asks them (MD waits for RLD's admission answer).
TARGETS = {Pipeline.P_MD: (MAIN,), Pipeline.P_RLD_MD: (RELAY, MAIN),
           Pipeline.RLD_ONLY: (RELAY, MAIN)}


@dataclass
class _Alloc:
    """A target's answer to KV_ALLOC_REQUEST."""

    block_ids: tuple[int, ...]
    block_size: int
    hit: int
    region: str = ""


@dataclass
class _Request:
    submit: Submit
    flow: PrefillFlow
    serial: dict[str, Serial]               # per target, plus "engine"
    allocs: dict[str, _Alloc] = field(default_factory=dict)
    chunks: int = 0                         # KV_CHUNK frames queued for MD
    wan_bytes: int = 0
    shm_bytes: int = 0
    started: bool = False                   # add_request sent to the engine
    pipeline: Pipeline = Pipeline.P_RLD_MD  # current (may change once, see _relay_answered)
    plan: Plan | None = None                # pdd mode: the planner's decision and inputs
    asked: set[str] = field(default_factory=set)   # targets sent KV_ALLOC_REQUEST


class PrefillDaemon(Daemon):
    role = "prefill"
    section_name = "prefill"

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        mode = config.mode
        self.targets: tuple[str, ...] = {ClusterMode.PDD: (RELAY, MAIN), ClusterMode.CROSS_DC: (MAIN,),
                                         ClusterMode.SAME_DC: (RELAY,)}[mode]
        self.control: dict[str, Peer] = {}
        self.planner: PipelinePlanner | None = None   # pdd mode, once the engine exists
        self.stripes: StripedSender | None = None
        self.regions: dict[str, RemoteKVRegion] = {}
        self.requests: dict[str, _Request] = {}

    def _make_planner(self) -> PipelinePlanner:
        cfg, pol = self.config, self.config.policy
        mbit = pol.wan_bw_mbit or cfg.wan.bw_mbit or 1000.0
        policy = PipelinePolicy(direct_budget_s=pol.direct_budget_s,
                                singular_filter=pol.singular_filter,
                                singular_margin=pol.singular_margin)
        return PipelinePlanner(policy, self.engine.pool.spec.bytes_per_token,
                               bandwidth_bps=mbit * 1e6 / 8, rtt_s=max(cfg.wan.rtt_ms, 1.0) / 1e3,
                               rld_step_s=pol.rld_step_s)

    async def dial_peers(self) -> None:
        if self.config.mode is ClusterMode.PDD:
            self.planner = self._make_planner()
        if RELAY in self.targets:
            self.control[RELAY] = self.peer(self.config.relay.dial_address(), "relay control")
            await self.control[RELAY].connect_first()
        if MAIN in self.targets:
            self.control[MAIN] = self.peer(self.config.main_decode.dial_address(),
                                           "main-decode control", on_up=self._main_up)
            await self.control[MAIN].connect_first()

    async def _main_up(self, conn: Connection) -> None:
        """MD's control lane is (re)connected: dial its bulk lanes; a new view of its cache
        starts from the snapshot MD sends first."""
        address = self.config.main_decode.dial_address()
        lanes = [await self.dial_once(address, "bulk") for _ in range(self.config.wan.stripes)]
        old, self.stripes = self.stripes, StripedSender(lanes)
        if old is not None:
            self.spawn(old.close(), "close old stripes")
        if self.planner is not None:
            self.planner.reset_view()

    def on_rtt(self, conn: Connection, rtt_s: float) -> None:
        if conn.peer_role == MAIN and self.planner is not None:
            self.planner.observe_rtt(rtt_s)

    async def close_extra(self) -> None:
        if self.stripes is not None:
            await self.stripes.close()
        for region in self.regions.values():
            region.close()
        self.regions.clear()

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
            log.warning("%s: ERROR from %s: %s %s", self.instance_id, conn.peer_role, msg.code,
                        msg.message)
            if msg.request_id is not None and msg.request_id in self.requests:
                self._fail(msg.request_id, msg.code, f"{conn.peer_role}: {msg.message}")
        else:
            log.warning("%s: unexpected %s from %s", self.instance_id, msg.TYPE.name,
                        conn.peer_role)

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
            self.error(rid, "bad_request", "P prefills new requests only; a replay with "
                       "output_token_ids goes to a decode instance")
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
                self.error(rid, f"{down[0]}_lost", f"{down[0]} is unreachable: "
                           f"{self.control[down[0]].last_loss}")
                return
            pipeline = FIXED_PIPELINES[self.config.mode]
        else:
            forced = self.config.policy.pipeline
            force = None if forced == "auto" else Pipeline.from_wire(forced)
            if down == [MAIN]:      # RLD is the fallback while MD is unreachable
                force = Pipeline.RLD_ONLY
            elif down == [RELAY]:   # and MD while RLD is
                force = Pipeline.P_MD
            elif down:
                self.error(rid, "no_decode_tier", "neither relay nor main decode is reachable")
                return
            plan = self.planner.plan(sub.prompt_token_ids, sub.max_tokens, force=force)
            if down:
                self.counters[f"{down[0]}_down_rerouted"] += 1
            pipeline = plan.pipeline
        targets = TARGETS[pipeline] if self.planner is not None else self.targets
        req = _Request(sub, PrefillFlow(n, targets),
                       {name: Serial(f"{rid} -> {name}", self._tasks)
                        for name in (*targets, "engine")}, pipeline=pipeline, plan=plan)
        self.requests[rid] = req
        self.counters["submitted"] += 1
        self.counters[f"pipeline_{pipeline.wire}"] += 1
        if plan is not None:
            self.timeline(rid, "pipeline", None, json.dumps(plan.record(), separators=(",", ":")))
        self._ask(req, targets[0])
        req.serial["engine"].submit(lambda: self._start_prefill(req))

    async def _start_prefill(self, req: _Request) -> None:
        sub = req.submit
        if req.flow.over:
            return
        # Set before the call: the engine may step (and fail) before this coroutine resumes.
        req.started = True
        try:
            await self.compute(self.engine.add_request, sub.prompt_token_ids, 1, sampling_of(sub),
                               sub.request_id, ignore_eos=True, keep_blocks=True)
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
        self.control[target].post(KvAllocRequest(
            request_id=sub.request_id, prompt_token_ids=sub.prompt_token_ids,
            num_tokens=req.flow.num_tokens, block_size=spec.block_size, dtype=spec.dtype,
            num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim,
            expected_hit_tokens=hit, pipeline=req.pipeline.wire, max_tokens=sub.max_tokens,
            temperature=sub.temperature, top_p=sub.top_p, top_k=sub.top_k, seed=sub.seed,
            stop_token_ids=sub.stop_token_ids, ignore_eos=sub.ignore_eos,
            handoff_mode=sub.handoff_mode))

    def _change_pipeline(self, req: _Request, pipeline: Pipeline, reason: str) -> None:
        rid = req.submit.request_id
        self.counters[f"pipeline_{req.pipeline.wire}_to_{pipeline.wire}"] += 1
        req.pipeline = pipeline
        self.timeline(rid, "pipeline_change", None,
                      json.dumps({"pipeline": pipeline.wire, "reason": reason[:512]},
                                 separators=(",", ":")))

    def _allocated(self, target: str, msg: KvAllocResponse) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            if msg.accepted:  # the request ended meanwhile: give the blocks back
                self.control[target].post(KvAbort(request_id=msg.request_id,
                                                  reason="request no longer active"))
            return
        if target == RELAY and msg.step_s and self.planner is not None:
            self.planner.observe_rld_step(msg.step_s)
        if not msg.accepted:
            self._refused(req, target, msg.error)
            return
        n = req.flow.num_tokens
        unusable = ""
        if len(msg.block_ids) * msg.block_size < n:
            unusable = f"{len(msg.block_ids)} blocks of {msg.block_size} cannot hold {n} positions"
        elif target == RELAY and not msg.region:
            unusable = "no shared-memory region named"
        if unusable:  # it did reserve: give that back, then treat the answer as a refusal
            self.control[target].post(KvAbort(request_id=msg.request_id,
                                              reason=f"unusable allocation: {unusable}"))
            self._refused(req, target, f"unusable allocation: {unusable}")
            return
        req.allocs[target] = _Alloc(msg.block_ids, msg.block_size, msg.hit_tokens, msg.region)
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
            self.timeline(rid, "md_view_wrong", seen.predicted_tokens,
                          f"predicted {seen.predicted_tokens}, MD holds {seen.actual_tokens}")
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
        if by == MAIN and req.pipeline is Pipeline.P_RLD_MD and relay is not None \
                and RELAY in req.allocs:
            # MD dropped its copy (e.g. it lost the relay lane): RLD still serves the request.
            self._change_pipeline(req, Pipeline.RLD_ONLY, f"main decode dropped it: {reason}")
            self._run(req, req.flow.drop(MAIN, ""))
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
                self.control[a.target].post(KvAbort(request_id=rid, reason=a.reason[:4096]))
            elif isinstance(a, ReleaseBlocks):
                req.serial["engine"].submit(lambda: self._release(req))
            elif isinstance(a, FailRequest):
                self.counters["failed"] += 1
                self.error(rid, a.code, a.message)

    async def _transfer(self, req: _Request, a: Transfer) -> None:
        if req.flow.over:
            return
        if a.target == RELAY:
            written = await self.compute(self._write_shm, req, a.start, a.end)
            req.shm_bytes += written
        else:
            await self._send_chunks(req, a.start, a.end)

    def _write_shm(self, req: _Request, start: int, end: int) -> int:
        """In the engine thread: export [start, end) and write it into RLD's blocks."""
        alloc = req.allocs[RELAY]
        region = self.regions.get(alloc.region)
        if region is None:
            region = self.regions[alloc.region] = RemoteKVRegion.attach(alloc.region)
        table = self.engine.get_sequence(req.submit.request_id).block_table
        exported = export_kv(self.engine.pool, table, start, end)
        # Only the blocks past RLD's cached prefix are this request's to write.
        own = alloc.block_ids[alloc.hit // alloc.block_size:]
        return region.write(own, alloc.block_ids, exported, start, min_position=alloc.hit)

    async def _send_chunks(self, req: _Request, start: int, end: int) -> None:
        alloc = req.allocs[MAIN]
        step = self.config.wan.chunk_tokens
        rid = req.submit.request_id
        for s in range(start, end, step):
            if req.flow.over:
                return
            e = min(end, s + step)
            exported = await self.compute(self._export, rid, s, e)
            payload, dtype, shape = payload_from_tensor(exported.kv)
            touched = alloc.block_ids[s // alloc.block_size:math.ceil(e / alloc.block_size)]
            chunk = KvChunk(request_id=rid, chunk_index=req.chunks, token_start=s, token_end=e,
                            layer_start=0, layer_end=shape[0], block_ids=touched, dtype=dtype,
                            shape=shape, payload=payload)
            stripes = self.stripes
            if stripes is None or req.flow.over:
                return  # MD was lost meanwhile (connection_lost re-routed or failed it)
            req.chunks += 1
            req.wan_bytes += payload.nbytes
            await stripes.send(chunk)

    def _export(self, rid: str, start: int, end: int):
        """In the engine thread: the KV of positions [start, end) of P's sequence."""
        table = self.engine.get_sequence(rid).block_table
        return export_kv(self.engine.pool, table, start, end)

    async def _kv_done(self, req: _Request, a: SendKvDone) -> None:
        if req.flow.over:
            return
        rid = req.submit.request_id
        n = req.flow.num_tokens
        if a.target == RELAY:
            done = KvDone(request_id=rid, num_tokens=n, num_chunks=0, num_bytes=req.shm_bytes,
                          first_token_id=a.first_token, time=now())
        else:
            done = KvDone(request_id=rid, num_tokens=n, num_chunks=req.chunks,
                          num_bytes=req.wan_bytes, first_token_id=a.first_token, time=now())
            self.timeline(rid, "wan_kv_sent", req.wan_bytes)
        self.control[a.target].post(done)
        if a.target == RELAY:  # the one-sided writes are in RLD's memory already
            self._run(req, req.flow.target_finished(a.target))
        # MD's copy is finished when MD says it has it all (KV_RECEIVED): until then the
        # transfer can still be cancelled (the singular filter) and P still holds the KV.

    def _received(self, msg: KvReceived) -> None:
        if self.planner is not None:
            self.planner.observe_transfer(msg.span_bytes, msg.span_s)
        req = self.requests.get(msg.request_id)
        main = req.flow.targets.get(MAIN) if req is not None else None
        if main is not None and main.done_queued and not main.finished:
            self.timeline(msg.request_id, "wan_kv_acked", msg.num_bytes)
            self._run(req, req.flow.target_finished(MAIN))

    async def _release(self, req: _Request) -> None:
        rid = req.submit.request_id
        if req.started:
            await self.compute(self.engine.abort, rid)  # frees kept blocks or stops prefill
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
            if lost == MAIN and req.pipeline is Pipeline.P_RLD_MD and RELAY in req.allocs:
                # RLD is the fallback: it decodes the request to its end (it sees MD gone too).
                self.counters["main_lost_relay_continues"] += 1
                self._change_pipeline(req, Pipeline.RLD_ONLY, why)
                self._run(req, req.flow.drop(MAIN, ""))
            else:  # the router replays it by token ids on a live decode tier, or fails it
                self._fail(rid, f"{lost}_lost", why)

    # -- stats ---------------------------------------------------------------------------------------

    def request_stats(self) -> dict[str, int]:
        return {"active": len(self.requests), "submitted": self.counters["submitted"],
                "completed": self.counters["completed"], "cancelled": self.counters["cancelled"],
                "failed": self.counters["failed"]}

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        if self.planner is not None:
            out["planner"] = self.planner.counters()
        out["pipelines"] = {k[len("pipeline_"):]: v for k, v in self.counters.items()
                            if k.startswith("pipeline_") and "_to_" not in k}
        bulk = out["lanes"].get("bulk", {}).get("bytes_out", 0)
        out["wan_bytes"] = {"out": {"kv": bulk, "control": out["lanes"].get("control", {})
                                    .get("bytes_out", 0)}}
        if self.stripes is not None:
            out["lanes"]["bulk"] = {"bytes_out": sum(sum(c.stats["bytes_out"].values())
                                                     for c in self.stripes.lanes),
                                    "chunks": sum(self.stripes.chunks_sent)}
        return out
