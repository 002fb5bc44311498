"""RLD: a small decode pool next to P whose KV pool is a shared-memory "RDMA region".

It reserves blocks for P's one-sided writes (KV_ALLOC_REQUEST -> reserve_kv, answered with the
block ids and the region's name), starts decoding the moment P's completion (KV_DONE) arrives,
and streams every token to the router at once (eager). In pdd mode MD's TAKEOVER starts the
handoff; RLD alone decides the cut (pddnet.lifecycle.handoff.RelayHandoff): one-shot stops at
once, streaming forwards tokens while MD catches up. In same-dc mode (pipeline p_rld) it is the
decode instance and never hands off.

In pdd mode RLD is a small pool that must never be flooded: every allocation passes
pddnet.policy.admission.RelayAdmission first (running tokens, KV blocks, requests); a refusal
sends the request P->MD instead of queueing it here. Each answer carries RLD's recent decode
time per token (KV_ALLOC_RESPONSE.step_s), which P's pipeline policy needs for the singular filter.

The KV path P -> RLD is `[transport] intra_dc`: `shm` (the pool lives in a shared-memory segment
P maps) or `mooncake` (the pool is registered with the Transfer Engine, P's engine writes into
it across hosts). Either way the pool is a registered sink whose descriptor goes into every
KV_ALLOC_RESPONSE. With mooncake a write may still be in flight when RLD drops a request before
its KV_DONE (a cancel): its reservation is then fenced -- kept -- until P confirms with KV_ABORT
(sent after P quiesced the transfer) or a bound passes, so no late write lands in reused blocks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.engine.engine import KVReservation, StepOutput
from pddnet.engine.sampling import TokenLogprob
from pddnet.kv.shm import segment_name
from pddnet.lifecycle.handoff import (
    Action,
    CancelPeer,
    EmitTokens,
    FinishRequest,
    HandoffAbandoned,
    HandoffError,
    HandoffStarted,
    RelayHandoff,
    RelayPhase,
    SendHandoff,
    StopSequence,
)
from pddnet.policy.admission import RelayAdmission
from pddnet.policy.handoff import HandoffMode, HandoffPolicy
from pddnet.protocol import (
    Cancel,
    Handoff,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvDone,
    Message,
    RequestDone,
    Submit,
    Takeover,
    encode_bytes,
)
from pddnet.transport import Connection

from .common import (
    CANCELLED_MEMORY,
    Outbox,
    Serial,
    first_token_ends,
    first_token_logprob,
    log,
    sampling_of,
    step_end_reasons,
    take_logprobs,
)
from .kv_receiver import KvReceiver
from .peer import Peer

HANDS_OFF_PIPELINES = ("p_rld_md",)
# A parked TAKEOVER whose allocation has not come by then never will (x the time dilation k:
# the allocation waits for RLD's engine, whose steps last k times longer).
EARLY_TAKEOVER_TTL_S = 10.0


@dataclass
class _Request:
    alloc: KvAllocRequest
    reservation: KVReservation | None
    fsm: RelayHandoff
    serial: Serial
    p_conn: Outbox  # P's control lane (KV_ABORT on failure)
    decoding: bool = False  # the engine sequence exists
    kv_done: bool = False  # P's KV_DONE came: none of its writes is in flight
    handoff_bytes: int = 0
    # output index -> logprobs of a token sampled for it, until emitted (requests asking them)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)

    @property
    def rid(self) -> str:
        return self.alloc.request_id


class RelayDaemon(KvReceiver):
    role = "relay"
    section_name = "relay"
    kv_path = "intra_dc"

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        pol = config.policy
        self.policy = HandoffPolicy(
            mode=pol.handoff,
            threshold_tokens=pol.handoff_threshold_tokens,
            chunk=pol.handoff_chunk,
            rld_load_limit=pol.rld_load_limit,
        )
        self.hands_off = config.mode is ClusterMode.PDD
        sec = config.relay
        # Admission control only where a refusal has somewhere else to go (MD, in pdd mode).
        self.admission: RelayAdmission | None = None
        if self.hands_off:
            self.admission = RelayAdmission(
                max_running_tokens=pol.rld_max_running_tokens or sec.num_blocks * sec.block_size,
                max_blocks=sec.num_blocks,
                max_requests=pol.rld_max_requests,
            )
        self.step_s = 0.0  # EWMA of decode step time = seconds per token of a request
        self.md: Peer | None = None
        self.requests: dict[str, _Request] = {}
        self._p_boxes: dict[Connection, Outbox] = {}
        # TAKEOVERs that overtook their request's KV_ALLOC_REQUEST (they come on different
        # connections, and P's allocation may still wait for this engine): applied once the
        # request is allocated here, or answered with CANCEL when it is refused or ends first.
        self._early_takeovers: OrderedDict[str, Takeover] = OrderedDict()
        self._early_since: dict[str, float] = {}  # when each was parked (monotonic)
        self._shm_name = segment_name(
            f"{instance_id_safe(config.name)}-relay-{os.getpid()}-{secrets.token_hex(3)}"
        )

    def kv_shm_name(self) -> str | None:
        return self._shm_name if self.config.transport.intra_dc == "shm" else None

    async def dial_peers(self) -> None:
        await self.register_sink()
        if self.hands_off:
            self.md = self.peer(self.config.main_decode.dial_address(), "main-decode control")
            await self.md.connect_first()

    # -- messages ------------------------------------------------------------------------------

    async def handle(self, conn: Connection, msg: Message) -> None:
        if isinstance(msg, Submit) and conn.peer_role == "router":
            old = self.requests.get(msg.request_id)
            if old is not None:  # its producer elsewhere was lost: stop our part first
                old.fsm.cancel()
                self._stop(old)
            self.replay(msg, old.serial if old is not None else None)
        elif isinstance(msg, KvAllocRequest):
            await self._alloc(self._p_outbox(conn), msg)
        elif isinstance(msg, KvDone):
            if not self.unfence(msg.request_id):
                self._kv_done(msg)
        elif isinstance(msg, Takeover):
            self._takeover(msg)
        elif isinstance(msg, KvAbort) and self.unfence(msg.request_id):
            pass  # P's confirmation that no write of a dropped request is in flight
        elif isinstance(msg, (Cancel, KvAbort)):
            req = self.requests.get(msg.request_id)
            if isinstance(msg, KvAbort) and req is not None:
                req.kv_done = True  # P sends KV_ABORT after its writes have stopped
            self._drop(msg.request_id, msg.reason)
        elif isinstance(msg, RequestDone):
            self._drop(msg.request_id, f"{msg.producer} finished the request")
        else:
            log.warning(
                "%s: unexpected %s from %s", self.instance_id, msg.TYPE.name, conn.peer_role
            )

    def _p_outbox(self, conn: Connection) -> Outbox:
        box = self._p_boxes.get(conn)
        if box is None:  # replies to P go back on the connection P dialled
            box = self._p_boxes[conn] = self.outbox(conn, f"{conn.peer_role} control")
        return box

    async def _alloc(self, p: Outbox, msg: KvAllocRequest) -> None:
        rid = msg.request_id
        engine = self.engine
        assert engine is not None
        await self._sink_ready.wait()  # P may ask while the pool is being registered
        assert self.sink is not None
        if self.admission is not None and rid not in self.requests:
            total = msg.num_tokens + msg.max_tokens
            # P->RLD requests stay here to the end: only their share of RLD (never flooded)
            verdict = self.admission.try_admit(
                rid, total, -(-(total - 1) // engine.block_size), singular=msg.pipeline == "p_rld"
            )
            if not verdict.admitted:
                self._release_early_takeover(rid, "relay refused the request")
                self.refuse_alloc(p, rid, f"admission: {verdict.reason}")
                return

        def refused() -> None:
            self._release_early_takeover(rid, "relay refused the request")
            if self.admission is not None and rid not in self.requests:
                self.admission.release(rid)

        res = await self.reserve_for(p, msg, self.requests, on_refuse=refused)
        if res is None:
            return
        pipeline_hands_off = self.hands_off and msg.pipeline in HANDS_OFF_PIPELINES
        policy = self.policy
        if msg.handoff_mode is not None:  # the request's own override, carried from SUBMIT
            policy = dataclasses.replace(policy, mode=HandoffMode.parse(msg.handoff_mode))
        req = _Request(
            msg,
            res,
            RelayHandoff(msg.num_tokens, policy, pipeline_hands_off),
            Serial(f"relay {rid}", self._tasks),
            p,
        )
        self.requests[rid] = req
        self.counters["allocated"] += 1
        p.post(
            KvAllocResponse(
                request_id=rid,
                accepted=True,
                hit_tokens=res.num_cached_tokens,
                block_ids=tuple(res.block_ids),
                block_size=engine.block_size,
                dtype=engine.spec.dtype,
                region=self.sink.descriptor,
                step_s=round(self.step_s, 6),
            )
        )
        early = self._early_takeovers.pop(rid, None)
        self._early_since.pop(rid, None)
        if early is not None:  # MD's copy was complete before this allocation was made
            self.counters["early_takeovers"] += 1
            self._takeover(early)

    def _kv_done(self, msg: KvDone) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.decoding or req.fsm.phase is not RelayPhase.DECODING:
            return
        req.kv_done = True
        alloc = req.alloc
        if msg.num_tokens != alloc.num_tokens:
            self._abort(
                req, f"KV_DONE covers {msg.num_tokens} positions, expected {alloc.num_tokens}"
            )
            return
        self.timeline(req.rid, "rld_kv_complete", msg.num_bytes)
        first = msg.first_token_id
        entry = first_token_logprob(msg)
        if entry is not None:
            req.logprobs[0] = entry
        ends = first_token_ends(first, alloc, self.engine.eos_token_id)
        if ends is None:
            req.decoding = True
            req.serial.submit(lambda: self._start(req, first))
        self._apply(req, req.fsm.rld_token(0, first, ends))

    async def _start(self, req: _Request, first: int) -> None:
        alloc = req.alloc
        if req.reservation is None:  # stopped before it started
            return
        res, req.reservation = req.reservation, None
        try:
            await self.compute(
                self.engine.add_request,
                alloc.prompt_token_ids,
                alloc.max_tokens,
                sampling_of(alloc),
                alloc.request_id,
                ignore_eos=alloc.ignore_eos,
                output_token_ids=[first],
                kv=res,
            )
        except ValueError as exc:
            await self.compute(self.engine.free_reservation, res)
            req.decoding = False
            self.error(req.rid, "decode_failed", f"relay could not start decoding: {exc}")
            self._forget(req)
            return
        self.wake()

    def _takeover(self, msg: Takeover) -> None:
        rid = msg.request_id
        req = self.requests.get(rid)
        if req is None:
            if rid in self.ended or self.md is None:
                return  # ended here (cut, finished or cancelled: MD was told) or a late report
            # Not allocated here yet: P sends KV_ALLOC_REQUEST to RLD before any KV goes to MD,
            # but on another connection, so MD's TAKEOVER can overtake it. Keep it until the
            # allocation is made (or refused); answering CANCEL now would turn a request RLD
            # is about to take into one RLD decodes alone.
            now_s = time.monotonic()
            self._early_takeovers[rid] = msg
            self._early_takeovers.move_to_end(rid)
            self._early_since[rid] = now_s
            # An allocation comes within a round trip or never: each parked TAKEOVER has its
            # own timer, so a lone one goes too (it was swept only by a later one before).
            asyncio.get_running_loop().call_later(
                EARLY_TAKEOVER_TTL_S * self.dilation, self._expire_early, rid, now_s
            )
            while len(self._early_takeovers) > CANCELLED_MEMORY:
                self._release_early_takeover(
                    next(iter(self._early_takeovers)), "relay never received the request"
                )
            return
        try:
            actions = req.fsm.takeover(msg.ready_position, msg.chunk_tokens, self.load())
        except HandoffError as exc:
            self._abort(req, f"bad TAKEOVER: {exc}")
            return
        self._apply(req, actions)

    def load(self) -> float:
        """Running tokens / capacity: how full RLD is (the dynamic policy's load signal)."""
        engine = self.engine
        tokens = sum(
            r.alloc.num_tokens + r.fsm.num_tokens for r in self.requests.values() if r.decoding
        )
        return min(1.0, tokens / (engine.num_blocks * engine.block_size))

    def _expire_early(self, rid: str, parked_at: float) -> None:
        if not self.closing and self._early_since.get(rid) == parked_at:
            self.counters["early_takeovers_expired"] += 1
            self._release_early_takeover(rid, "relay never received the request")

    def _release_early_takeover(self, rid: str, reason: str) -> None:
        """A parked TAKEOVER's request will not be allocated here: MD must not wait for a cut."""
        self._early_since.pop(rid, None)
        if self._early_takeovers.pop(rid, None) is not None and self.md is not None:
            self.md.post(Cancel(request_id=rid, reason=reason))

    def _drop(self, rid: str, reason: str) -> None:
        if self.drop_replay(rid):
            return
        self.ended.add(rid)
        self._release_early_takeover(rid, f"ended before the relay allocated it: {reason}"[:4096])
        req = self.requests.get(rid)
        if req is None:
            return
        self.counters["cancelled"] += 1
        req.fsm.cancel()
        self._stop(req)

    def _abort(self, req: _Request, reason: str, code: str = "relay_failed") -> None:
        log.warning("%s: %s: %s", self.instance_id, req.rid, reason)
        self.error(req.rid, code, reason)
        req.p_conn.post(KvAbort(request_id=req.rid, reason=reason[:4096]))
        if self.md is not None and req.fsm.hands_off:
            self.md.post(Cancel(request_id=req.rid, reason=reason[:4096]))
        req.fsm.cancel()
        self._stop(req)

    # -- engine progress -------------------------------------------------------------------------

    def on_step(self, outputs: list[StepOutput]) -> None:
        outputs = [out for out in outputs if not self.replay_step(out)]
        last = self.engine.last_step
        if last is not None and last.num_decode_tokens and not last.num_prefill_tokens:
            # A pure decode step: what one more output token of a request costs right now.
            self.step_s = (
                last.duration_s if not self.step_s else (0.8 * self.step_s + 0.2 * last.duration_s)
            )
        for out in outputs:
            req = self.requests.get(out.request_id)
            if req is None:
                continue
            reasons = step_end_reasons(out, req.alloc.stop_token_ids)
            if reasons is None:  # our own abort
                continue
            if out.finished:
                req.decoding = False  # the engine freed the blocks itself
            for i, entry in enumerate(out.logprobs or ()):
                req.logprobs[out.output_index + i] = entry
            for i, (tok, reason) in enumerate(zip(out.new_token_ids, reasons, strict=False)):
                self._apply(req, req.fsm.rld_token(out.output_index + i, tok, reason))

    def engine_failed(self, reason: str) -> None:
        self.replays_failed(reason)
        for req in [r for r in self.requests.values() if r.decoding]:
            self._abort(req, reason, code="engine_failed")

    # -- actions -----------------------------------------------------------------------------------

    def _apply(self, req: _Request, actions: list[Action]) -> None:
        rid = req.rid
        for a in actions:
            if isinstance(a, EmitTokens):
                self.emit_tokens(
                    rid,
                    a.index,
                    a.token_ids,
                    take_logprobs(req.logprobs, req.alloc, a.index, len(a.token_ids)),
                )
            elif isinstance(a, SendHandoff):
                msg = Handoff(
                    request_id=rid,
                    start_index=a.start_index,
                    token_ids=a.token_ids,
                    final=a.final,
                    mode=a.mode,
                )
                req.handoff_bytes += len(encode_bytes(msg))
                assert self.md is not None
                self.md.post(msg)
                if a.final:
                    self.counters["handed_off"] += 1
            elif isinstance(a, StopSequence):
                self._stop(req)
            elif isinstance(a, FinishRequest):
                self.counters["finished_here"] += 1
                self.request_done(rid, a.reason, req.alloc.num_tokens, a.num_output_tokens)
                if req.fsm.hands_off:  # P may still be shipping the WAN copy: stop it
                    req.p_conn.post(KvAbort(request_id=rid, reason="relay finished the request"))
                self._stop(req)
            elif isinstance(a, CancelPeer):
                if self.md is not None:
                    self.md.post(Cancel(request_id=rid, reason=a.reason))
            elif isinstance(a, HandoffStarted):
                self.timeline(rid, "handoff_start", a.backlog_tokens, a.mode)
            elif isinstance(a, HandoffAbandoned):
                self.counters["handoffs_abandoned"] += 1
                self.timeline(rid, "handoff_abandoned", None, a.reason[:128])

    def _stop(self, req: _Request) -> None:
        """Free the request's sequence or reservation (in order after its start) and forget it."""
        if req.rid not in self.requests:
            return
        self._forget(req)

        fence = req.reservation is not None and self.writes_may_land(req.kv_done)

        async def stop() -> None:
            if req.reservation is not None:
                res, req.reservation = req.reservation, None
                if fence:
                    self.fence(req.rid, res)
                else:
                    await self.compute(self.engine.free_reservation, res)
            if req.decoding:
                req.decoding = False
                await self.compute(self.engine.abort, req.rid)

        req.serial.submit(stop)

    def _forget(self, req: _Request) -> None:
        if self.requests.get(req.rid) is req:
            del self.requests[req.rid]
            self.ended.add(req.rid)
            if self.admission is not None:
                self.admission.release(req.rid)

    def connection_lost(self, conn: Connection) -> None:
        box = self._p_boxes.pop(conn, None)
        if box is not None:
            for req in [r for r in self.requests.values() if r.p_conn is box and not r.decoding]:
                self._drop(req.rid, "prefill connection closed before its KV was complete")
            for rid in list(self._early_takeovers):  # their allocations will not come now
                self._release_early_takeover(rid, "prefill connection closed")
        if self.md is not None and conn is self.md.conn:
            # RLD is the fallback: whatever MD was to take over, RLD now finishes alone.
            for req in [r for r in self.requests.values() if r.fsm.hands_off]:
                self._apply(req, req.fsm.peer_lost())
            self._early_takeovers.clear()
            self._early_since.clear()

    # -- stats ---------------------------------------------------------------------------------------

    def request_stats(self) -> dict[str, int]:
        return self.decode_request_stats(
            self.requests, "allocated", "finished_here", "handed_off", "cancelled", "refused"
        )

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["shm_region"] = self.kv_shm_name()
        out["transport"] = (
            {
                "intra_dc": {
                    **self.kv_paths.stats()["intra_dc"],
                    "descriptor": self.sink.descriptor if self.sink else None,
                    "fenced_reservations": len(self.fenced),
                }
            }
            if self.kv_paths is not None
            else {}
        )
        out["load"] = self.load() if self.engine is not None else 0.0
        out["active_phases"] = self.active_phases(self.requests)
        out["early_takeovers_waiting"] = len(self._early_takeovers)
        out["step_s"] = round(self.step_s, 6)
        if self.admission is not None:
            out["admission"] = self.admission.counters()
        return out


def instance_id_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name)[:60] or "pdd"
