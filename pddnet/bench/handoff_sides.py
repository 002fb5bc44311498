"""handoff bench: RLD's and MD's sides of one handoff, each driving the daemons' own handoff
machine (RelayHandoff on RLD, MainHandoff on MD): the bench hands over with the transitions,
HANDOFF messages and sequence edits the daemons make. Only the transports differ: the token ids
alone (token-id), or the ids plus the relay tokens' KV (KV-direct, the baseline).

What the daemons do between the machines and the wire is left out on purpose: MD's TAKEOVER is
given to RLD's machine in-process (its crossing is not part of the handoff latency, which starts
when RLD decides the cut), and RLD's engine keeps its sequence (StopSequence is not carried
out): every trial of a prompt replays the same relay tokens."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pddnet.bench.handoff_devices import paced_step
from pddnet.bench.handoff_setup import BLOCK_SIZE, KV_DIRECT, TOKEN_ID, Prepared
from pddnet.device.pacer import StepPacer
from pddnet.lifecycle.actions import (
    AppendTokens,
    FirstMainToken,
    ReleaseHold,
    SendHandoff,
    SendTakeover,
    SequenceEdit,
    SetChunk,
    StartSequence,
)
from pddnet.lifecycle.handoff import MainHandoff, RelayHandoff
from pddnet.policy.handoff import HandoffMode, HandoffPolicy

BULK_PREFIX = "bulk-"
HOST = "127.0.0.1"
# MD's extend cap in its TAKEOVER (the daemons' default); a one-shot cut does not use it
MD_CHUNK_TOKENS = HandoffPolicy().chunk


# -- MD's side: one handoff on MD's warm engine ---------------------------------------------------


class MainTrial:
    """MD's half of one handoff, driven by MainHandoff: the engine state when MD's copy of the
    prompt is complete (`setup`, which yields MD's TAKEOVER), then the messages from RLD
    (`on_handoff`, `on_chunk`), ending in `done` with MD's first two tokens. With `pacer` (MD's
    emulated device) the forward that samples MD's first token is paced (`paced_step`); the
    bench's own steps around it (indexing the prompt's KV in setup, the token after it for the
    check) are not: MD's daemon never makes the first, and the second is after the handoff.

    `engine` is MD's, long-lived and shared by every trial of a run (as MD's daemon's is, so
    that the paced forward is a steady-state one, not a fresh pool's first). Each trial starts
    it empty, as a cold copy of the prompt finds it (nothing of the prompt cached: its first
    forward indexes the prompt, as the daemon's does), and `close` empties it again: whatever
    the trial allocated is freed and its prefix cache evicted (`reset_engine`)."""

    def __init__(
        self,
        path: str,
        request_id: str,
        n: int,
        prep: Prepared,
        engine: Any,
        executor: ThreadPoolExecutor,
        pacer: StepPacer | None = None,
    ) -> None:
        self.path, self.rid, self.n, self.prep = path, request_id, n, prep
        self.engine, self.executor, self.pacer = engine, executor, pacer
        self.max_tokens = n + 3
        self.fsm = MainHandoff(len(prep.prompt), MD_CHUNK_TOKENS)
        self.edits: list[SequenceEdit] = []  # the HANDOFFs' edits of MD's held sequence
        self._started = False  # setup ran: `close` resets the engine
        self.reservation: Any = None
        self.reserved = asyncio.Event()
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.chunks: set[int] = set()
        self.kv_tokens = 0
        self.kv_bytes = 0
        self.t_handoff: float | None = None
        self.t_last_chunk: float | None = None
        self.import_s = 0.0
        self.t_sampled = 0.0
        self.forward_chunks: tuple[tuple[int, int], ...] = ()  # the sampling forward's shape
        self.forward_compute_s = 0.0  # its engine step alone, wall: what the pacer judges
        self._finishing = False

    async def _call(self, fn: Callable[..., Any], *a: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *a)

    # -- before the cut ---------------------------------------------------------------------

    async def setup(self) -> SendTakeover:
        """MD's copy of the prompt is complete: returns the TAKEOVER MD's machine sends."""
        actions = self.fsm.kv_complete(self.prep.first)
        (start,) = [a for a in actions if isinstance(a, StartSequence)]
        (takeover,) = [a for a in actions if isinstance(a, SendTakeover)]
        self._started = True
        if self.path == TOKEN_ID:
            await self._call(self._setup_token_id, start)
        else:
            await self._call(self._setup_kv_direct)
        return takeover

    def _reserve_cold(self, max_tokens: int) -> Any:
        """The prompt's blocks on MD's empty engine, and P's copy of its KV imported into them."""
        from pddnet.kv.transfer import import_kv

        res = self.engine.reserve_kv(self.prep.prompt, max_tokens)
        if res.num_cached_tokens:
            self.engine.free_reservation(res)
            raise AssertionError(
                f"{self.rid}: MD's engine already holds {res.num_cached_tokens} tokens of the "
                f"prompt (the previous trial did not reset it)"
            )
        import_kv(self.engine.pool, self.prep.prompt_kv, res.block_ids)
        return res

    def _setup_token_id(self, start: StartSequence) -> None:
        """StartSequence as MD's daemon carries it out: the sequence started on the imported KV
        with P's first token known, held until RLD's cut."""
        res = self._reserve_cold(self.max_tokens)
        self._start_sequence(start.output_token_ids, res, hold=start.hold)
        if self.engine.has_work():
            raise AssertionError("MD's held sequence has work before the cut")

    def _start_sequence(self, known: Sequence[int], kv: Any, hold: bool = False) -> None:
        """StartSequence on MD's engine: the prompt and every token known so far, on `kv`."""
        prep = self.prep
        self.engine.add_request(
            prep.prompt,
            self.max_tokens,
            prep.sampling,
            self.rid,
            ignore_eos=True,
            output_token_ids=list(known),
            kv=kv,
            hold=hold,
        )

    def _setup_kv_direct(self) -> None:
        """KV-direct defers StartSequence to the cut, when the relay tokens' KV has come: until
        then MD holds the prompt's KV in its prefix cache (imported, then indexed by a one-token
        step), so the reservation at the cut reuses it and only the relay tokens' KV crosses."""
        prep, md = self.prep, self.engine
        res = self._reserve_cold(1)
        pre = md.add_request(
            prep.prompt,
            1,
            prep.sampling,
            f"{self.rid}.p",
            ignore_eos=True,
            kv=res,
            keep_blocks=True,
        )
        first = [t for out in md.step() for t in out.new_token_ids]
        if first != [prep.first]:
            raise AssertionError(
                f"MD's view of the prompt samples {first}, P sampled "
                f"{prep.first}: the imported prompt KV is not P's"
            )
        md.release(pre)

    # -- messages from RLD --------------------------------------------------------------------

    async def on_handoff(self, msg: Any, t: float) -> None:
        """A HANDOFF through MD's machine (which refuses gaps and contradicting ids); at the
        final one MD must hold exactly RLD's tokens up to the cut."""
        actions = self.fsm.handoff(msg.start_index, msg.token_ids, msg.final, msg.mode)
        self.edits += [a for a in actions if isinstance(a, (AppendTokens, SetChunk, ReleaseHold))]
        if not msg.final:
            return
        self.t_handoff = t
        if self.fsm.known != self.prep.relay[: self.n + 1]:
            raise ValueError(
                f"{self.rid}: HANDOFF from index {msg.start_index} with "
                f"{len(msg.token_ids)} ids is not RLD's cut at {self.n}"
            )
        if self.path == TOKEN_ID:
            out, tokens, forward_s = await self._call(self._extend, tuple(self.edits))
            self._finish(out, tokens, t, forward_s)
            return
        self.reservation = await self._call(self._reserve)
        self.reserved.set()
        await self._maybe_decode()

    def _extend(self, edits: tuple[SequenceEdit, ...]) -> tuple[Any, list[int], float]:
        from pddnet.roles.decode_slot import edit_sequence

        md = self.engine
        t0 = time.perf_counter()
        if edit_sequence(md, self.rid, edits):
            raise AssertionError("the handed-over tokens ended the request")
        (out,) = paced_step(md, self.pacer)  # ONE extend: P's first token + the n relay tokens
        return self._then_one_more(out, t0)

    def _reserve(self) -> Any:
        """Blocks for every token MD knows but the last (sampled, never computed): the prompt
        from MD's prefix cache, the relay tokens' positions left for their KV."""
        prep, n = self.prep, self.n
        res = self.engine.reserve_kv(prep.prompt + self.fsm.known[:-1], self.max_tokens)
        if res.missing_range != (len(prep.prompt), len(prep.prompt) + n):
            self.engine.free_reservation(res)
            raise AssertionError(
                f"MD's reservation misses positions {res.missing_range}, "
                f"expected exactly the relay tokens' "
                f"[{len(prep.prompt)}, {len(prep.prompt) + n})"
            )
        return res

    async def on_chunk(self, msg: Any, t: float) -> None:
        from pddnet.kv.transfer import ExportedKV, KVExportMeta, import_kv

        if self.path != KV_DIRECT:
            raise ValueError(f"{self.rid}: KV_CHUNK on a token-id handoff")
        lo, hi = len(self.prep.prompt), len(self.prep.prompt) + self.n
        if msg.chunk_index in self.chunks or not lo <= msg.token_start < msg.token_end <= hi:
            raise ValueError(
                f"{self.rid}: KV_CHUNK {msg.chunk_index} [{msg.token_start}, "
                f"{msg.token_end}) is a duplicate or outside [{lo}, {hi})"
            )
        self.chunks.add(msg.chunk_index)
        meta = KVExportMeta(
            dtype=msg.dtype,
            shape=msg.shape,
            token_start=msg.token_start,
            token_end=msg.token_end,
            block_size=BLOCK_SIZE,
            layer_start=msg.layer_start,
        )
        exported = ExportedKV.from_payload(meta, msg.payload)
        await self.reserved.wait()  # the ids (control lane) may land after the first chunk
        t0 = time.perf_counter()
        await self._call(import_kv, self.engine.pool, exported, self.reservation.block_ids)
        self.import_s += time.perf_counter() - t0
        self.kv_tokens += meta.num_tokens
        self.kv_bytes += msg.payload.nbytes
        self.t_last_chunk = t
        await self._maybe_decode()

    async def _maybe_decode(self) -> None:
        if self._finishing or self.reservation is None or self.kv_tokens < self.n:
            return
        self._finishing = True
        out, tokens, forward_s = await self._call(self._decode)
        assert self.t_handoff is not None and self.t_last_chunk is not None
        self._finish(out, tokens, max(self.t_handoff, self.t_last_chunk), forward_s)

    def _decode(self) -> tuple[Any, list[int], float]:
        """The deferred StartSequence: every token MD's machine knows, on the reservation the
        relay tokens' KV was imported into, not held; one ordinary decode of the last one."""
        md = self.engine
        t0 = time.perf_counter()
        self._start_sequence(self.fsm.known, self.reservation)
        self.reservation = None
        (out,) = paced_step(md, self.pacer)
        return self._then_one_more(out, t0)

    def _then_one_more(self, out: Any, t0: float) -> tuple[Any, list[int], float]:
        """Stamp the moment MD sampled its first token, then (untimed) one more for the check."""
        t_sampled = time.perf_counter()
        self.t_sampled = t_sampled
        self.forward_chunks = self.engine.last_step.chunks
        self.forward_compute_s = self.engine.last_step.duration_s
        tokens = list(out.new_token_ids)
        while self.engine.has_request(self.rid):
            tokens += [t for o in self.engine.step() for t in o.new_token_ids]
        return out, tokens, t_sampled - t0

    def _finish(self, out: Any, tokens: list[int], t_arrived: float, forward_s: float) -> None:
        """MD's first step after the cut through its machine: it must emit from the cut on."""
        actions = self.fsm.md_step(out.num_computed_tokens, out.output_index, out.new_token_ids)
        firsts = [a.index for a in actions if isinstance(a, FirstMainToken)]
        if firsts != [self.n + 1]:
            raise AssertionError(f"{self.rid}: MD's first token is at {firsts}, not {self.n + 1}")
        if not self.done.done():
            self.done.set_result(
                {
                    "tokens": tokens,
                    "t_arrived": t_arrived,
                    "t_sampled": self.t_sampled,
                    "forward_s": forward_s,
                    "forward_tokens": out.num_computed_this_step,
                }
            )

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    async def close(self) -> None:
        if self._started:
            self._started = False
            pending = [self.reservation] if self.reservation is not None else []
            self.reservation = None
            await self._call(reset_engine, self.engine, [self.rid, f"{self.rid}.p"], pending)


def reset_engine(engine: Any, request_ids: Sequence[str], reservations: Sequence[Any]) -> None:
    """MD's engine back to empty after a trial: its requests aborted and reservations freed
    (also a failed trial's), the prefix cache evicted; raises AssertionError when a block is
    still held (a leak would change what the next trial measures)."""
    for rid in request_ids:
        engine.abort(rid)
    for res in reservations:
        engine.free_reservation(res)
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    if engine.allocator.num_free != engine.num_blocks or engine.blocks.claimed:
        raise AssertionError(
            f"MD's engine holds {engine.num_blocks - engine.allocator.num_free} blocks and "
            f"{engine.blocks.claimed} claimed after a trial: it is not back to empty"
        )


class MainSide:
    """MD's server: routes RLD's frames to the running trial, discards the bulk traffic."""

    def __init__(self, secret: bytes) -> None:
        from pddnet.transport import Server

        self.trials: dict[str, MainTrial] = {}
        self.bulk_bytes = 0
        self.unexpected: list[str] = []
        self.server = Server(
            HOST,
            0,
            role="main_decode",
            instance_id="md-bench",
            secret=secret,
            on_connection=self._serve,
        )

    async def _serve(self, conn: Any) -> None:
        from pddnet.protocol import Handoff, KvChunk

        async for msg in conn:
            t = time.perf_counter()
            rid = getattr(msg, "request_id", None) or ""
            if isinstance(msg, KvChunk) and rid.startswith(BULK_PREFIX):
                self.bulk_bytes += msg.payload.nbytes
                continue
            trial = self.trials.get(rid)
            if trial is None or not isinstance(msg, (Handoff, KvChunk)):
                self.unexpected.append(f"{msg.TYPE.name} {rid!r}")
                continue
            try:
                if isinstance(msg, Handoff):
                    await trial.on_handoff(msg, t)
                else:
                    await trial.on_chunk(msg, t)
            except Exception as exc:  # the trial reports it; the connection keeps serving
                trial.fail(exc)


# -- RLD's side: the two ways to cut --------------------------------------------------------------


def relay_machine(prep: Prepared, n: int) -> RelayHandoff:
    """RLD's machine for a cut at ``n``: one-shot, with RLD's tokens 0..n fed as its engine made
    them (their TOKEN_EVENTs have no router to go to here)."""
    fsm = RelayHandoff(len(prep.prompt), HandoffPolicy(HandoffMode.ONE_SHOT))
    for index, token in enumerate(prep.relay[: n + 1]):
        fsm.rld_token(index, token)
    return fsm


class RelaySide:
    """RLD's lanes to MD through the emulated WAN, and its two handoff transports."""

    def __init__(
        self, control: Any, bulk: Any, executor: ThreadPoolExecutor, chunk_tokens: int
    ) -> None:
        self.control, self.bulk = control, bulk
        self.executor, self.chunk_tokens = executor, chunk_tokens

    def tcp_counters(self) -> dict[str, Any]:
        """Each lane's TCP loss-recovery counters (pddnet.transport.tcp_info; None where the
        system gives none)."""
        from pddnet.transport.tcp_info import tcp_counters

        return {
            "control": tcp_counters(self.control.get_extra_info("socket")),
            "bulk": tcp_counters(self.bulk.get_extra_info("socket")),
        }

    def bytes_out(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for conn in (self.control, self.bulk):
            for name, n in conn.stats["bytes_out"].items():
                out[name] = out.get(name, 0) + n
        return out

    async def cut(
        self, path: str, rid: str, fsm: RelayHandoff, takeover: SendTakeover, prep: Prepared
    ) -> float:
        """MD's TAKEOVER reaches RLD's machine: it cuts (the moment returned) and its HANDOFFs
        go out on the control lane; KV-direct then sends the KV MD lacks on the bulk lane."""
        from pddnet.protocol import Handoff

        t_cut = time.perf_counter()
        actions = fsm.takeover(takeover.ready_position, takeover.chunk_tokens, 0.0)
        for a in actions:
            if isinstance(a, SendHandoff):
                await self.control.send(
                    Handoff(
                        request_id=rid,
                        start_index=a.start_index,
                        token_ids=a.token_ids,
                        final=a.final,
                        mode=a.mode,
                    )
                )
        if path == KV_DIRECT:
            # MD lacks the KV of every token RLD handed over but the last (never computed)
            await self._send_kv(rid, prep, fsm.num_tokens - 1)
        return t_cut

    async def _send_kv(self, rid: str, prep: Prepared, n: int) -> None:
        """The KV of positions [prompt, prompt + n) from RLD's blocks, exported chunk by chunk
        in RLD's thread (as P sends KV to MD)."""
        from pddnet.kv.transfer import export_kv

        engine = prep.rld_engine
        table = engine.get_sequence(prep.rld_request).block_table
        loop = asyncio.get_running_loop()
        start = len(prep.prompt)
        for index, s in enumerate(range(start, start + n, self.chunk_tokens)):
            e = min(start + n, s + self.chunk_tokens)
            exported = await loop.run_in_executor(
                self.executor, export_kv, engine.pool, table, s, e
            )
            await self.bulk.send(kv_chunk(rid, index, s, e, exported.kv))


def kv_chunk(rid: str, index: int, start: int, end: int, kv: Any) -> Any:
    """The KV_CHUNK of positions [start, end), every layer, from RLD's exported tensor: what
    the KV-direct path sends MD."""
    from pddnet.protocol import KvChunk, payload_from_tensor

    payload, dtype, shape = payload_from_tensor(kv)
    return KvChunk(
        request_id=rid,
        chunk_index=index,
        token_start=start,
        token_end=end,
        layer_start=0,
        layer_end=shape[0],
        dtype=dtype,
        shape=shape,
        payload=payload,
    )
