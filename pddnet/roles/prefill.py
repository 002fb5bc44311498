"""P: prefill once, ship the KV twice (shared memory to RLD, WAN stripes to MD).

Per config.mode: cross-dc -> MD only; same-dc -> RLD only (there the decode instance is a
RelayDaemon that never hands off); pdd -> per request, the pipeline pddnet.policy.planner picks
from P's view of MD's cache and its WAN estimates. Prefill runs as a prefill-only request in P's
engine (max_tokens=1, keep_blocks=True), chunked by max_num_batched_tokens; after each chunk its
KV goes out at once (pddnet.roles.prefill_transfers). Everything a request's life decides --
its pipeline and its changes, the allocations, what to ship when, KV_DONE, the fallbacks when
a target refuses, fails or is lost, cancel, release -- is pddnet.lifecycle.prefill_request's
machine; this shell moves messages, engine calls and KV in and out of it.
"""

from __future__ import annotations

import time
from typing import Any

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.engine.engine import StepOutput
from pddnet.lifecycle import actions as act
from pddnet.lifecycle.prefill_messages import (
    kv_alloc_request,
    pipeline_change,
    pipeline_choice,
)
from pddnet.lifecycle.prefill_request import MAIN, RELAY
from pddnet.policy.planner import PipelinePlanner
from pddnet.protocol import (
    CacheEvents,
    Cancel,
    ErrorMessage,
    KvAbort,
    KvAllocResponse,
    KvReceived,
    Message,
    Submit,
)
from pddnet.transport import Connection
from pddnet.transport.kv_paths import KVPaths

from .common import Daemon, log
from .ordering import Serial
from .peer import Peer
from .prefill_planning import FED, TARGETS_OF_MODE, Refusal, admit, feed, make_planner, md_answered
from .prefill_slot import PrefillSlot
from .prefill_transfers import PATH_OF, PrefillTransfers, RequestKV
from .readiness import Link
from .to_router import now

BULK_LINK = "main-decode bulk"  # the WAN stripes that carry KV_CHUNK to MD (tcp backend)


class PrefillDaemon(Daemon):
    role = "prefill"

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        self.targets = TARGETS_OF_MODE[config.mode]
        self.control: dict[str, Peer] = {}
        self.planner: PipelinePlanner | None = None  # pdd mode, once the engine exists
        self.kv = PrefillTransfers(self.instance_id, self.targets, self.spawn, self.counters)
        self.requests: dict[str, PrefillSlot] = {}

    async def start(self) -> None:
        # The backends first: one that cannot run here fails the start, not the first request.
        paths = tuple(PATH_OF[t] for t in self.targets)
        self.kv.kv_paths = await KVPaths.create(self.config, self.section, "prefill", paths)
        try:
            await super().start()
        except BaseException:
            await self.kv.kv_paths.close()
            raise

    async def dial_peers(self) -> None:
        if self.config.mode is ClusterMode.PDD:
            self.planner = make_planner(self.config, self.engine.pool.spec.bytes_per_token)
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
        self.kv.new_stripes(lanes)
        if self.planner is not None:
            self.planner.reset_view()

    def links(self) -> dict[str, Link]:
        """Also MD's bulk stripes, which come and go with its control lane."""
        links = super().links()
        if MAIN in self.control:
            links[BULK_LINK] = self.kv.bulk_link(links[self.control[MAIN].name])
        return links

    def link_changed(self, name: str) -> None:
        super().link_changed(name)
        if MAIN in self.control and name == self.control[MAIN].name:
            super().link_changed(BULK_LINK)

    def on_rtt(self, conn: Connection, rtt_s: float) -> None:
        if conn.peer_role == MAIN and self.planner is not None:
            self.planner.observe_rtt(rtt_s)

    async def close_extra(self) -> None:
        await self.kv.close()

    # -- messages in -------------------------------------------------------------------------------

    async def handle(self, conn: Connection, msg: Message) -> None:
        req = self.requests.get(getattr(msg, "request_id", None) or "")
        if isinstance(msg, Submit):
            self._submit(msg)
        elif isinstance(msg, KvAllocResponse):
            self._allocated(conn.peer_role, msg)
        elif isinstance(msg, CacheEvents):
            if self.planner is not None:
                view = self.planner.view
                view.resync(msg.block_size, msg.inserted, msg.seq) if msg.reset else view.apply(msg)
        elif isinstance(msg, KvReceived):
            if req is not None:
                self.run(req, req.machine.kv_received(msg.num_bytes, time.monotonic()))
        elif isinstance(msg, (Cancel, KvAbort)):
            if req is not None:  # (MD's KV_ABORT may leave RLD serving it alone)
                self.run(req, req.machine.cancel(msg.reason, conn.peer_role))
            if req is None or req.machine.over:
                self.ended.add(msg.request_id)
        elif isinstance(msg, ErrorMessage):
            log.warning(
                "%s: ERROR from %s: %s %s", self.instance_id, conn.peer_role, msg.code, msg.message
            )
            if req is not None:
                self.run(req, req.machine.fail(msg.code, f"{conn.peer_role}: {msg.message}"))
        else:
            log.warning(
                "%s: unexpected %s from %s", self.instance_id, msg.TYPE.name, conn.peer_role
            )

    def _submit(self, sub: Submit) -> None:
        rid, known = sub.request_id, sub.request_id in self.requests or sub.request_id in self.ended
        admitted = admit(
            sub, known, self.config, self.targets, self.control, self.planner, self.counters
        )
        if isinstance(admitted, Refusal):
            self.error(rid, admitted.code, admitted.message)
            return
        sub, machine = admitted
        serial = {t: Serial(f"{rid} -> {t}", self._tasks) for t in (*machine.targets, "engine")}
        req = self.requests[rid] = PrefillSlot(sub, machine, serial, RequestKV(rid))
        self.run(req, machine.start())

    def _allocated(self, target: str, msg: KvAllocResponse) -> None:
        if target not in (RELAY, MAIN):
            raise ValueError(f"KV_ALLOC_RESPONSE from a {target}, not a decode tier")
        req = self.requests.get(msg.request_id)
        if req is None:
            if msg.accepted:  # the request ended meanwhile: give the blocks back
                self.control[target].post(
                    KvAbort(request_id=msg.request_id, reason="request no longer active")
                )
            return
        m = req.machine
        if target == RELAY and msg.step_s and self.planner is not None:
            self.planner.observe_rld_step(msg.step_s)
        if not msg.accepted:
            self.run(req, m.refused(target, msg.error))
            return
        unusable = self.kv.accept(req.kv, target, msg, m.num_tokens)
        if unusable:  # it did reserve: give that back, then treat the answer as a refusal
            self.run(req, m.allocation_unusable(target, unusable))
            return
        seen = recheck = None
        if target == MAIN and m.plan is not None and self.planner is not None:
            # MD's hit is authoritative: repair P's view and recheck the pipeline with it
            seen, recheck = md_answered(self.planner, m.plan, msg.hit_tokens, msg.block_size)
        self.run(req, m.allocated(target, msg.hit_tokens, time.monotonic(), seen, recheck))

    # -- engine progress ---------------------------------------------------------------------------

    def on_step(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None or req.machine.over:
                continue
            self.run(req, req.machine.computed(out.num_computed_tokens))
            if out.new_token_ids:
                if out.logprobs:
                    req.first_logprob = out.logprobs[0]
                self.run(req, req.machine.first_token_sampled(out.new_token_ids[0]))

    def engine_failed(self, reason: str) -> None:
        # Only sequences still prefilling take part in steps (a finished one just keeps blocks).
        for req in list(self.requests.values()):
            if req.started:
                self.run(req, req.machine.engine_failed(reason))

    # -- actions out -------------------------------------------------------------------------------

    def run(self, req: PrefillSlot, actions: list[act.PrefillAction]) -> None:
        """Carry out a request's actions, in order (a target's on its own Serial)."""
        rid = req.submit.request_id
        for a in actions:
            if isinstance(a, act.Timeline):
                self.timeline(rid, a.event, a.value, a.detail)
            elif isinstance(a, act.Count):
                self.counters[a.name] += 1
            elif isinstance(a, act.Transfer):
                req.serial[a.target].submit(lambda a=a: self._transfer(req, a))
            elif isinstance(a, act.SendKvDone):
                req.serial[a.target].submit(lambda a=a: req.send_kv_done(self, a))
            elif isinstance(a, act.AbortTarget):
                box, msg = self.control[a.target], KvAbort(request_id=rid, reason=a.reason[:4096])
                self.kv.abort_then(req.kv, a.target, a.reason, lambda b=box, m=msg: b.post(m))
            elif isinstance(a, act.StopWrites):
                self.kv.stop(req.kv, a.target, a.reason)
            elif isinstance(a, act.ReleaseBlocks):
                req.serial["engine"].submit(lambda: self._release(req))
            elif isinstance(a, act.FailRequest):
                self.counters["failed"] += 1
                self.error(rid, a.code, a.message)
            elif isinstance(a, act.AskAllocation):
                alloc = kv_alloc_request(req.submit, req.machine.num_tokens, self.engine.spec, a)
                self.control[a.target].post(alloc)
            elif isinstance(a, act.StartPrefill):
                req.serial["engine"].submit(lambda: req.start_prefill(self))
            elif isinstance(a, act.ReportPipelineChoice):
                self.to_router(pipeline_choice(rid, a.plan, now()))
            elif isinstance(a, act.ReportPipelineChange):
                self.to_router(pipeline_change(rid, a.pipeline, a.reason, now()))
            elif isinstance(a, FED) and self.planner is not None:  # WAN backlog, goodput
                feed(self.planner, rid, a)

    async def _transfer(self, req: PrefillSlot, a: act.Transfer) -> None:
        self.run(req, await self.kv.ship(req.kv, req.machine, a, self.engine))

    async def _release(self, req: PrefillSlot) -> None:
        rid = req.submit.request_id
        await req.free(self)
        if self.requests.get(rid) is req:
            del self.requests[rid]
            self.ended.add(rid)
            self.counters["completed" if req.machine.shipped else "aborted"] += 1

    def connection_lost(self, conn: Connection) -> None:
        if conn.lane != "control" or conn.peer_role not in (RELAY, MAIN):
            return
        lost = conn.peer_role
        why = f"{lost} control connection closed: {conn.close_reason or 'closed'}"
        if lost == MAIN:
            if self.planner is not None:
                self.planner.reset_view()  # the next connection starts from MD's snapshot
            self.kv.drop_stripes()
        for req in list(self.requests.values()):
            if lost in req.machine.targets:
                self.run(req, req.machine.peer_lost(lost, why))

    # -- stats -------------------------------------------------------------------------------------

    def request_stats(self) -> dict[str, int]:
        return {
            "active": len(self.requests),
            **{k: self.counters[k] for k in ("submitted", "completed", "cancelled", "failed")},
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
        self.kv.stats(out, self.wire_scale if self.emulation is not None else None)
        return out
