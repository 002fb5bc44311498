"""RLD: a small decode pool next to P whose KV pool is a shared-memory "RDMA region".

It reserves blocks for P's one-sided writes (KV_ALLOC_REQUEST -> reserve_kv, answered with the
block ids and the region's name), starts decoding the moment P's completion (KV_DONE) arrives,
and streams every token to the router at once (eager). In pdd mode MD's TAKEOVER starts the
handoff; RLD alone decides the cut (pddnet.lifecycle.handoff.RelayHandoff, driven by each request's
pddnet.lifecycle.decode_request.DecodeRequest): one-shot stops at once, streaming forwards tokens
while MD catches up. In same-dc mode (pipeline p_rld) it is the
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
from typing import Any

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.engine.engine import StepOutput
from pddnet.kv.shm import segment_name
from pddnet.lifecycle.actions import ArmTimer, CancelParked, DecodeAction
from pddnet.lifecycle.decode_request import DecodeRequest, Role
from pddnet.lifecycle.takeover_hold import TakeoverHold
from pddnet.policy.admission import RelayAdmission
from pddnet.policy.handoff import HandoffMode, HandoffPolicy
from pddnet.protocol import Cancel, KvAllocRequest, Message, Takeover
from pddnet.transport import Connection

from .decode_tier import DecodeTier
from .ordering import CANCELLED_MEMORY
from .outbox import Outbox
from .peer import Peer

HANDS_OFF_PIPELINES = ("p_rld_md",)
# A parked TAKEOVER whose allocation has not come by then never will (x the time dilation k:
# the allocation waits for RLD's engine, whose steps last k times longer).
EARLY_TAKEOVER_TTL_S = 10.0


class RelayDaemon(DecodeTier):
    role = "relay"
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
        self.hold = TakeoverHold(EARLY_TAKEOVER_TTL_S * self.dilation, CANCELLED_MEMORY)
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

    @property
    def decode_peer(self) -> Peer | None:
        return self.md

    # -- messages ------------------------------------------------------------------------------

    async def handle_own(self, conn: Connection, msg: Message) -> bool:
        if not isinstance(msg, Takeover):
            return False
        self._takeover(msg)
        return True

    def _takeover(self, msg: Takeover) -> None:
        rid = msg.request_id
        if rid in self.requests:
            self.event(rid, lambda m: m.takeover(msg.ready_position, msg.chunk_tokens, self.load()))
        elif rid not in self.ended and self.md is not None:
            # Not allocated here yet: P sends KV_ALLOC_REQUEST to RLD before any KV goes to MD,
            # but on another connection, so MD's TAKEOVER can overtake it (TakeoverHold).
            self._hold(self.hold.park(msg, time.monotonic()))
        # else: ended here (cut, finished or cancelled: MD was told) or a late report

    async def _alloc(self, p: Outbox, msg: KvAllocRequest) -> None:
        rid = msg.request_id
        engine = self.engine
        assert engine is not None
        await self._sink_ready.wait()  # P may ask while the pool is being registered
        if self.admission is not None and rid not in self.requests:
            total = msg.num_tokens + msg.max_tokens
            # P->RLD requests stay here to the end: only their share of RLD (never flooded)
            verdict = self.admission.try_admit(
                rid, total, -(-(total - 1) // engine.block_size), singular=msg.pipeline == "p_rld"
            )
            if not verdict.admitted:
                self._hold(self.hold.release(rid, "relay refused the request"))
                self.refuse_alloc(p, rid, f"admission: {verdict.reason}")
                return

        def refused() -> None:
            self._hold(self.hold.release(rid, "relay refused the request"))
            if self.admission is not None and rid not in self.requests:
                self.admission.release(rid)

        res = await self.reserve_for(p, msg, self.requests, on_refuse=refused)
        if res is None:
            return
        policy = self.policy
        if msg.handoff_mode is not None:  # the request's own override, carried from SUBMIT
            policy = dataclasses.replace(policy, mode=HandoffMode.parse(msg.handoff_mode))
        machine = DecodeRequest(
            Role.RELAY,
            msg,
            hit_tokens=res.num_cached_tokens,
            eos_token_id=engine.eos_token_id,
            one_sided=self.one_sided,
            policy=policy,
            hands_off=self.hands_off and msg.pipeline in HANDS_OFF_PIPELINES,
        )
        self.accept(p, msg, res, machine, step_s=round(self.step_s, 6))
        early = self.hold.claim(rid)
        if early is not None:  # MD's copy was complete before this allocation was made
            self.counters["early_takeovers"] += 1
            self.event(
                rid, lambda m: m.takeover(early.ready_position, early.chunk_tokens, self.load())
            )

    def _hold(self, actions: list[DecodeAction]) -> None:
        """Carry out TakeoverHold's actions."""
        for a in actions:
            if isinstance(a, ArmTimer):
                asyncio.get_running_loop().call_later(
                    a.delay_s, self._expire, a.request_id, a.token
                )
            elif isinstance(a, CancelParked) and self.md is not None:
                self.md.post(Cancel(request_id=a.request_id, reason=a.reason))

    def _expire(self, rid: str, token: float) -> None:
        if self.closing:
            return
        actions = self.hold.expire(rid, token)
        if actions:
            self.counters["early_takeovers_expired"] += 1
            self._hold(actions)

    def main_dropped(self, rid: str, reason: str) -> None:
        self.hold.claim(rid)  # a TAKEOVER parked for it: MD will not take it over
        super().main_dropped(rid, reason)

    def drop_unallocated(self, rid: str, reason: str) -> bool:
        self._hold(self.hold.release(rid, f"ended before the relay allocated it: {reason}"[:4096]))
        return False

    def forgotten(self, rid: str) -> None:
        if self.admission is not None:
            self.admission.release(rid)

    def load(self) -> float:
        """Running tokens / capacity: how full RLD is (the dynamic policy's load signal)."""
        engine = self.engine
        tokens = sum(
            s.machine.alloc.num_tokens + s.machine.num_tokens
            for s in self.requests.values()
            if s.started
        )
        return min(1.0, tokens / (engine.num_blocks * engine.block_size))

    # -- engine progress -------------------------------------------------------------------------

    def on_step(self, outputs: list[StepOutput]) -> None:
        last = self.engine.last_step
        if last is not None and last.num_decode_tokens and not last.num_prefill_tokens:
            # A pure decode step: what one more output token of a request costs right now.
            self.step_s = (
                last.duration_s if not self.step_s else (0.8 * self.step_s + 0.2 * last.duration_s)
            )
        super().on_step(outputs)

    def connection_lost(self, conn: Connection) -> None:
        box = self._p_boxes.pop(conn, None)
        if box is not None:
            for slot in [s for s in self.requests.values() if s.p_conn is box and not s.started]:
                self._drop(slot.rid, "prefill connection closed before its KV was complete")
            # their allocations will not come now
            self._hold(self.hold.release_all("prefill connection closed"))
        if self.md is not None and conn is self.md.conn:
            # RLD is the fallback: whatever MD was to take over, RLD now finishes alone.
            for slot in list(self.requests.values()):
                self.apply(slot, slot.machine.peer_lost())
            self.hold.forget_all()

    # -- stats ---------------------------------------------------------------------------------------

    def request_stats(self) -> dict[str, int]:
        return self.decode_request_stats(
            "allocated", "finished_here", "handed_off", "cancelled", "refused"
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
        out["active_phases"] = self.active_phases()
        out["early_takeovers_waiting"] = len(self.hold)
        out["step_s"] = round(self.step_s, 6)
        if self.admission is not None:
            out["admission"] = self.admission.counters()
        return out


def instance_id_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "-" for c in name)[:60] or "pdd"
