"""handoff: KV-direct handoff vs token-id handoff + Extend-Decode, for 10..200 relay tokens, on a
quiet emulated WAN and under jitter with competing bulk traffic.

When MD's copy of a request's prompt KV is complete, RLD has made `n` tokens (the relay tokens)
that MD lacks. Two ways to hand them over, run side by side in one run on the same engines,
wire format and emulated link:

- token-id (pddnet's handoff, DESIGN point 3): RLD sends one HANDOFF frame with the n token ids
  on its control lane; MD appends them to its held sequence and releases it (the engine calls
  MD's daemon makes, `edit_sequence`), and ONE extend forward digests P's first token and the n
  relay tokens and samples MD's first token.
- KV-direct (the baseline, added here as a handoff transport for this purpose): RLD exports the
  KV of those tokens from its blocks (`export_kv`, positions [prompt, prompt + n)) and sends it
  as KV_CHUNK frames (`payload_from_tensor`) on a bulk lane, plus the same HANDOFF for the ids;
  MD reserves blocks (`Engine.reserve_kv`, which finds the prompt in MD's prefix cache, so only
  those n positions are missing), imports every chunk as it lands (`import_kv`) and runs one
  ordinary decode step to sample its first token (RLD never computed its last token's KV).

Handoff latency = from the moment RLD decides the cut to the moment MD has sampled its first
token: "MD can sample the next token", made concrete by including in both paths the one forward
that yields those logits (the extend for token-id, a one-token decode for KV-direct). It is
split into wire time (cut -> the last byte MD needs has been decoded) and MD time (the rest:
extend, or the last imports + decode). Both ends live in this process, so one clock times them.
Each is summarised under vLLM's stat-key names (mean_/median_/std_/p90_/p99_/max_ +
handoff_latency, wire, md, forward, import + _ms; pddnet.bench.metrics.stats_ms).

This runs at benchmark level, not inside the daemons (their own handoff is token-id only), but
on the same parts they use: a real `Engine` per side (torch threads as --threads), the
`pddnet.protocol` codec, authenticated `pddnet.transport` connections (`dial` / `Server`) and
the proxy-shell WAN emulator (`pdd wan proxy`, its own process) between RLD and MD, changed at
run time through its control API (`emulation.control`). Competing traffic is a bounded bulk
sender: other requests' KV (KV_CHUNK frames of ~--bulk-mib) arriving as a Poisson process with
an offered load of --bulk-load of the link's rate, on its own bulk lane through the same link.

Setup (not timed): per prompt, a colocated reference `Engine.generate` (the oracle), a P engine
(prefill only) whose prompt KV is imported into RLD and MD, and one RLD decode run of the longest
relay count; a cut at n sends RLD's first n tokens and their KV (causal: exactly what RLD had
after n tokens). Each handoff gets a fresh MD engine holding the prompt KV. Every handoff checks
that MD's next two tokens are the reference's (token-exact) and the result records it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import re
import secrets
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pddnet.bench.metrics import stats_ms
from pddnet.bench.plots import cdf_plot, panels_plot
from pddnet.bench.progress import progress
from pddnet.bench.results import write_result

TOKEN_ID = "token-id"
KV_DIRECT = "kv-direct"
PATHS = (TOKEN_ID, KV_DIRECT)
# Link conditions: which of the two disturbances each one turns on.
CONDITIONS: dict[str, dict[str, bool]] = {
    "quiet": {"jitter": False, "bulk": False},
    "jitter": {"jitter": True, "bulk": False},
    "bulk": {"jitter": False, "bulk": True},
    "jitter+bulk": {"jitter": True, "bulk": True},
}
BLOCK_SIZE = 16
BULK_PREFIX = "bulk-"
HOST = "127.0.0.1"
TRIAL_TIMEOUT_S = 60.0
HEADLINE_TOKENS = 100  # the source's comparison point (4649 KB vs 1.5 KB for 100 tokens)


# -- options --------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny model, two relay counts, 3 handoffs each (smoke test)",
    )
    p.add_argument("--model", default="small", help="model preset (small: 16 KiB KV per token)")
    p.add_argument(
        "--relay-tokens",
        type=int,
        nargs="+",
        default=[10, 25, 50, 100, 200],
        help="relay token counts to hand over",
    )
    p.add_argument("--repeats", type=int, default=16, help="handoffs per count, path, condition")
    p.add_argument(
        "--conditions", nargs="+", default=["quiet", "jitter+bulk"], choices=list(CONDITIONS)
    )
    p.add_argument(
        "--prompt-len", type=int, default=256, help=f"prompt tokens (a multiple of {BLOCK_SIZE})"
    )
    p.add_argument("--prompts", type=int, default=2, help="distinct prompts, used in turn")
    p.add_argument("--temperature", type=float, default=0.7, help="0 = greedy; seeded otherwise")
    p.add_argument(
        "--chunk-tokens",
        type=int,
        default=64,
        help="KV-direct: tokens per KV_CHUNK frame (as wan.chunk_tokens)",
    )
    p.add_argument("--rtt-ms", type=float, default=30.0)
    p.add_argument("--bw-mbit", type=float, default=100.0, help="bottleneck rate per direction")
    p.add_argument(
        "--queue-ms", type=float, default=10.0, help="bottleneck buffer, in ms of the link rate"
    )
    p.add_argument(
        "--jitter-ms", type=float, default=5.0, help="jitter (normal, std) in the jitter conditions"
    )
    p.add_argument(
        "--bulk-load",
        type=float,
        default=0.5,
        help="competing traffic's offered load, as a share of the link rate",
    )
    p.add_argument("--bulk-mib", type=float, default=2.0, help="mean size of a bulk transfer")
    p.add_argument(
        "--pause-ms",
        type=float,
        default=150.0,
        help="random pause (0..this) before each cut, to sample the bulk traffic",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="results", help="folder for results/handoff/...")


def apply_quick(args: argparse.Namespace) -> None:
    if args.quick:
        args.model, args.relay_tokens, args.repeats, args.prompts = "tiny", [10, 40], 3, 1
        args.prompt_len, args.chunk_tokens, args.bw_mbit, args.rtt_ms = 64, 16, 20.0, 10.0
        args.bulk_mib, args.pause_ms = 0.25, 40.0


def check_args(args: argparse.Namespace) -> None:
    if not args.relay_tokens or min(args.relay_tokens) < 1:
        raise ValueError("--relay-tokens must list counts >= 1")
    if args.prompt_len < BLOCK_SIZE or args.prompt_len % BLOCK_SIZE:
        raise ValueError(
            f"--prompt-len must be a positive multiple of {BLOCK_SIZE} (MD's "
            f"prefix cache then holds the whole prompt), got {args.prompt_len}"
        )
    for name in ("repeats", "prompts", "chunk_tokens", "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("rtt_ms", "queue_ms", "jitter_ms", "pause_ms", "temperature"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
    if args.bw_mbit <= 0 or args.bulk_mib <= 0:
        raise ValueError("--bw-mbit and --bulk-mib must be > 0")
    if not 0 < args.bulk_load < 1:
        raise ValueError(f"--bulk-load must be in (0, 1), got {args.bulk_load}")
    if len(set(args.conditions)) != len(args.conditions):
        raise ValueError("--conditions lists a condition twice")


# -- setup per prompt (RLD's thread; not timed) ---------------------------------------------------


@dataclass
class Prepared:
    """One prompt's state: what P computed, what RLD decoded, and the reference's tokens."""

    index: int
    prompt: list[int]
    sampling: Any  # SamplingParams
    prompt_kv: Any  # ExportedKV of positions [0, prompt): P's copy, as MD gets it
    relay: list[int]  # output indices 0..n_max: P's first token, then RLD's tokens
    reference: list[int]  # the colocated engine's output, indices 0..n_max + 2
    rld_engine: Any
    rld_request: str

    @property
    def first(self) -> int:
        return self.relay[0]


def _engine(model: Any, tok: Any, tokens: int) -> Any:
    from pddnet.engine.engine import Engine

    return Engine(model, tok, num_blocks=-(-tokens // BLOCK_SIZE) + 4, block_size=BLOCK_SIZE)


def prepare_prompt(
    model: Any, tok: Any, index: int, prompt: list[int], n_max: int, sampling: Any
) -> Prepared:
    from pddnet.kv.transfer import export_kv, import_kv

    length = len(prompt)
    total = n_max + 3  # MD samples indices n+1 and n+2 after a cut at n
    ref_engine = _engine(model, tok, length + total)
    try:
        reference = ref_engine.generate(prompt, total, sampling, ignore_eos=True)
    finally:
        ref_engine.close()
    p = _engine(model, tok, length + 1)
    try:
        pid = p.add_request(prompt, 1, sampling, keep_blocks=True, ignore_eos=True)
        first = [t for out in p.step() for t in out.new_token_ids]
        prompt_kv = export_kv(p.pool, p.get_sequence(pid).block_table, 0, length)
        p.release(pid)
    finally:
        p.close()
    rld = _engine(model, tok, length + total)
    res = rld.reserve_kv(prompt, total)
    import_kv(rld.pool, prompt_kv, res.block_ids)
    rid = rld.add_request(
        prompt, total, sampling, f"relay-{index}", ignore_eos=True, output_token_ids=first, kv=res
    )
    relay = list(first)
    while len(relay) < n_max + 1:
        relay += [t for out in rld.step() for t in out.new_token_ids]
    if relay != reference[: n_max + 1]:
        rld.close()
        at = next(i for i, (a, b) in enumerate(zip(relay, reference, strict=False)) if a != b)
        raise RuntimeError(
            f"prompt {index}: RLD's tokens differ from the reference engine's "
            f"from output index {at} on"
        )
    return Prepared(index, prompt, sampling, prompt_kv, relay, reference, rld, rid)


def make_prompts(count: int, length: int, vocab: int, bos: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [bos] + [rng.randrange(min(256, vocab)) for _ in range(length - 1)] for _ in range(count)
    ]


# -- MD's side: one handoff on a fresh engine -----------------------------------------------------


class MainTrial:
    """MD's half of one handoff: the engine state before the cut (`setup`), then the messages
    from RLD (`on_handoff`, `on_chunk`), ending in `done` with MD's first two tokens."""

    def __init__(
        self,
        path: str,
        request_id: str,
        n: int,
        prep: Prepared,
        model: Any,
        tok: Any,
        executor: ThreadPoolExecutor,
    ) -> None:
        self.path, self.rid, self.n, self.prep = path, request_id, n, prep
        self.model, self.tok, self.executor = model, tok, executor
        self.max_tokens = n + 3
        self.engine: Any = None
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
        self._finishing = False

    async def _call(self, fn: Callable[..., Any], *a: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *a)

    # -- before the cut ---------------------------------------------------------------------

    async def setup(self) -> None:
        await self._call(self._setup_token_id if self.path == TOKEN_ID else self._setup_kv_direct)

    def _setup_token_id(self) -> None:
        """MD's state when its copy of the prompt is complete: the sequence started on the
        imported KV with P's first token known, held until RLD's cut (as MD's daemon does)."""
        from pddnet.kv.transfer import import_kv

        prep = self.prep
        md = self.engine = _engine(self.model, self.tok, len(prep.prompt) + 2 * self.n + 8)
        res = md.reserve_kv(prep.prompt, self.max_tokens)
        import_kv(md.pool, prep.prompt_kv, res.block_ids)
        md.add_request(
            prep.prompt,
            self.max_tokens,
            prep.sampling,
            self.rid,
            ignore_eos=True,
            output_token_ids=[prep.first],
            kv=res,
            hold=True,
        )
        if md.has_work():
            raise AssertionError("MD's held sequence has work before the cut")

    def _setup_kv_direct(self) -> None:
        """MD holds the prompt's KV in its prefix cache (imported, then indexed by a one-token
        step), so the reservation at the cut reuses it and only the relay tokens' KV crosses."""
        from pddnet.kv.transfer import import_kv

        prep = self.prep
        md = self.engine = _engine(self.model, self.tok, len(prep.prompt) + 2 * self.n + 8)
        res = md.reserve_kv(prep.prompt, 1)
        import_kv(md.pool, prep.prompt_kv, res.block_ids)
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
        self.t_handoff = t
        expected = tuple(self.prep.relay[1 : self.n + 1])
        if msg.start_index != 1 or tuple(msg.token_ids) != expected or not msg.final:
            raise ValueError(
                f"{self.rid}: HANDOFF from index {msg.start_index} with "
                f"{len(msg.token_ids)} ids is not RLD's cut at {self.n}"
            )
        if self.path == TOKEN_ID:
            tokens, forward_s, computed = await self._call(self._extend, msg.token_ids)
            self._finish(tokens, t, forward_s, computed)
            return
        self.reservation = await self._call(self._reserve)
        self.reserved.set()
        await self._maybe_decode()

    def _extend(self, token_ids: tuple[int, ...]) -> tuple[list[int], float, int]:
        from pddnet.protocol.handoff import AppendTokens, ReleaseHold
        from pddnet.roles.main_decode import edit_sequence

        md = self.engine
        t0 = time.perf_counter()
        if edit_sequence(md, self.rid, (AppendTokens(tuple(token_ids)), ReleaseHold())):
            raise AssertionError("the handed-over tokens ended the request")
        (out,) = md.step()  # ONE extend: P's first token + the n relay tokens
        return self._then_one_more(out, t0)

    def _reserve(self) -> Any:
        prep, n = self.prep, self.n
        res = self.engine.reserve_kv(prep.prompt + prep.relay[:n], self.max_tokens)
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
        tokens, forward_s, computed = await self._call(self._decode)
        assert self.t_handoff is not None and self.t_last_chunk is not None
        self._finish(tokens, max(self.t_handoff, self.t_last_chunk), forward_s, computed)

    def _decode(self) -> tuple[list[int], float, int]:
        prep, md = self.prep, self.engine
        t0 = time.perf_counter()
        md.add_request(
            prep.prompt,
            self.max_tokens,
            prep.sampling,
            self.rid,
            ignore_eos=True,
            output_token_ids=prep.relay[: self.n + 1],
            kv=self.reservation,
        )
        self.reservation = None
        (out,) = md.step()  # an ordinary decode of the last relay token
        return self._then_one_more(out, t0)

    def _then_one_more(self, out: Any, t0: float) -> tuple[list[int], float, int]:
        """Stamp the moment MD sampled its first token, then (untimed) one more for the check."""
        t_sampled = time.perf_counter()
        self.t_sampled = t_sampled
        tokens = list(out.new_token_ids)
        while self.engine.has_request(self.rid):
            tokens += [t for o in self.engine.step() for t in o.new_token_ids]
        return tokens, t_sampled - t0, out.num_computed_this_step

    def _finish(self, tokens: list[int], t_arrived: float, forward_s: float, computed: int) -> None:
        if not self.done.done():
            self.done.set_result(
                {
                    "tokens": tokens,
                    "t_arrived": t_arrived,
                    "t_sampled": self.t_sampled,
                    "forward_s": forward_s,
                    "forward_tokens": computed,
                }
            )

    def fail(self, exc: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(exc)

    async def close(self) -> None:
        if self.engine is not None:
            await self._call(self.engine.close)
            self.engine = None


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


class RelaySide:
    """RLD's lanes to MD through the emulated WAN, and its two handoff transports."""

    def __init__(
        self, control: Any, bulk: Any, executor: ThreadPoolExecutor, chunk_tokens: int
    ) -> None:
        self.control, self.bulk = control, bulk
        self.executor, self.chunk_tokens = executor, chunk_tokens

    def bytes_out(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for conn in (self.control, self.bulk):
            for name, n in conn.stats["bytes_out"].items():
                out[name] = out.get(name, 0) + n
        return out

    def _handoff(self, rid: str, prep: Prepared, n: int) -> Any:
        from pddnet.protocol import Handoff

        return Handoff(
            request_id=rid,
            start_index=1,
            token_ids=tuple(prep.relay[1 : n + 1]),
            final=True,
            mode="one-shot",
        )

    async def cut_token_id(self, rid: str, prep: Prepared, n: int) -> float:
        t_cut = time.perf_counter()
        await self.control.send(self._handoff(rid, prep, n))
        return t_cut

    async def cut_kv_direct(self, rid: str, prep: Prepared, n: int) -> float:
        """The ids first (tiny, control lane), then the KV of positions [prompt, prompt + n)
        from RLD's blocks, exported chunk by chunk in RLD's thread (as P sends KV to MD)."""
        from pddnet.kv.transfer import export_kv
        from pddnet.protocol import KvChunk, payload_from_tensor

        t_cut = time.perf_counter()
        await self.control.send(self._handoff(rid, prep, n))
        engine = prep.rld_engine
        table = engine.get_sequence(prep.rld_request).block_table
        loop = asyncio.get_running_loop()
        start = len(prep.prompt)
        for index, s in enumerate(range(start, start + n, self.chunk_tokens)):
            e = min(start + n, s + self.chunk_tokens)
            exported = await loop.run_in_executor(
                self.executor, export_kv, engine.pool, table, s, e
            )
            payload, dtype, shape = payload_from_tensor(exported.kv)
            await self.bulk.send(
                KvChunk(
                    request_id=rid,
                    chunk_index=index,
                    token_start=s,
                    token_end=e,
                    layer_start=0,
                    layer_end=shape[0],
                    dtype=dtype,
                    shape=shape,
                    payload=payload,
                )
            )
        return t_cut


# -- competing traffic ----------------------------------------------------------------------------


@dataclass
class BulkStats:
    transfers: int = 0
    bytes: int = 0
    seconds: float = 0.0


class BulkSender:
    """Other requests' KV crossing to MD on its own bulk lane: transfers of 1..2m-1 chunks
    (mean `mean_bytes`) arriving as a Poisson process whose offered load is `load` of the link
    rate. Bounded: it stops when `stop` is set or after `max_seconds`."""

    def __init__(
        self,
        conn: Any,
        spec: Any,
        mean_bytes: float,
        load: float,
        rate_mbit: float,
        seed: int,
        max_seconds: float,
    ) -> None:
        import torch

        from pddnet.protocol import payload_from_tensor

        self.conn = conn
        self.rng = random.Random(seed)
        self.max_seconds = max_seconds
        tokens = 64
        g = torch.Generator().manual_seed(seed)
        kv = torch.randn(
            (spec.num_layers, 2, tokens, spec.num_kv_heads, spec.head_dim), generator=g
        ).to(spec.torch_dtype)
        self.payload, self.dtype, self.shape = payload_from_tensor(kv)
        self.tokens = tokens
        self.mean_chunks = max(1, round(mean_bytes / self.payload.nbytes))
        mean_transfer = self.mean_chunks * self.payload.nbytes
        self.mean_gap_s = mean_transfer * 8 / (load * rate_mbit * 1e6)
        self.stats = BulkStats()

    async def run(self, stop: asyncio.Event) -> BulkStats:
        from pddnet.protocol import KvChunk

        t0 = time.perf_counter()
        next_at = t0 + self.rng.expovariate(1 / self.mean_gap_s)
        while not stop.is_set() and time.perf_counter() - t0 < self.max_seconds:
            wait = next_at - time.perf_counter()
            if wait > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), wait)
                continue
            rid = f"{BULK_PREFIX}{self.stats.transfers}"
            for j in range(self.rng.randint(1, 2 * self.mean_chunks - 1)):
                await self.conn.send(
                    KvChunk(
                        request_id=rid,
                        chunk_index=j,
                        token_start=j * self.tokens,
                        token_end=(j + 1) * self.tokens,
                        layer_start=0,
                        layer_end=self.shape[0],
                        dtype=self.dtype,
                        shape=self.shape,
                        payload=self.payload,
                    )
                )
                self.stats.bytes += self.payload.nbytes
            self.stats.transfers += 1
            next_at += self.rng.expovariate(1 / self.mean_gap_s)
        self.stats.seconds = time.perf_counter() - t0
        return self.stats


# -- the emulated WAN: `pdd wan proxy` in its own process -----------------------------------------

_PROXY_LINE = re.compile(r"wan proxy: (\S+):(\d+) -> .*; control (http://\S+)")


class WanLink:
    """The proxy-shell emulator between RLD (dc-a) and MD (dc-b), and its control API."""

    def __init__(self, upstream_port: int, args: argparse.Namespace) -> None:
        self.upstream_port = upstream_port
        self.args = args
        self.proc: Any = None
        self.port: int | None = None
        self.control_url: str | None = None
        self._log: Any = None

    @property
    def initial_effects(self) -> dict[str, Any]:
        a = self.args
        queue = max(1500, int(a.bw_mbit * 1e6 / 8 * a.queue_ms / 1e3))
        return {"delay_ms": a.rtt_ms / 2, "rate_mbit": a.bw_mbit, "queue_bytes": queue}

    async def start(self) -> None:
        from pddnet.cluster.wan_setup import child_env, popen

        fx = self.initial_effects
        argv = [
            sys.executable,
            "-m",
            "pddnet",
            "wan",
            "proxy",
            "--listen",
            f"{HOST}:0",
            "--upstream",
            f"{HOST}:{self.upstream_port}",
            "--control",
            f"{HOST}:0",
            "--rtt-ms",
            repr(self.args.rtt_ms),
            "--bw-mbit",
            repr(fx["rate_mbit"]),
            "--queue-bytes",
            str(fx["queue_bytes"]),
            "--seed",
            str(self.args.seed),
        ]
        self._log = tempfile.TemporaryFile()  # not a pipe: a full pipe would stall the proxy
        self.proc = popen(argv, stdout=self._log, stderr=self._log, env=child_env(1))
        deadline = time.monotonic() + 30.0
        while True:
            self._log.seek(0)
            text = self._log.read().decode(errors="replace")
            m = _PROXY_LINE.search(text)
            if m:
                self.port, self.control_url = int(m.group(2)), m.group(3)
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the WAN proxy did not start (exit {self.proc.poll()}): "
                    f"{text.strip()[-400:]!r}"
                )
            await asyncio.sleep(0.05)

    def client(self) -> Any:
        from emulation.control import ControlClient

        assert self.control_url is not None
        return ControlClient(self.control_url)

    async def set_condition(self, name: str) -> dict[str, Any]:
        """Back to the initial link, then the condition's jitter; returns a_to_b's effects."""
        client = self.client()
        await client.clear()
        if CONDITIONS[name]["jitter"] and self.args.jitter_ms > 0:
            await client.set("both", jitter_ms=self.args.jitter_ms, jitter_dist="normal")
        return (await client.show("a_to_b"))["a_to_b"]["effects"]

    async def counters(self) -> dict[str, Any]:
        return (await self.client().show("a_to_b"))["a_to_b"]["counters"]

    async def close(self) -> None:
        from pddnet.cluster.wan_setup import stop_processes

        if self.proc is not None:
            await asyncio.to_thread(stop_processes, [self.proc])
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None


# -- one run --------------------------------------------------------------------------------------


@dataclass
class Rig:
    """Everything a handoff needs, started in order and closed in reverse."""

    model: Any
    tok: Any
    md_executor: ThreadPoolExecutor
    rld_executor: ThreadPoolExecutor
    main: MainSide | None = None
    wan: WanLink | None = None
    relay: RelaySide | None = None
    bulk_conn: Any = None
    conns: list[Any] = field(default_factory=list)

    async def start(self, args: argparse.Namespace) -> None:
        from pddnet.transport import dial

        secret = secrets.token_bytes(32)
        self.main = MainSide(secret)
        md_port = await self.main.server.start()
        self.wan = WanLink(md_port, args)
        await self.wan.start()
        assert self.wan.port is not None

        async def lane(role: str, instance: str, kind: str) -> Any:
            conn = await dial(
                HOST,
                self.wan.port,
                role=role,
                instance_id=instance,  # type: ignore[union-attr]
                lane=kind,
                secret=secret,
                timeout=10.0,
            )
            self.conns.append(conn)
            return conn

        control = await lane("relay", "rld-bench", "control")
        bulk = await lane("relay", "rld-bench", "bulk")
        self.bulk_conn = await lane("prefill", "p-bulk", "bulk")
        self.relay = RelaySide(control, bulk, self.rld_executor, args.chunk_tokens)

    async def close(self) -> None:
        for conn in self.conns:
            await conn.close("benchmark done")
        if self.main is not None:
            for trial in list(self.main.trials.values()):
                await trial.close()
            await self.main.server.close()
        if self.wan is not None:
            await self.wan.close()


async def handoff_once(
    rig: Rig, path: str, rid: str, prep: Prepared, n: int, pause_s: float
) -> dict[str, Any]:
    """One handoff: MD's state (untimed), a random pause, RLD's cut, MD's first tokens."""
    assert rig.main is not None and rig.relay is not None
    trial = MainTrial(path, rid, n, prep, rig.model, rig.tok, rig.md_executor)
    rig.main.trials[rid] = trial
    try:
        await trial.setup()
        await asyncio.sleep(pause_s)
        before = rig.relay.bytes_out()
        cut = rig.relay.cut_token_id if path == TOKEN_ID else rig.relay.cut_kv_direct
        t_cut = await cut(rid, prep, n)
        try:
            got = await asyncio.wait_for(asyncio.shield(trial.done), TRIAL_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise RuntimeError(
                f"handoff {rid}: MD had not sampled {TRIAL_TIMEOUT_S:g} s after "
                f"the cut (messages lost on the link?)"
            ) from None
        after = rig.relay.bytes_out()
    finally:
        rig.main.trials.pop(rid, None)
        await trial.close()
    sent = {
        k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) > before.get(k, 0)
    }
    expected = prep.reference[n + 1 : n + 3]
    return {
        "path": path,
        "request_id": rid,
        "relay_tokens": n,
        "prompt": prep.index,
        "latency_s": got["t_sampled"] - t_cut,
        "wire_s": got["t_arrived"] - t_cut,
        "md_s": got["t_sampled"] - got["t_arrived"],
        "forward_s": got["forward_s"],
        "forward_tokens": got["forward_tokens"],
        "import_s": trial.import_s,
        "payload_bytes": sum(sent.values()),
        "frames_bytes": sent,
        "kv_bytes_received": trial.kv_bytes,
        "tokens": got["tokens"],
        "expected": expected,
        "token_exact": got["tokens"] == expected,
    }


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:  # pragma: no cover - not on Linux
        return None


async def run_condition(
    rig: Rig,
    args: argparse.Namespace,
    ci: int,
    name: str,
    preps: list[Prepared],
    rng: random.Random,
    bar: Any,
    spec: Any,
) -> dict[str, Any]:
    assert rig.wan is not None and rig.main is not None
    load_before = _loadavg()
    effects = await rig.wan.set_condition(name)
    stop = asyncio.Event()
    bulk_task = None
    sink_before = rig.main.bulk_bytes
    if CONDITIONS[name]["bulk"]:
        sender = BulkSender(
            rig.bulk_conn,
            spec,
            args.bulk_mib * (1 << 20),
            args.bulk_load,
            args.bw_mbit,
            args.seed + 1000 + ci,
            max_seconds=3600.0,
        )
        bulk_task = asyncio.create_task(sender.run(stop), name=f"bulk {name}")
        await asyncio.sleep(min(1.0, 4 * sender.mean_gap_s))  # let the traffic get going
    trials = []
    try:
        for rep in range(args.repeats):
            prep = preps[rep % len(preps)]
            for n in rng.sample(list(args.relay_tokens), len(args.relay_tokens)):
                for path in rng.sample(PATHS, len(PATHS)):
                    if bulk_task is not None and bulk_task.done():
                        bulk_task.result()  # the sender died: say why
                    rid = f"c{ci}-n{n}-r{rep}-{path}"
                    t = await handoff_once(
                        rig, path, rid, prep, n, rng.uniform(0, args.pause_ms / 1e3)
                    )
                    t["condition"] = name
                    trials.append(t)
                    bar.update(1)
                    bar.set_postfix(cond=name, n=n, ms=f"{t['latency_s'] * 1e3:.0f}")
    finally:
        stop.set()
        bulk = await bulk_task if bulk_task is not None else None
    if bulk is not None:  # drain what is still crossing before the next condition starts
        deadline = time.monotonic() + 60
        while rig.main.bulk_bytes - sink_before < bulk.bytes and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
    info: dict[str, Any] = {
        "effects": effects,
        "bulk": None,
        "link_a_to_b": await rig.wan.counters(),
        "loadavg_1min": {"before": load_before, "after": _loadavg()},
    }
    if bulk is not None:
        info["bulk"] = {
            "transfers": bulk.transfers,
            "bytes": bulk.bytes,
            "seconds": bulk.seconds,
            "received_bytes": rig.main.bulk_bytes - sink_before,
            "offered_load": args.bulk_load,
            "measured_load": bulk.bytes * 8 / max(bulk.seconds, 1e-9) / (args.bw_mbit * 1e6),
        }
    return {"trials": trials, "info": info}


# -- summarising (pure) ---------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def path_summary(trials: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One path's handoffs at one relay count and condition: the stats of the handoff latency
    and its parts under vLLM's stat-key names (mean_/median_/std_/p90_/p99_/max_<x>_ms;
    pddnet.bench.metrics), max / mean, the bytes and the forward sizes."""

    def st(name: str, key: str) -> dict[str, float | None]:
        return stats_ms(name, [t[key] for t in trials], with_max=True)

    lat, wire = st("handoff_latency", "latency_s"), st("wire", "wire_s")
    return {
        "n": len(trials),
        **lat,
        "max_over_mean": _ratio(lat["max_handoff_latency_ms"], lat["mean_handoff_latency_ms"]),
        **wire,
        "wire_max_over_mean": _ratio(wire["max_wire_ms"], wire["mean_wire_ms"]),
        **st("md", "md_s"),
        **st("forward", "forward_s"),
        **st("import", "import_s"),
        "payload_bytes": max((t["payload_bytes"] for t in trials), default=None),
        "payload_bytes_min": min((t["payload_bytes"] for t in trials), default=None),
        "kv_bytes_received": max((t["kv_bytes_received"] for t in trials), default=None),
        "forward_tokens": sorted({t["forward_tokens"] for t in trials}),
        "token_exact": all(t["token_exact"] for t in trials),
    }


# the latency stats whose KV-direct / token-id ratio a row and the headline report
RATIO_KEYS = (
    "mean_handoff_latency_ms",
    "median_handoff_latency_ms",
    "p99_handoff_latency_ms",
    "max_handoff_latency_ms",
    "mean_wire_ms",
    "max_wire_ms",
)


def summarise(
    trials: Sequence[dict[str, Any]], conditions: Sequence[str], counts: Sequence[int]
) -> dict[str, list[dict[str, Any]]]:
    """Per condition, one row per relay count: each path's figures and KV-direct / token-id."""
    out: dict[str, list[dict[str, Any]]] = {}
    for cond in conditions:
        rows = []
        for n in sorted(set(counts)):
            per = {
                p: path_summary(
                    [
                        t
                        for t in trials
                        if t["condition"] == cond and t["relay_tokens"] == n and t["path"] == p
                    ]
                )
                for p in PATHS
            }
            tok, kv = per[TOKEN_ID], per[KV_DIRECT]
            ratios = {
                "payload": _ratio(kv["payload_bytes"], tok["payload_bytes"]),
                "max_over_mean": _ratio(kv["max_over_mean"], tok["max_over_mean"]),
            }
            for key in RATIO_KEYS:
                ratios[key] = _ratio(kv[key], tok[key])
            rows.append(
                {"relay_tokens": n, TOKEN_ID: tok, KV_DIRECT: kv, "kv_direct_over_token_id": ratios}
            )
        out[cond] = rows
    return out


HEADLINE_KEYS = (
    "mean_handoff_latency_ms",
    "p99_handoff_latency_ms",
    "max_handoff_latency_ms",
    "max_over_mean",
    "mean_wire_ms",
    "max_wire_ms",
    "wire_max_over_mean",
)


def headline(
    rows: dict[str, list[dict[str, Any]]], target: int = HEADLINE_TOKENS
) -> dict[str, Any]:
    """The source's comparison point: the relay count nearest `target` tokens."""
    any_rows = next(iter(rows.values()))
    n = min((r["relay_tokens"] for r in any_rows), key=lambda c: (abs(c - target), c))
    out: dict[str, Any] = {"relay_tokens": n, "conditions": {}}
    for cond, cond_rows in rows.items():
        row = next(r for r in cond_rows if r["relay_tokens"] == n)
        out["payload_bytes"] = {p: row[p]["payload_bytes"] for p in PATHS}
        out["payload_ratio"] = row["kv_direct_over_token_id"]["payload"]
        out["conditions"][cond] = {
            **{p: {k: row[p][k] for k in HEADLINE_KEYS} for p in PATHS},
            "kv_direct_over_token_id": row["kv_direct_over_token_id"],
        }
    base = out["conditions"].get("quiet")
    for cond, c in out["conditions"].items():  # what the disturbance added, path by path
        if base is not None and cond != "quiet":
            c["over_quiet"] = {
                p: {
                    k: _ratio(c[p][k], base[p][k])
                    for k in (
                        "mean_handoff_latency_ms",
                        "max_handoff_latency_ms",
                        "mean_wire_ms",
                        "max_wire_ms",
                    )
                }
                for p in PATHS
            }
    return out


# -- output ---------------------------------------------------------------------------------------


def print_table(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, Any]]],
    head: dict[str, Any],
    kv_per_token: int,
    infos: dict[str, Any],
) -> None:
    def ms(v: float | None) -> str:
        return f"{'-':>6}" if v is None else f"{v:6.1f}"

    def x(v: float | None) -> str:
        return f"{'-':>5}" if v is None else f"{v:5.2f}"

    print(
        f"\nhandoff benchmark: model {args.model} ({kv_per_token} B of KV per token), prompt "
        f"{args.prompt_len} tokens, WAN {args.rtt_ms:g} ms RTT, {args.bw_mbit:g} Mbit/s, "
        f"buffer {args.queue_ms:g} ms; {args.repeats} handoffs per point and path"
    )
    for cond, cond_rows in rows.items():
        info = infos[cond]
        extra = []
        if CONDITIONS[cond]["jitter"]:
            extra.append(f"jitter {args.jitter_ms:g} ms")
        if info["bulk"]:
            extra.append(f"bulk traffic at {info['bulk']['measured_load']:.0%} of the link")
        load = info["loadavg_1min"]
        if load["before"] is not None and load["after"] is not None:
            extra.append(f"load average {load['before']:.1f} -> {load['after']:.1f}")
        print(
            f"\n[{cond}] {', '.join(extra)}\n  handoff_latency in ms, from RLD's cut to MD's "
            f"first token sampled (mean, median, p99, max; max/mean)"
        )
        print(
            f"{'relay':>5} | {'payload B tok':>13} {'KV-direct':>10} {'x':>6} | "
            f"{'tok mean':>8} {'median':>6} {'p99':>6} {'max':>6} {'max/mn':>6} | "
            f"{'KV mean':>7} {'median':>6} {'p99':>6} {'max':>6} {'max/mn':>6} | "
            f"{'KV/tok mean':>11} {'max':>5} | exact"
        )
        for r in cond_rows:
            tok, kv, q = r[TOKEN_ID], r[KV_DIRECT], r["kv_direct_over_token_id"]

            def lat(s: dict[str, Any]) -> str:
                return " ".join(ms(s[f"{k}_handoff_latency_ms"]) for k in ("median", "p99", "max"))

            exact = "yes" if tok["token_exact"] and kv["token_exact"] else "NO"
            print(
                f"{r['relay_tokens']:>5} | {tok['payload_bytes']:>13} "
                f"{kv['payload_bytes']:>10} {q['payload'] or 0:6.0f} | "
                f"{ms(tok['mean_handoff_latency_ms']):>8} {lat(tok)} "
                f"{x(tok['max_over_mean']):>6} | {ms(kv['mean_handoff_latency_ms']):>7} "
                f"{lat(kv)} {x(kv['max_over_mean']):>6} | "
                f"{x(q['mean_handoff_latency_ms']):>11} {x(q['max_handoff_latency_ms'])} | "
                f"{exact}"
            )
        print("  of which on the wire (cut -> MD has decoded the last frame it needs), and MD:")
        for r in cond_rows:
            tok, kv = r[TOKEN_ID], r[KV_DIRECT]
            print(
                f"{r['relay_tokens']:>5} | token-id wire mean {ms(tok['mean_wire_ms'])} max "
                f"{ms(tok['max_wire_ms'])} max/mn {x(tok['wire_max_over_mean'])}, MD "
                f"{ms(tok['mean_md_ms'])} | KV-direct wire mean {ms(kv['mean_wire_ms'])} "
                f"max {ms(kv['max_wire_ms'])} max/mn {x(kv['wire_max_over_mean'])}, MD "
                f"{ms(kv['mean_md_ms'])}"
            )
    n = head["relay_tokens"]
    pb = head["payload_bytes"]
    print(
        f"\nat {n} relay tokens: payload token-id {pb[TOKEN_ID]} B vs KV-direct "
        f"{pb[KV_DIRECT]} B ({head['payload_ratio']:.0f}x; source: 1.5 KB vs 4649 KB)"
    )
    for cond, c in head["conditions"].items():
        t, k = c[TOKEN_ID], c[KV_DIRECT]
        q = c["kv_direct_over_token_id"]
        print(
            f"  {cond:>11}: token-id mean {t['mean_handoff_latency_ms']:.1f} ms, max "
            f"{t['max_handoff_latency_ms']:.1f} ms (max/mean {t['max_over_mean']:.2f}); "
            f"KV-direct mean {k['mean_handoff_latency_ms']:.1f} ms, max "
            f"{k['max_handoff_latency_ms']:.1f} ms (max/mean {k['max_over_mean']:.2f}); "
            f"KV-direct / token-id mean {q['mean_handoff_latency_ms']:.2f}x, max "
            f"{q['max_handoff_latency_ms']:.2f}x"
        )
        print(
            f"  {'':>11}  wire only: token-id max/mean {t['wire_max_over_mean']:.2f}, "
            f"KV-direct {k['wire_max_over_mean']:.2f}"
        )
        if "over_quiet" in c:
            g = c["over_quiet"]
            gt, gk = g[TOKEN_ID], g[KV_DIRECT]
            print(
                f"  {'':>11}  vs quiet: token-id mean {gt['mean_handoff_latency_ms']:.2f}x, "
                f"max {gt['max_handoff_latency_ms']:.2f}x, wire mean "
                f"{gt['mean_wire_ms']:.2f}x; KV-direct mean "
                f"{gk['mean_handoff_latency_ms']:.2f}x, max {gk['max_handoff_latency_ms']:.2f}x,"
                f" wire mean {gk['mean_wire_ms']:.2f}x"
            )


def plot(
    args: argparse.Namespace,
    rows: dict[str, list[dict[str, Any]]],
    trials: Sequence[dict[str, Any]],
    head: dict[str, Any],
    path: Path,
) -> list[str]:
    def series(key: Callable[[dict[str, Any]], float | None]) -> dict[str, Any]:
        out = {}
        for cond, cond_rows in rows.items():
            for p in PATHS:
                pts = [(r["relay_tokens"], key(r[p])) for r in cond_rows if key(r[p]) is not None]
                out[f"{p}, {cond}"] = ([a for a, _ in pts], [b for _, b in pts])
        return out

    def ms(q: str) -> Callable[[dict[str, Any]], float | None]:
        return lambda s: s[f"{q}_handoff_latency_ms"]

    written = []
    png = panels_plot(
        [
            ("mean_handoff_latency (ms)", series(ms("mean"))),
            ("max_handoff_latency (ms)", series(ms("max"))),
            ("max / mean", series(lambda s: s["max_over_mean"])),
        ],
        path.with_suffix(".png"),
        "relay tokens handed over",
        f"Token-id vs KV-direct handoff, model {args.model}, {args.rtt_ms:g} ms "
        f"RTT, {args.bw_mbit:g} Mbit/s",
        logx=True,
    )
    if png:
        written.append(str(png))
    n = head["relay_tokens"]
    samples = {
        f"{p}, {cond}": [
            t["latency_s"]
            for t in trials
            if t["relay_tokens"] == n and t["path"] == p and t["condition"] == cond
        ]
        for cond in rows
        for p in PATHS
    }
    cdf = cdf_plot(
        samples,
        path.with_name(path.stem + "-cdf.png"),
        "handoff latency (ms)",
        f"Handoff latency at {n} relay tokens",
    )
    if cdf:
        written.append(str(cdf))
    return written


# -- entry point ----------------------------------------------------------------------------------


async def run(args: argparse.Namespace) -> dict[str, Any]:
    apply_quick(args)
    check_args(args)
    import torch

    from pddnet.engine.sampling import SamplingParams
    from pddnet.model.loader import load_model

    torch.set_num_threads(args.threads)
    t_start = time.monotonic()
    model, tok = load_model(args.model)
    config = model.config
    from pddnet.kv.pool import KVSpec

    spec = KVSpec.from_model_config(config, BLOCK_SIZE)
    n_max = max(args.relay_tokens)
    if args.prompt_len + n_max + 3 > config.max_position:
        raise ValueError(
            f"--prompt-len + the largest relay count exceed the model's "
            f"max_position {config.max_position}"
        )
    loop = asyncio.get_running_loop()
    rld_ex = ThreadPoolExecutor(1, thread_name_prefix="handoff-rld")
    md_ex = ThreadPoolExecutor(1, thread_name_prefix="handoff-md")
    rng = random.Random(args.seed)
    preps: list[Prepared] = []
    trials: list[dict[str, Any]] = []
    infos: dict[str, Any] = {}
    rig = Rig(model, tok, md_ex, rld_ex)
    try:
        prompts = make_prompts(
            args.prompts, args.prompt_len, config.vocab_size, config.bos_token_id, args.seed
        )
        for i, prompt in enumerate(prompts):
            sp = SamplingParams(temperature=args.temperature, seed=args.seed * 1000 + i)
            preps.append(
                await loop.run_in_executor(rld_ex, prepare_prompt, model, tok, i, prompt, n_max, sp)
            )
        await rig.start(args)
        for path in PATHS:  # warm-up (torch, lanes, proxy), not recorded
            await handoff_once(rig, path, f"warm-{path}", preps[0], min(args.relay_tokens), 0.0)
        total = len(args.conditions) * args.repeats * len(args.relay_tokens) * len(PATHS)
        with progress(total, "handoff", unit="handoff", enabled=not args.no_progress) as bar:
            for ci, name in enumerate(args.conditions):
                got = await run_condition(rig, args, ci, name, preps, rng, bar, spec)
                trials += got["trials"]
                infos[name] = got["info"]
        unexpected = list(rig.main.unexpected) if rig.main else []
    finally:
        await rig.close()
        for prep in preps:
            prep.rld_engine.close()
        rld_ex.shutdown()
        md_ex.shutdown()
    rows = summarise(trials, args.conditions, args.relay_tokens)
    head = headline(rows)
    cfg = {k: v for k, v in vars(args).items() if k not in ("handler", "bench_spec")}
    consistency = {
        "all_token_exact": all(t["token_exact"] for t in trials),
        "token_id_payload_below_kv_direct": all(
            r[TOKEN_ID]["payload_bytes"] < r[KV_DIRECT]["payload_bytes"]
            for cond_rows in rows.values()
            for r in cond_rows
        ),
        "kv_bytes_received_match": all(
            t["kv_bytes_received"]
            == (t["relay_tokens"] * spec.bytes_per_token if t["path"] == KV_DIRECT else 0)
            for t in trials
        ),
        "token_id_extends_in_one_forward": all(
            t["forward_tokens"] == t["relay_tokens"] + 1 for t in trials if t["path"] == TOKEN_ID
        ),
        "kv_direct_forward_is_one_token": all(
            t["forward_tokens"] == 1 for t in trials if t["path"] == KV_DIRECT
        ),
        "unexpected_frames": unexpected[:5],
    }
    path = write_result(
        "handoff",
        {
            "config": cfg,
            "threads_per_daemon": args.threads,
            "kv_bytes_per_token": spec.bytes_per_token,
            "model_dtype": config.dtype,
            "link": {
                "initial": WanLink(0, args).initial_effects,
                "jitter_ms": args.jitter_ms,
                "shell": "proxy",
            },
            "conditions": {c: {"rows": rows[c], **infos[c]} for c in args.conditions},
            "headline": head,
            "consistency": consistency,
            "prompts": [
                {
                    "index": p.index,
                    "prompt_tokens": len(p.prompt),
                    "relay_token_exact": p.relay == p.reference[: len(p.relay)],
                }
                for p in preps
            ],
            "elapsed_s": time.monotonic() - t_start,
            "trials": trials,
        },
        args.out,
    )
    pngs = plot(args, rows, trials, head, path)
    print_table(args, rows, head, spec.bytes_per_token, infos)
    print(f"wrote {path}" + "".join(f"\nwrote {p}" for p in pngs))
    return {
        "path": str(path),
        "rows": rows,
        "headline": head,
        "consistency": consistency,
        "plots": pngs,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    add_arguments(p)
    asyncio.run(run(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
