"""The colocated reference engine, and the core every daemon reuses.

``Engine`` owns a KV pool, a block manager (allocator + prefix cache + claim ledger), a scheduler
and a model runner. ``step()`` runs one forward over whatever the scheduler picked and returns
one ``StepOutput`` per sequence that took part. ``generate``/``stream`` drive ``step()`` for one
request: that is the oracle every token-exactness test compares against.

Hooks for the disaggregated roles (all plain method calls, no hidden state):

- ``reserve_kv`` -> ``KVReservation``: blocks for a prompt whose KV will be written from outside
  (P's one-sided write into RLD, or a WAN import on MD), reusing this engine's prefix cache so
  only the uncached part needs to arrive; then ``add_request(..., kv=reservation,
  output_token_ids=[first_token])`` starts decoding on top of it.
- ``append_tokens``: token-id handoff. Known tokens become uncomputed tokens that the next steps
  compute with an extend forward (capped per step by ``max_chunk_tokens``) instead of sampling.
- ``hold=True`` / ``set_hold``: compute known tokens but do not sample until released
  (streaming handoff, the final cut decided elsewhere).
- ``keep_blocks=True`` with ``max_tokens=1``: prefill-only; the sequence stops after its first
  token and keeps its blocks (``get_sequence(id).block_table``) until ``release(id)``.

The engine is not thread-safe: a daemon calls it from one thread (its compute worker).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import secrets
import time
from collections.abc import Iterator
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any

import torch

from pddnet.engine.runner import Chunk, ModelRunner
from pddnet.engine.sampling import SamplingParams, TokenLogprob, sample_batch, token_logprob
from pddnet.engine.scheduler import BlockManager, Scheduler
from pddnet.engine.sequence import FinishReason, Sequence, SequenceStatus
from pddnet.int_lists import all_ints_within
from pddnet.kv.allocator import BlockAllocator, OutOfBlocks
from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.prefix_cache import PrefixCache, PrefixMatch
from pddnet.model.llama import LlamaModel


@dataclass(frozen=True)
class StepOutput:
    """What one step did for one sequence."""

    request_id: str
    new_token_ids: list[int]  # sampled this step (0 or 1 tokens)
    output_index: int  # index in the output of new_token_ids[0]
    num_computed_tokens: int  # tokens with KV after this step
    num_computed_this_step: int
    finished: bool
    finish_reason: FinishReason | None
    # per new token, when the request asked for logprobs (SamplingParams.logprobs)
    logprobs: tuple[TokenLogprob, ...] | None = None


@dataclass(frozen=True)
class StepStats:
    step: int
    duration_s: float
    num_seqs: int
    num_tokens: int  # tokens forwarded
    num_prefill_tokens: int  # in chunks longer than one token (prefill, chunked prefill, extend)
    num_decode_tokens: int  # in one-token chunks
    num_sampled: int
    # (start, end) positions each sequence computed: the forward's shape, which is what a
    # modelled accelerator's time depends on (pddnet.device.pacer)
    chunks: tuple[tuple[int, int], ...] = ()


@dataclass
class KVReservation:
    """Blocks reserved for KV that arrives from outside; see ``Engine.reserve_kv``."""

    reservation_id: int
    token_ids: tuple[int, ...]  # the tokens whose KV these blocks hold (the prompt)
    block_ids: list[int]
    num_cached_tokens: int  # leading tokens whose KV is already here (prefix-cache hit)
    max_tokens: int
    claim: int  # blocks still reserved for the sequence's later growth
    hashes: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def missing_range(self) -> tuple[int, int]:
        """Token range whose KV must still be written into ``block_ids``."""
        return self.num_cached_tokens, self.num_tokens


class Engine:
    def __init__(
        self,
        model: LlamaModel,
        tokenizer: Any = None,
        num_blocks: int = 512,
        block_size: int = 16,
        max_num_batched_tokens: int = 2048,
        enable_prefix_cache: bool = True,
        kv_shm_name: str | None = None,
        max_num_seqs: int = 256,
        kv_dtype: str | torch.dtype | None = None,
        prefix_cache_kind: str = "hash",
    ) -> None:
        self.model = model
        self.config = model.config
        self.tokenizer = tokenizer
        self.eos_token_id: int = (
            tokenizer.eos_token_id if tokenizer is not None else self.config.eos_token_id
        )
        self.spec = KVSpec.from_model_config(self.config, block_size, kv_dtype)
        self.pool = KVPool(self.spec, num_blocks, shm_name=kv_shm_name)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_cache, prefix_cache_kind)
        self.scheduler = Scheduler(self.blocks, max_num_batched_tokens, max_num_seqs)
        self.runner = ModelRunner(model, self.pool)
        self._seqs: dict[str, Sequence] = {}
        self._reservations: dict[int, KVReservation] = {}
        self._ids = itertools.count()
        self._reservation_ids = itertools.count()
        self.num_steps = 0
        self.num_computed_tokens_total = 0
        self.last_step: StepStats | None = None

    # -- resources ---------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def allocator(self) -> BlockAllocator:
        return self.blocks.allocator

    @property
    def prefix_cache(self) -> PrefixCache | None:
        return self.blocks.prefix_cache

    @property
    def num_available_blocks(self) -> int:
        """Blocks free or evictable (prefix-cache contents no request uses)."""
        return self.blocks.num_available

    def close(self) -> None:
        """Drop every request and release the pool (unlinking its shared segment, if any)."""
        for rid in list(self._seqs):
            self.abort(rid)
        for res in list(self._reservations.values()):
            self.free_reservation(res)
        self.pool.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests -----------------------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Seq[int],
        max_tokens: int = 16,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        ignore_eos: bool = False,
        output_token_ids: Seq[int] = (),
        kv: KVReservation | None = None,
        num_computed_tokens: int | None = None,
        hold: bool = False,
        max_chunk_tokens: int | None = None,
        keep_blocks: bool = False,
    ) -> str:
        """Queue a request; returns its id.

        ``output_token_ids``: output tokens already known (e.g. P's first token); they are
        computed, not sampled. ``kv``: a reservation from ``reserve_kv`` whose blocks now hold
        the KV of its tokens (a prefix of prompt + known output); the sequence starts with
        ``num_computed_tokens`` (default: all of the reservation's tokens) already computed and
        goes straight to running, its block claim having been reserved with the reservation.
        """
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already in use")
        sampling = self._resolve_sampling(sampling)
        prompt = self._check_tokens(prompt_token_ids, "prompt_token_ids")
        known = self._check_tokens(output_token_ids, "output_token_ids", allow_empty=True)
        if not prompt:
            raise ValueError("prompt_token_ids must not be empty")
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        if max_chunk_tokens is not None and max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        if len(known) >= max_tokens:
            raise ValueError(
                f"{len(known)} known output tokens leave nothing to generate with "
                f"max_tokens={max_tokens}"
            )
        if not ignore_eos and self.eos_token_id in known:
            raise ValueError("known output tokens contain EOS: the request is already complete")
        if len(prompt) + max_tokens > self.config.max_position:
            raise ValueError(
                f"prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the "
                f"model's max_position {self.config.max_position}"
            )
        seq = Sequence(
            request_id=request_id,
            token_ids=prompt + known,
            num_prompt_tokens=len(prompt),
            sampling=sampling,
            max_tokens=max_tokens,
            eos_token_id=self.eos_token_id,
            ignore_eos=ignore_eos,
            hold=hold,
            max_chunk_tokens=max_chunk_tokens,
            keep_blocks=keep_blocks,
        )
        need = seq.max_blocks(self.block_size)
        if need > self.num_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks of {self.block_size} tokens; "
                f"the pool has {self.num_blocks}"
            )
        if kv is None:
            if num_computed_tokens not in (None, 0):
                raise ValueError("num_computed_tokens needs kv= (the blocks holding that KV)")
            self.scheduler.add_waiting(seq)
        else:
            self._start_on_reservation(seq, kv, num_computed_tokens)
        self._seqs[request_id] = seq
        return request_id

    def _start_on_reservation(
        self, seq: Sequence, kv: KVReservation, num_computed: int | None
    ) -> None:
        if self._reservations.get(kv.reservation_id) is not kv:
            raise ValueError(f"KV reservation {kv.reservation_id} is unknown or already used")
        if tuple(seq.token_ids[: kv.num_tokens]) != kv.token_ids:
            raise ValueError(
                "the KV reservation's tokens are not a prefix of this request's tokens"
            )
        total = len(kv.block_ids) + kv.claim
        if seq.max_blocks(self.block_size) > total:
            raise ValueError(
                f"request may need {seq.max_blocks(self.block_size)} blocks, its KV "
                f"reservation covers {total} (reserve with max_tokens={seq.max_tokens})"
            )
        n = kv.num_tokens if num_computed is None else num_computed
        if not kv.num_cached_tokens <= n <= kv.num_tokens:
            raise ValueError(
                f"num_computed_tokens {n} outside the reservation's "
                f"[{kv.num_cached_tokens}, {kv.num_tokens}]"
            )
        # The last token must be computed here to yield logits; it lies past the cached blocks
        # (reserve_kv never matches the block holding the last reserved token).
        seq.num_computed_tokens = min(n, seq.num_tokens - 1)
        seq.block_table = list(kv.block_ids)
        seq.block_hashes = list(kv.hashes)
        seq.num_prefix_hit_tokens = kv.num_cached_tokens
        del self._reservations[kv.reservation_id]
        # Hand the reservation's claim to the sequence; give back what it will never need.
        self.blocks.claimed -= kv.claim - seq.remaining_claim(self.block_size)
        self.scheduler.add_running(seq)

    def reserve_kv(
        self, token_ids: Seq[int], max_tokens: int, use_prefix_cache: bool = True
    ) -> KVReservation:
        """Blocks for the KV of ``token_ids`` (to be written from outside), plus the claim for a
        request of ``max_tokens`` output tokens on top. Leading full blocks found in the prefix
        cache are reused (``num_cached_tokens``): only ``missing_range`` needs to be written.
        Raises OutOfBlocks when the pool cannot promise that much."""
        tokens = self._check_tokens(token_ids, "token_ids")
        if not tokens:
            raise ValueError("token_ids must not be empty")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
        bs = self.block_size
        total = self.blocks.blocks_for(len(tokens) + max_tokens - 1)
        if total > self.num_blocks:
            raise ValueError(
                f"{len(tokens)} tokens + max_tokens {max_tokens} need {total} "
                f"blocks; the pool has {self.num_blocks}"
            )
        match = self.blocks.match(tokens, (len(tokens) - 1) // bs) if use_prefix_cache else None
        cost = self.blocks.admission_cost(total, 0, match)
        if cost > self.blocks.num_unclaimed:
            raise OutOfBlocks(cost, max(0, self.blocks.num_unclaimed), self.num_blocks)
        if use_prefix_cache:
            self.blocks.take_match(tokens, match)
        cached = list(match.block_ids) if match else []
        now = self.blocks.blocks_for(len(tokens)) - len(cached)
        blocks = cached + self.blocks.allocate(now)
        claim = total - len(blocks)
        self.blocks.claimed += claim
        res = KVReservation(
            next(self._reservation_ids),
            tuple(tokens),
            blocks,
            match.num_tokens if match else 0,
            max_tokens,
            claim,
            list(match.hashes) if match else [],
        )
        self._reservations[res.reservation_id] = res
        return res

    def free_reservation(self, reservation: KVReservation) -> None:
        """Give back an unused reservation's blocks and claim (e.g. the transfer failed)."""
        res = self._reservations.pop(reservation.reservation_id, None)
        if res is None:
            return
        self.blocks.claimed -= res.claim
        self.blocks.release(res.block_ids)

    def append_tokens(self, request_id: str, token_ids: Seq[int]) -> FinishReason | None:
        """Token-id handoff: append known output tokens; later steps compute their KV with an
        extend forward. Returns the finish reason when these tokens end the request (EOS or
        max_tokens), in which case its blocks are freed at once."""
        seq = self._live(request_id)
        tokens = self._check_tokens(token_ids, "token_ids", allow_empty=True)
        if seq.num_output_tokens + len(tokens) > seq.max_tokens:
            raise ValueError(
                f"appending {len(tokens)} tokens exceeds max_tokens={seq.max_tokens} "
                f"({seq.num_output_tokens} already)"
            )
        if not seq.ignore_eos and self.eos_token_id in tokens[:-1]:
            raise ValueError("appended tokens continue after EOS")
        for t in tokens:
            seq.token_ids.append(t)
            reason = seq.stop_reason_after(t)
            if reason is not None:
                self._finish(seq, reason)
                return reason
        return None

    def set_hold(self, request_id: str, hold: bool) -> None:
        self._live(request_id).hold = hold

    def set_max_chunk_tokens(self, request_id: str, max_chunk_tokens: int | None) -> None:
        if max_chunk_tokens is not None and max_chunk_tokens < 1:
            raise ValueError(f"max_chunk_tokens must be >= 1, got {max_chunk_tokens}")
        self._live(request_id).max_chunk_tokens = max_chunk_tokens

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is (also a finished one with kept blocks); frees its
        blocks. Returns False when the id is unknown."""
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        if seq.is_finished:
            self.release(request_id)
        else:
            seq.keep_blocks = False
            self._finish(seq, FinishReason.ABORT)
        return True

    def release(self, request_id: str) -> None:
        """Free the blocks a finished ``keep_blocks`` request kept for export."""
        seq = self._seqs.get(request_id)
        if seq is None:
            raise KeyError(f"unknown request {request_id!r}")
        if not seq.is_finished:
            raise ValueError(
                f"request {request_id!r} is still {seq.status.value}; abort it instead"
            )
        self.blocks.release(seq.block_table)
        seq.block_table = []
        del self._seqs[request_id]

    def get_sequence(self, request_id: str) -> Sequence:
        try:
            return self._seqs[request_id]
        except KeyError:
            raise KeyError(f"unknown request {request_id!r}") from None

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    @property
    def num_unfinished(self) -> int:
        return sum(1 for s in self._seqs.values() if not s.is_finished)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # -- prefix pinning (keeps the claim ledger honest) ------------------------------------------------

    def pin_prefix(self, token_ids: Seq[int]) -> PrefixMatch | None:
        """Pin the longest cached prefix of ``token_ids`` against eviction; None if nothing is
        cached. Raises OutOfBlocks if pinning would eat blocks promised to admitted requests."""
        cache = self.prefix_cache
        if cache is None:
            return None
        match = cache.match(list(token_ids))
        if not match.num_blocks:
            return None
        cost = cache.acquisition_cost(match)
        if cost > self.blocks.num_unclaimed:
            raise OutOfBlocks(cost, max(0, self.blocks.num_unclaimed), self.num_blocks)
        cache.pin(match)
        return match

    def unpin_prefix(self, match: PrefixMatch) -> None:
        if self.prefix_cache is None:
            raise ValueError("prefix cache is disabled")
        self.prefix_cache.unpin(match)

    # -- stepping --------------------------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """One forward over the scheduled chunks; one StepOutput per sequence in it."""
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return []
        logits = self.runner.run(
            [
                Chunk(c.token_ids, c.start, c.seq.block_table, "last" if c.sample else "none")
                for c in scheduled
            ]
        )
        for c in scheduled:
            c.seq.num_computed_tokens += c.num_tokens
            self.blocks.register_computed(c.seq)
        sampling_chunks = [(c, lg) for c, lg in zip(scheduled, logits, strict=True) if c.sample]
        sampled: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        if sampling_chunks:
            stacked = torch.stack([lg for _, lg in sampling_chunks])
            seqs = [c.seq for c, _ in sampling_chunks]
            histories = (
                [(s.prompt_token_ids, s.output_token_ids) for s in seqs]
                if any(s.sampling.processes_logits for s in seqs)
                else None
            )
            tokens = sample_batch(
                stacked,
                [s.sampling for s in seqs],
                [s.num_tokens for s in seqs],
                histories,
                self.eos_token_id,
            )
            sampled = {id(c): int(t) for (c, _), t in zip(sampling_chunks, tokens, strict=True)}
            for (c, lg), t in zip(sampling_chunks, tokens, strict=True):
                if c.seq.sampling.logprobs is not None:  # raw: the model's own logits
                    logprobs[id(c)] = token_logprob(lg, int(t), c.seq.sampling.logprobs)
        now = time.monotonic()
        outputs = []
        for c in scheduled:
            seq = c.seq
            index = seq.num_output_tokens
            new: list[int] = []
            reason = None
            if id(c) in sampled:
                token = sampled[id(c)]
                seq.token_ids.append(token)
                seq.num_sampled_tokens += 1
                if seq.first_token_time is None:
                    seq.first_token_time = now
                new = [token]
                reason = seq.stop_reason_after(token)
                if reason is not None:
                    self._finish(seq, reason)
            lp = logprobs.get(id(c))
            outputs.append(
                StepOutput(
                    seq.request_id,
                    new,
                    index,
                    seq.num_computed_tokens,
                    c.num_tokens,
                    reason is not None,
                    reason,
                    (lp,) if lp is not None and new else None,
                )
            )
        n_tokens = sum(c.num_tokens for c in scheduled)
        prefill = sum(c.num_tokens for c in scheduled if c.num_tokens > 1)
        self.num_steps += 1
        self.num_computed_tokens_total += n_tokens
        self.last_step = StepStats(
            self.num_steps,
            time.perf_counter() - t0,
            len(scheduled),
            n_tokens,
            prefill,
            n_tokens - prefill,
            len(sampled),
            tuple((c.start, c.start + c.num_tokens) for c in scheduled),
        )
        return outputs

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.monotonic()
        if not seq.keep_blocks:
            self.blocks.release(seq.block_table)
            seq.block_table = []
            self._seqs.pop(seq.request_id, None)

    # -- synchronous conveniences (the colocated reference) ------------------------------------------

    def generate(
        self,
        prompt_token_ids: Seq[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        ignore_eos: bool = False,
    ) -> list[int]:
        """Run one request to completion; returns its output token ids. Other queued requests
        progress too (their tokens are on their sequences), but their StepOutputs are dropped."""
        return list(self.stream(prompt_token_ids, max_tokens, sampling, ignore_eos))

    def generate_logprobs(
        self,
        prompt_token_ids: Seq[int],
        max_tokens: int,
        sampling: SamplingParams,
        ignore_eos: bool = False,
    ) -> tuple[list[int], list[TokenLogprob]]:
        """Like ``generate``, with each token's log-probabilities (``sampling.logprobs`` top
        ones); the reference for what the daemons carry to the router."""
        rid = self.add_request(prompt_token_ids, max_tokens, sampling, ignore_eos=ignore_eos)
        tokens: list[int] = []
        entries: list[TokenLogprob] = []
        for out in self._run_to_end(rid):
            tokens += out.new_token_ids
            entries += out.logprobs or ()
        return tokens, entries

    def stream(
        self,
        prompt_token_ids: Seq[int],
        max_tokens: int,
        sampling: SamplingParams | None = None,
        ignore_eos: bool = False,
        request_id: str | None = None,
    ) -> Iterator[int]:
        """Like ``generate`` but yields each token as soon as it is sampled. Closing the iterator
        early aborts the request."""
        rid = self.add_request(
            prompt_token_ids, max_tokens, sampling, request_id, ignore_eos=ignore_eos
        )
        with contextlib.closing(self._run_to_end(rid)) as outputs:  # closed early: aborted
            for out in outputs:
                yield from out.new_token_ids

    def _run_to_end(self, rid: str) -> Iterator[StepOutput]:
        """Step the engine until request ``rid`` finishes, yielding its StepOutputs; the
        request is aborted if the caller stops early or the engine makes no progress."""
        seq = self._seqs[rid]
        try:
            while not seq.is_finished:
                outputs = self.step()
                if not outputs:
                    raise RuntimeError(
                        f"engine made no progress on request {rid!r} "
                        f"(held, or the pool cannot admit it)"
                    )
                yield from (out for out in outputs if out.request_id == rid)
        finally:
            if not seq.is_finished:
                self.abort(rid)

    # -- helpers --------------------------------------------------------------------------------------

    def _live(self, request_id: str) -> Sequence:
        seq = self.get_sequence(request_id)
        if seq.is_finished:
            raise ValueError(f"request {request_id!r} has finished ({seq.finish_reason})")
        return seq

    def _resolve_sampling(self, sampling: SamplingParams | None) -> SamplingParams:
        sampling = SamplingParams() if sampling is None else sampling
        sampling.validate()
        if sampling.temperature > 0 and sampling.seed is None:
            # A concrete seed fixed at admission: the randomness stays a pure function of
            # (seed, position), so the request can move to another engine and continue.
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        return sampling

    def _check_tokens(self, token_ids: Seq[int], what: str, allow_empty: bool = False) -> list[int]:
        if isinstance(token_ids, (str, bytes)):
            raise ValueError(f"{what} must be a sequence of ints, not {type(token_ids).__name__}")
        vocab = self.config.vocab_size
        if isinstance(token_ids, (list, tuple)) and all_ints_within(token_ids, vocab - 1):
            tokens = list(token_ids)  # the daemons' case: ints already, checked in C
        else:  # tensors, numpy ints, bad ids: one by one, naming the bad ones
            tokens = [int(t) for t in token_ids]
            bad = [t for t in tokens if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{what} has ids outside the vocabulary [0, {vocab}): {bad[:5]}")
        if not tokens and not allow_empty:
            raise ValueError(f"{what} must not be empty")
        return tokens
