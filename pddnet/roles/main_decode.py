"""MD: the main decode pool in datacenter B, reached only over the WAN (it never dials).

KV_ALLOC_REQUEST -> reserve_kv at MD's own block size (P's may differ; import_kv re-blocks and
converts the dtype); KV_CHUNK frames are imported into the reservation as they arrive, in any
order over the stripes; when KV_DONE and every chunk are in, the copy is complete. With a relay
(pipeline p_rld_md) MD then sends TAKEOVER, stays held until RLD's final HANDOFF, extends the
handed-over token ids (at most `chunk` per step when streaming) and decodes from the cut on;
without one (p_md, the cross-dc baseline) it decodes and emits from index 0. The per-request
decisions are pddnet.lifecycle.handoff.MainHandoff's.

The decode-side RadixCache (DRC, main_decode.prefix_cache = "radix"): reserve_kv matches and pins
the prompt's cached prefix, so P sends only positions past MD's hit; every computed full block
(prompt and generated tokens) is inserted as the engine steps, so a conversation's next turn hits
it. What the tree inserted and evicted goes to P as CACHE_EVENTS, drained in the engine thread
within the calls MD makes anyway (reserve, import) and sent just before MD's next KV_ALLOC_RESPONSE
or KV_RECEIVED -- a new P connection first gets a snapshot (reset=True).

The KV path P -> MD is `[transport] wan`: `tcp` (the KV_CHUNK import above; KV_DONE counts
chunks and bytes) or `mooncake` (MD's pool is registered with the Transfer Engine and P writes
straight into the reserved blocks; the copy is complete on KV_DONE, which P sends after the
engine acknowledged every write). A mooncake write may still be in flight when MD drops a
request before its KV_DONE: the reservation is fenced (kept) until P's KV_ABORT says the writes
stopped, or a bound passes (see RelayDaemon).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pddnet.config import ClusterConfig
from pddnet.engine.engine import Engine, KVReservation, StepOutput
from pddnet.engine.sampling import TokenLogprob
from pddnet.engine.sequence import FinishReason
from pddnet.kv.radix import HIT_INTERVAL_LABELS, RadixCache
from pddnet.lifecycle.handoff import (
    Action,
    AppendTokens,
    EmitTokens,
    FinishRequest,
    FirstMainToken,
    HandoffEnded,
    HandoffError,
    MainHandoff,
    MainPhase,
    ReleaseHold,
    SendTakeover,
    SetChunk,
    StartSequence,
    StopSequence,
)
from pddnet.protocol import (
    CacheEvents,
    Cancel,
    Handoff,
    KvAbort,
    KvAllocRequest,
    KvAllocResponse,
    KvChunk,
    KvDone,
    KvReceived,
    Message,
    RequestDone,
    Submit,
    Takeover,
    encode_bytes,
)
from pddnet.transport import Connection
from pddnet.transport.backends.tcp import TcpSink
from pddnet.transport.kv_backend import TransferError, WriteTarget

from .common import (
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

WITH_RELAY_PIPELINES = ("p_rld_md",)


SequenceEdit = AppendTokens | SetChunk | ReleaseHold


def edit_sequence(engine: Engine, rid: str, edits: tuple[SequenceEdit, ...]) -> FinishReason | None:
    """In the engine thread, between two steps: apply a HANDOFF's edits in order. Returns the
    finish reason if appended tokens end the request (the engine then freed it)."""
    for e in edits:
        if isinstance(e, SetChunk):
            engine.set_max_chunk_tokens(rid, e.max_chunk_tokens)
        elif isinstance(e, AppendTokens):
            reason = engine.append_tokens(rid, e.token_ids)
            if reason is not None:
                return reason
        else:
            engine.set_hold(rid, False)
    return None


@dataclass
class _Request:
    alloc: KvAllocRequest
    reservation: KVReservation | None
    fsm: MainHandoff
    serial: Serial
    p_conn: Outbox
    chunks: set[int] = field(default_factory=set)
    bytes_in: int = 0
    imports_pending: int = 0
    done: KvDone | None = None
    started: bool = False  # the engine sequence exists (or is being added)
    handoff_bytes: int = 0
    first_chunk_at: float | None = None  # monotonic arrival times, for P's goodput estimate
    last_chunk_at: float = 0.0
    first_chunk_bytes: int = 0
    writes_stopped: bool = False  # P's KV_ABORT came: no one-sided write is in flight
    # output index -> logprobs of a token sampled for it, until emitted (requests asking them)
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)

    @property
    def rid(self) -> str:
        return self.alloc.request_id


class MainDecodeDaemon(KvReceiver):
    role = "main_decode"
    section_name = "main_decode"
    kv_path = "wan"

    def __init__(self, config: ClusterConfig) -> None:
        super().__init__(config)
        self.chunk_tokens = config.policy.handoff_chunk
        self.rld: Outbox | None = None
        self.requests: dict[str, _Request] = {}
        self._p_boxes: dict[Connection, Outbox] = {}
        # Most tokens one step computed for a request after its first HANDOFF, by handoff mode:
        # the one-shot stall vs streaming's `chunk` cap, as measured.
        self.max_extend_tokens: dict[str, int] = {}
        self.handoffs_by_mode: dict[str, int] = {}
        # CACHE_EVENTS drained in the engine thread, posted to every P from the event loop
        self._cache_notices: deque[CacheEvents] = deque()
        # KV_ALLOCs the pool has no room for *now* (each fits once others free their blocks):
        # they wait here, first come first served, instead of failing the request at a
        # momentary peak; asked again whenever blocks may have been freed.
        self._waiting_allocs: deque[tuple[Outbox, KvAllocRequest]] = deque()
        self._retrying = False
        self._retry_again = False
        self._telling_router = False

    async def dial_peers(self) -> None:
        await self.register_sink()

    @property
    def radix(self) -> RadixCache | None:
        cache = self.engine.prefix_cache if self.engine is not None else None
        return cache if isinstance(cache, RadixCache) else None

    async def _on_connection(self, conn: Connection) -> None:
        if conn.lane == "control" and conn.peer_role == "relay":
            self.rld = self.outbox(conn, "relay control")
        elif conn.lane == "control" and conn.peer_role == "prefill":
            box = self._p_boxes[conn] = self.outbox(conn, "prefill control")
            if self.radix is not None:  # P's view starts from what the tree holds now
                snapshot = await self.compute(self._snapshot)
                box.post(snapshot)
        await super()._on_connection(conn)

    # -- the decode-side cache's notices to P --------------------------------------------------

    def _snapshot(self) -> CacheEvents:
        """In the engine thread: the whole tree; `seq` is the next incremental notice's number
        (events still pending are in the snapshot already and harmless to apply again)."""
        radix = self.radix
        assert radix is not None
        return CacheEvents(
            seq=radix.next_event_seq,
            block_size=radix.block_size,
            inserted=tuple(radix.snapshot_hashes()),
            evicted=(),
            reset=True,
        )

    def _drain_cache_events(self) -> None:
        """In the engine thread, inside a call MD makes anyway: queue what the tree did."""
        radix = self.radix
        if radix is None:
            return
        while (batch := radix.drain_events()) is not None:
            self._cache_notices.append(
                CacheEvents(
                    seq=batch.seq,
                    block_size=batch.block_size,
                    inserted=batch.inserted,
                    evicted=batch.evicted,
                )
            )

    def _post_cache_events(self) -> None:
        """Piggy-back the queued notices on the frame MD is about to send to P."""
        while self._cache_notices:
            notice = self._cache_notices.popleft()
            for box in self._p_boxes.values():
                box.post(notice)

    def reserve_in_engine(self, token_ids: tuple[int, ...], max_tokens: int) -> KVReservation:
        res = super().reserve_in_engine(token_ids, max_tokens)
        self._drain_cache_events()
        return res

    def _import_in_engine(self, msg: KvChunk, target: WriteTarget) -> int:
        """In the engine thread: the tcp sink checks and imports the chunk (its payload bytes)."""
        sink = self.sink
        assert isinstance(sink, TcpSink)
        nbytes = sink.receive(msg, target)
        self._drain_cache_events()
        return nbytes

    # -- messages ------------------------------------------------------------------------------

    async def handle(self, conn: Connection, msg: Message) -> None:
        if isinstance(msg, Submit) and conn.peer_role == "router":
            old = self.requests.get(msg.request_id)
            if old is not None:  # its producer elsewhere was lost: stop our part first
                # ... and tell P, which may still be copying KV for it: the replay recomputes
                # what it needs, and P's KV_DONE would now be ignored here (a stale message),
                # leaving P holding the request and its blocks for good.
                old.p_conn.post(
                    KvAbort(request_id=old.rid, reason="replayed on main decode by the router")
                )
                old.fsm.cancel()
                self._stop(old)
            self.replay(msg, old.serial if old is not None else None)
        elif isinstance(msg, KvChunk):
            await self._chunk(msg)
        elif isinstance(msg, KvAllocRequest):
            await self._alloc(self._p_boxes[conn], msg)
        elif isinstance(msg, KvDone):
            if not self.unfence(msg.request_id):
                self._kv_done(msg)
        elif isinstance(msg, Handoff):
            self._handoff(msg)
        elif isinstance(msg, KvAbort) and self.unfence(msg.request_id):
            pass  # P's confirmation that no write of a dropped request is in flight
        elif isinstance(msg, (Cancel, KvAbort)):
            req = self.requests.get(msg.request_id)
            if isinstance(msg, KvAbort) and req is not None:
                req.writes_stopped = True  # P sends KV_ABORT after its writes have stopped
            self._drop(msg.request_id)
        elif isinstance(msg, RequestDone):
            self._drop(msg.request_id)
        else:
            log.warning(
                "%s: unexpected %s from %s", self.instance_id, msg.TYPE.name, conn.peer_role
            )

    async def _alloc(self, p: Outbox, msg: KvAllocRequest) -> None:
        assert self.engine is not None
        await self._sink_ready.wait()  # P may ask while the pool is being registered
        assert self.sink is not None
        if self._waiting_allocs:  # strict FIFO: no overtaking a request already waiting
            self._wait_for_room(p, msg)
            return
        res = await self.reserve_for(
            p, msg, self.requests, on_short=lambda: self._wait_for_room(p, msg)
        )
        if res is not None:
            self._accept(p, msg, res)

    def _wait_for_room(self, p: Outbox, msg: KvAllocRequest) -> None:
        self.counters["alloc_waits"] += 1
        self.timeline(msg.request_id, "kv_alloc_wait", len(self._waiting_allocs))
        self._waiting_allocs.append((p, msg))
        if not self._telling_router:
            self._telling_router = True
            self.spawn(self._still_waiting(), "KV allocations waiting for room")
        self._kick_waiting()  # blocks may have been freed while it was being reserved

    async def _still_waiting(self) -> None:
        """While allocations wait, say so to the router (their queue position) at a third of
        its stall timeout: a request queued here is not stalled, and replaying it elsewhere
        would only add load where there is too much already."""
        period = self.config.router.stall_timeout_s / 3
        try:
            while self._waiting_allocs:
                await asyncio.sleep(period)
                for position, (_, msg) in enumerate(list(self._waiting_allocs)):
                    self.timeline(msg.request_id, "kv_alloc_wait", position)
        finally:
            self._telling_router = False

    def _kick_waiting(self) -> None:
        """Blocks may have been freed: ask again for the waiting allocations, in order."""
        if not self._waiting_allocs:
            return
        if self._retrying:
            self._retry_again = True
            return
        self._retrying = True
        self.spawn(self._retry_waiting(), "retry waiting KV allocations")

    async def _retry_waiting(self) -> None:
        try:
            while self._waiting_allocs:
                self._retry_again = False
                head = self._waiting_allocs[0]
                p, msg = head
                short = False

                def still_short() -> None:
                    nonlocal short
                    short = True

                res = await self.reserve_for(p, msg, self.requests, on_short=still_short)
                if short and self._waiting_allocs and self._waiting_allocs[0] is head:
                    if self._retry_again:
                        continue  # something was freed meanwhile: try once more
                    return
                if self._waiting_allocs and self._waiting_allocs[0] is head:
                    self._waiting_allocs.popleft()
                if res is not None:
                    self._accept(p, msg, res)
        finally:
            self._retrying = False

    def _accept(self, p: Outbox, msg: KvAllocRequest, res: KVReservation) -> None:
        rid = msg.request_id
        engine = self.engine
        assert engine is not None and self.sink is not None
        spec = engine.spec
        fsm = MainHandoff(
            msg.num_tokens, self.chunk_tokens, with_relay=msg.pipeline in WITH_RELAY_PIPELINES
        )
        self.requests[rid] = _Request(msg, res, fsm, Serial(f"main {rid}", self._tasks), p)
        self.counters["allocated"] += 1
        self._post_cache_events()
        p.post(
            KvAllocResponse(
                request_id=rid,
                accepted=True,
                hit_tokens=res.num_cached_tokens,
                block_ids=tuple(res.block_ids),
                block_size=engine.block_size,
                dtype=spec.dtype,
                region=self.sink.descriptor,
            )
        )

    async def _chunk(self, msg: KvChunk) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.fsm.phase is not MainPhase.RECEIVING_KV:
            return  # cancelled or unknown: the bytes are simply dropped
        if self.one_sided:
            self._abort(
                req,
                f"KV_CHUNK {msg.chunk_index} on a {self.sink.backend} path (P writes "
                "into the pool itself): P and MD disagree on [transport] wan",
            )
            return
        res = req.reservation
        assert res is not None
        fault = self._chunk_fault(req, res, msg)
        if fault is not None:
            self._abort(req, f"bad KV_CHUNK {msg.chunk_index}: {fault}")
            return
        req.chunks.add(msg.chunk_index)
        req.imports_pending += 1
        arrived = time.monotonic()
        if req.first_chunk_at is None:
            req.first_chunk_at, req.first_chunk_bytes = arrived, msg.payload.nbytes
        req.last_chunk_at = arrived
        await self._import(req, res, msg)

    @staticmethod
    def _chunk_fault(req: _Request, res: KVReservation, msg: KvChunk) -> str | None:
        """This request's accounting of a chunk (the pool's checks are the sink's)."""
        if msg.chunk_index in req.chunks:
            return "duplicate chunk index"
        if not res.num_cached_tokens <= msg.token_start < msg.token_end <= req.alloc.num_tokens:
            return (
                f"positions [{msg.token_start}, {msg.token_end}) outside the "
                f"uncached range [{res.num_cached_tokens}, {req.alloc.num_tokens})"
            )
        return None

    async def _import(self, req: _Request, res: KVReservation, msg: KvChunk) -> None:
        if req.reservation is not res:  # dropped meanwhile
            return
        target = WriteTarget(tuple(res.block_ids), self.engine.block_size, res.num_cached_tokens)
        try:
            nbytes = await self.compute(self._import_in_engine, msg, target)
        except TransferError as exc:
            self._abort(req, f"bad KV_CHUNK {msg.chunk_index}: {exc}")
            return
        req.imports_pending -= 1
        req.bytes_in += nbytes
        self._check_complete(req)

    def _kv_done(self, msg: KvDone) -> None:
        req = self.requests.get(msg.request_id)
        if req is None or req.fsm.phase is not MainPhase.RECEIVING_KV:
            return
        if req.done is not None or msg.num_tokens != req.alloc.num_tokens:
            self._abort(
                req,
                f"bad KV_DONE: {msg.num_tokens} positions (expected "
                f"{req.alloc.num_tokens}), repeated={req.done is not None}",
            )
            return
        if self.one_sided and msg.num_chunks:
            self._abort(
                req,
                f"KV_DONE counts {msg.num_chunks} KV_CHUNK frames on a "
                f"{self.sink.backend} path: P and MD disagree on [transport] wan",
            )
            return
        req.done = msg
        if self.one_sided:
            # Every write landed before P sent KV_DONE (the engine acknowledged them).
            arrived = time.monotonic()
            req.first_chunk_at, req.last_chunk_at = arrived, arrived
            req.bytes_in = msg.num_bytes
        self._check_complete(req)

    def _check_complete(self, req: _Request) -> None:
        done = req.done
        if done is None or req.imports_pending or req.fsm.phase is not MainPhase.RECEIVING_KV:
            return
        if self.one_sided:
            pass  # KV_DONE alone says the copy is in (no chunks to count)
        elif len(req.chunks) > done.num_chunks or req.bytes_in > done.num_bytes:
            self._abort(
                req,
                f"received {len(req.chunks)} chunks / {req.bytes_in} bytes, more "
                f"than KV_DONE's {done.num_chunks} / {done.num_bytes}",
            )
            return
        elif len(req.chunks) < done.num_chunks or req.bytes_in < done.num_bytes:
            return  # KV_DONE overtook chunks still on the bulk lanes
        self.timeline(req.rid, "md_kv_complete", req.bytes_in)
        self._post_cache_events()
        span = req.last_chunk_at - req.first_chunk_at if req.first_chunk_at is not None else 0.0
        req.p_conn.post(
            KvReceived(
                request_id=req.rid,
                num_bytes=req.bytes_in,
                span_bytes=max(0, req.bytes_in - req.first_chunk_bytes),
                span_s=max(0.0, span),
            )
        )
        alloc = req.alloc
        first = done.first_token_id
        entry = first_token_logprob(done)
        if entry is not None and not req.fsm.with_relay:  # MD emits index 0 (P->MD)
            req.logprobs[0] = entry
        ends = first_token_ends(first, alloc, self.engine.eos_token_id)
        if ends is not None:  # P's token ended the request: nothing to decode here
            if not req.fsm.with_relay:
                self.emit_tokens(req.rid, 0, [first], take_logprobs(req.logprobs, alloc, 0, 1))
                self.request_done(req.rid, ends, alloc.num_tokens, 1)
            self._stop(req)
            return
        self._apply(req, req.fsm.kv_complete(first))

    def _handoff(self, msg: Handoff) -> None:
        req = self.requests.get(msg.request_id)
        if req is None:
            return
        req.handoff_bytes += len(encode_bytes(msg))
        try:
            actions = req.fsm.handoff(msg.start_index, msg.token_ids, msg.final, msg.mode)
        except HandoffError as exc:
            self._abort(req, f"bad HANDOFF: {exc}")
            return
        self._apply(req, actions)

    def _drop(self, rid: str) -> None:
        if self.drop_replay(rid):
            return
        self.ended.add(rid)
        for entry in self._waiting_allocs:
            if entry[1].request_id == rid:  # it never got blocks: nothing else to free
                self._waiting_allocs.remove(entry)
                self.counters["cancelled"] += 1
                return
        req = self.requests.get(rid)
        if req is not None:
            self.counters["cancelled"] += 1
            req.fsm.cancel()
            self._stop(req)

    def _abort(
        self, req: _Request, reason: str, code: str = "main_decode_failed", tell_router: bool = True
    ) -> None:
        log.warning("%s: %s: %s", self.instance_id, req.rid, reason)
        if tell_router:
            self.error(req.rid, code, reason)
        else:
            self.timeline(req.rid, "md_dropped", None, reason[:128])
        req.p_conn.post(KvAbort(request_id=req.rid, reason=reason[:4096]))
        if req.fsm.with_relay and self.rld is not None:
            self.rld.post(Cancel(request_id=req.rid, reason=reason[:4096]))
        req.fsm.cancel()
        self._stop(req)

    # -- engine progress -------------------------------------------------------------------------

    def on_step(self, outputs: list[StepOutput]) -> None:
        if any(out.finished for out in outputs):
            self.blocks_freed()  # (the waiting allocations are asked after this step)
        for out in outputs:
            if self.replay_step(out):
                continue
            req = self.requests.get(out.request_id)
            if req is None:
                continue
            reasons = step_end_reasons(out, req.alloc.stop_token_ids)
            if reasons is None:
                continue  # our own abort
            new_tokens = out.new_token_ids[: len(reasons)]
            reason = reasons[-1] if reasons else None
            for i, entry in enumerate(out.logprobs or ()):
                req.logprobs[out.output_index + i] = entry
            if out.finished:
                req.started = False  # the engine freed the blocks itself
            if req.fsm.mode is not None:
                mode = req.fsm.mode
                self.max_extend_tokens[mode] = max(
                    self.max_extend_tokens.get(mode, 0), out.num_computed_this_step
                )
            try:
                actions = req.fsm.md_step(
                    out.num_computed_tokens, out.output_index, new_tokens, reason
                )
            except HandoffError as exc:
                self._abort(req, str(exc))
                continue
            self._apply(req, actions)

    def engine_failed(self, reason: str) -> None:
        self.replays_failed(reason)
        for req in [r for r in self.requests.values() if r.started]:
            self._abort(req, reason, code="engine_failed")

    # -- actions -----------------------------------------------------------------------------------

    def _apply(self, req: _Request, actions: list[Action]) -> None:
        rid = req.rid
        edits: list[SequenceEdit] = []  # this event's changes to the engine sequence
        for a in actions:
            if isinstance(a, (AppendTokens, SetChunk, ReleaseHold)):
                edits.append(a)
                continue
            self._flush_edits(req, edits)
            if isinstance(a, StartSequence):
                req.serial.submit(lambda a=a: self._start(req, a))
            elif isinstance(a, SendTakeover):
                if self.rld is None or not self.rld.alive:
                    self._abort(req, "no relay connected to hand over from")
                    return
                self.rld.post(
                    Takeover(
                        request_id=rid, ready_position=a.ready_position, chunk_tokens=a.chunk_tokens
                    )
                )
            elif isinstance(a, EmitTokens):
                self.emit_tokens(
                    rid,
                    a.index,
                    a.token_ids,
                    take_logprobs(req.logprobs, req.alloc, a.index, len(a.token_ids)),
                )
            elif isinstance(a, FirstMainToken):
                self.timeline(rid, "first_md_token", a.index)
            elif isinstance(a, HandoffEnded):
                self.counters["handoffs"] += 1
                self.handoffs_by_mode[a.mode] = self.handoffs_by_mode.get(a.mode, 0) + 1
                self.timeline(rid, "handoff_end", req.handoff_bytes, a.mode)
            elif isinstance(a, FinishRequest):
                self.counters["finished_here"] += 1
                done = self.request_done(rid, a.reason, req.alloc.num_tokens, a.num_output_tokens)
                if req.fsm.with_relay and self.rld is not None:
                    self.rld.post(done)
                self._stop(req)
            elif isinstance(a, StopSequence):
                self._stop(req)
        self._flush_edits(req, edits)

    def _flush_edits(self, req: _Request, edits: list[SequenceEdit]) -> None:
        """Queue one event's sequence edits as ONE engine call. Applied one call each, the
        engine could step between them: e.g. between a one-shot HANDOFF's append and its
        release it would extend all but the last handed-over token while still held, then
        that one -- two steps where the one-shot handoff is one extend."""
        if edits:
            batch = tuple(edits)
            edits.clear()
            req.serial.submit(lambda: self._edit(req, batch))

    async def _start(self, req: _Request, a: StartSequence) -> None:
        res, req.reservation = req.reservation, None
        if res is None:
            return
        alloc = req.alloc
        req.started = True  # before the call: the engine may step (and fail) before we resume
        try:
            await self.compute(
                self.engine.add_request,
                alloc.prompt_token_ids,
                alloc.max_tokens,
                sampling_of(alloc),
                alloc.request_id,
                ignore_eos=alloc.ignore_eos,
                output_token_ids=list(a.output_token_ids),
                kv=res,
                hold=a.hold,
            )
        except ValueError as exc:
            req.started = False
            await self.compute(self.engine.free_reservation, res)
            self._abort(req, f"could not start decoding: {exc}")
            return
        self.wake()

    async def _edit(self, req: _Request, edits: tuple[SequenceEdit, ...]) -> None:
        if not req.started:
            return
        try:
            reason = await self.compute(edit_sequence, self.engine, req.rid, edits)
        except ValueError as exc:  # a handover the engine cannot take (a relay bug)
            self._abort(req, f"could not apply the handoff: {exc}")
            return
        if reason is not None:  # cannot happen with a sane relay (it would have finished)
            req.started = False
            self._abort(req, f"handed-over tokens end the request ({reason})")
            return
        self.wake()

    def _stop(self, req: _Request) -> None:
        """Free the request's reservation or sequence (after its queued operations)."""
        if self.requests.get(req.rid) is not req:
            return
        del self.requests[req.rid]
        self.ended.add(req.rid)
        # P may still be writing into the reservation (one-sided, before KV_DONE / KV_ABORT).
        fence = self.writes_may_land(req.done is not None or req.writes_stopped)

        async def stop() -> None:
            if req.reservation is not None:
                res, req.reservation = req.reservation, None
                if fence:
                    self.fence(req.rid, res)
                else:
                    await self.compute(self.engine.free_reservation, res)
            if req.started:
                req.started = False
                await self.compute(self.engine.abort, req.rid)
            if self.radix is not None:
                # What this request left in the tree (its prompt and reply blocks) is what the
                # conversation's next turn will hit: tell P now, not with MD's next answer.
                await self.compute(self._drain_cache_events)
                self._post_cache_events()
            self.blocks_freed()

        req.serial.submit(stop)

    def blocks_freed(self) -> None:
        self._kick_waiting()

    def connection_lost(self, conn: Connection) -> None:
        box = self._p_boxes.pop(conn, None)
        if box is not None:
            for entry in [e for e in self._waiting_allocs if e[0] is box]:
                self._waiting_allocs.remove(entry)  # nobody left to answer
            for req in [
                r
                for r in self.requests.values()
                if r.p_conn is box and r.fsm.phase is MainPhase.RECEIVING_KV
            ]:
                self._abort(req, "prefill control connection closed before the KV was complete")
        if self.rld is not None and conn is self.rld.conn:
            self.rld = None
            # Without the relay there will be no cut: free the copy. Not an error for the
            # client: either RLD is alive and finishes the request alone (only the RLD -> MD
            # lane broke), or RLD died and the router replays the request (here or elsewhere).
            # A request past its final HANDOFF (decoding) no longer needs RLD: MD carries it
            # and the router counts MD as its producer; dropping it here left it with none, and
            # only the router's 30 s stall timer revived it (SIGKILL RLD after the handoff).
            for req in [
                r
                for r in self.requests.values()
                if r.fsm.with_relay
                and r.fsm.phase in (MainPhase.RECEIVING_KV, MainPhase.WAITING_CUT)
            ]:
                self._abort(
                    req, "relay connection closed before the final handoff", tell_router=False
                )

    # -- stats ---------------------------------------------------------------------------------------

    def request_stats(self) -> dict[str, int]:
        out = self.decode_request_stats(
            self.requests,
            "allocated",
            "finished_here",
            "handoffs",
            "cancelled",
            "refused",
            "alloc_waits",
        )
        out["waiting_for_room"] = len(self._waiting_allocs)
        out["active"] += len(self._waiting_allocs)
        return out

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out["max_extend_tokens"] = dict(self.max_extend_tokens)
        out["handoffs"] = dict(self.handoffs_by_mode)
        out["active_phases"] = self.active_phases(self.requests)
        if self.kv_paths is not None:
            out["transport"] = {
                "wan": {
                    **self.kv_paths.stats()["wan"],
                    "descriptor": self.sink.descriptor if self.sink else None,
                    "fenced_reservations": len(self.fenced),
                }
            }
        radix = self.radix
        if radix is not None:
            out["drc"] = {
                "lookups": radix.num_requests,
                "lookup_tokens": radix.tokens_asked,
                "hit_tokens": radix.tokens_hit,
                "hit_rate": round(radix.hit_rate, 6),
                "cached_blocks": radix.num_cached_blocks,
                "evictable_blocks": radix.num_evictable,
                "inserted_blocks": radix.num_inserted,
                "evicted_blocks": radix.num_evicted,
                "hit_intervals": dict(zip(HIT_INTERVAL_LABELS, radix.hit_histogram, strict=True)),
                "notices_sent": radix.next_event_seq,
                "events_dropped": radix.events_dropped,
            }
        return out
