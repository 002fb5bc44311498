"""Roofline cost of one forward on one instance (a group of `gpus` chips serving one model copy).

A forward over T new tokens of S sequences takes

    overhead + max(FLOPs / compute, bytes / bandwidth) + comm + S x per_seq + A x per_ctx

where
- FLOPs = 2 x active parameters x T (the matmuls) + 4 x layers x heads x head_dim x attention
  pairs (QK^T and AV, one pair per (new token, cached or new token it attends to));
- bytes = weights touched (all dense weights; for an MoE the expected share of experts a batch of
  T tokens routes to, 1 - (1 - k/E)^T) + KV read (every context token of every sequence) + KV
  written (T tokens);
- comm = two activation all-reduces per layer over the scale-up link when gpus > 1 (a ring:
  each GPU sends 2 (g - 1) / g of the activations at one direction's rate, half the chip's
  ``scale_up_gbs``, which like the datasheets adds both directions);
- per_seq (chip ``step_per_seq_us``) and per_ctx (chip ``step_per_ctx_token_ns``, A = the context
  tokens the S sequences attend to, cached plus new) are serial host-side work the roofline has no
  term for: pddnet's CPU engine runs attention sequence by sequence in Python (and, when the
  shipped ``cpu-local`` profile was fitted, gathered each sequence's paged KV into a contiguous
  copy per layer; it now reads the pool in place, pddnet/model/paged_attention.py, so a refit
  would give smaller terms), so on a CPU a decode step grows with the batch and its context far
  faster than the bytes read (batch 1 -> 16: ~3x). Both default to 0, so GPU profiles (fused,
  batched attention kernels) are pure roofline; a profile fitted by ``pdd sim calibrate``
  sets them.
A chip's ``step_jitter_cv`` (default 0: none) multiplies every decode / extend step by a random
factor of mean 1 and that coefficient of variation (log-normal, so never negative), drawn from a
stream seeded by the chip's name: deterministic for a run, like everything in the simulator.
It stands for a chip shared with other work -- on the calibration's CPU box the daemons and other
jobs take turns on two cores, so a step's time depends on who else runs -- and is fitted there
from the spread of measured steps around their fitted mean. pddnet/sim/decode.py costs a segment
of steps with constant membership by one call, so the spread is drawn per segment (tens of
steps, about one contending prefill on that box); estimates should pass ``jitter=False``.
A cost may belong to an instance that shares a host's cores with others (``host``, a
``SharedHost``, and ``host_member``, the instance's name there; default none): then every
prefill step and decode step (estimates included: on the testbed they are measured steps) is
multiplied by ``contention()``, 1 + the fitted weights of the other members active at that
moment. It is the calibration box again, explicitly: three daemons with one torch thread
each on two cores, so P's forwards run slower while RLD and MD decode, and theirs while P
prefills.
So a prefill of thousands of tokens is compute-bound and a decode step memory-bound, without
saying so anywhere: the max() decides. Extend (MD recomputing RLD's tokens) is the same forward
with T = decode batch + extend tokens, which is why it costs little more than a decode step.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from pddnet.device.profiles import ChipProfile, ModelProfile

ACTIVATION_BYTES = 2  # bf16 activations on the scale-up link


@dataclass(frozen=True)
class InstanceCost:
    chip: ChipProfile
    model: ModelProfile
    gpus: int = 1
    memory_utilisation: float = 0.9  # share of HBM for weights + KV (the rest: activations)
    host: SharedHost | None = field(default=None, compare=False, repr=False)
    host_member: str = ""  # this instance's name on `host`
    # constants of the hot path, computed once by __post_init__ (not parameters)
    _compute: float = field(init=False, repr=False, compare=False)
    _bandwidth: float = field(init=False, repr=False, compare=False)
    _attn: float = field(init=False, repr=False, compare=False)
    _dense_bytes: float = field(init=False, repr=False, compare=False)
    _expert_bytes: float = field(init=False, repr=False, compare=False)
    _comm_per_token: float = field(init=False, repr=False, compare=False)
    _kvpt: float = field(init=False, repr=False, compare=False)
    _per_seq: float = field(init=False, repr=False, compare=False)
    _per_ctx: float = field(init=False, repr=False, compare=False)
    _jitter: tuple[float, float] | None = field(init=False, repr=False, compare=False)
    _jitter_rng: random.Random = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.gpus, int) or self.gpus < 1:
            raise ValueError(f"gpus per instance must be an int >= 1, got {self.gpus!r}")
        if not 0 < self.memory_utilisation <= 1:
            raise ValueError(
                f"memory_utilisation must be in (0, 1], got {self.memory_utilisation!r}"
            )
        if self.kv_capacity_bytes <= 0:
            raise ValueError(
                f"model {self.model.name!r} ({self.model.weight_bytes / 1e9:.1f} GB of weights) "
                f"does not fit on {self.gpus} x {self.chip.name} "
                f"({self.gpus * self.chip.memory_gb:g} GB at {self.memory_utilisation:.0%}): "
                f"use more gpus per instance"
            )
        if self.host is not None and self.host_member not in self.host.members:
            raise ValueError(
                f"host_member {self.host_member!r} has not joined the host "
                f"(members: {', '.join(sorted(self.host.members)) or 'none'})"
            )
        m = self.model
        # Constants of the hot path, computed once.
        object.__setattr__(
            self,
            "_compute",
            self.gpus * self.chip.flops_per_s(m.compute_dtype) * self.chip.compute_efficiency,
        )
        object.__setattr__(
            self,
            "_bandwidth",
            self.gpus * self.chip.memory_bw_gbs * 1e9 * self.chip.bandwidth_efficiency,
        )
        object.__setattr__(self, "_attn", attention_flops_per_pair(m))
        object.__setattr__(
            self, "_dense_bytes", (m.total_params - m.expert_params) * m.weight_bytes_per_param
        )
        object.__setattr__(self, "_expert_bytes", m.expert_params * m.weight_bytes_per_param)
        comm = 0.0
        if self.gpus > 1:
            per_token = (
                2
                * m.num_layers
                * m.hidden_size
                * ACTIVATION_BYTES
                * 2
                * (self.gpus - 1)
                / self.gpus
            )
            # scale_up_gbs is the datasheet's figure, both directions added (H100 NVLink: 900
            # GB/s); a ring all-reduce sends at one direction's rate, half of it
            comm = per_token / (self.chip.scale_up_gbs * 1e9 / 2)
        object.__setattr__(self, "_comm_per_token", comm)
        object.__setattr__(self, "_kvpt", m.kv_bytes_per_token)
        object.__setattr__(self, "_per_seq", self.chip.step_per_seq_us * 1e-6)
        object.__setattr__(self, "_per_ctx", self.chip.step_per_ctx_token_ns * 1e-9)
        cv = self.chip.step_jitter_cv
        sigma = math.sqrt(math.log1p(cv * cv))  # log-normal with mean 1 and this cv
        object.__setattr__(self, "_jitter", (-sigma * sigma / 2, sigma) if cv > 0 else None)
        object.__setattr__(self, "_jitter_rng", random.Random(jitter_seed(self.chip.name)))

    # -- capacities ---------------------------------------------------------------------------

    @property
    def kv_capacity_bytes(self) -> float:
        return (
            self.gpus * self.chip.memory_gb * 1e9 * self.memory_utilisation
            - self.model.weight_bytes
        )

    def kv_capacity_tokens(self) -> int:
        return int(self.kv_capacity_bytes // self.model.kv_bytes_per_token)

    @property
    def rdma_bytes_per_s(self) -> float:
        """Scale-out (RDMA) bandwidth of the instance: one NIC per GPU."""
        return self.gpus * self.chip.scale_out_gbit * 1e9 / 8

    @property
    def price_per_hour(self) -> float:
        return self.gpus * self.chip.price_per_hour

    # -- the roofline -------------------------------------------------------------------------

    def weight_bytes_touched(self, tokens: int) -> float:
        m = self.model
        if not m.expert_params:
            return self._dense_bytes
        share = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** max(tokens, 1)
        return self._dense_bytes + self._expert_bytes * share

    def forward_time(
        self, new_tokens: int, attn_pairs: float, kv_read_tokens: float, seqs: int = 1
    ) -> float:
        """Seconds for one forward over `new_tokens` tokens of `seqs` sequences attending
        `attn_pairs` (token, context token) pairs and reading the KV of `kv_read_tokens` cached
        positions."""
        flops = 2.0 * self.model.active_params * new_tokens + self._attn * attn_pairs
        nbytes = self.weight_bytes_touched(new_tokens) + (kv_read_tokens + new_tokens) * self._kvpt
        return (
            self.chip.step_overhead_ms * 1e-3
            + max(flops / self._compute, nbytes / self._bandwidth)
            + self._comm_per_token * new_tokens
            + self._per_seq * seqs
            + self._per_ctx * (kv_read_tokens + new_tokens)
        )

    def prefill_chunk_time(self, start: int, end: int) -> float:
        """One prefill chunk computing positions [start, end) on top of a cached [0, start)."""
        if not 0 <= start < end:
            raise ValueError(f"bad prefill chunk [{start}, {end})")
        pairs = (end * (end + 1) - start * (start + 1)) / 2
        return self.forward_time(end - start, pairs, start)

    def prefill_step_time(self, chunks: list[tuple[int, int]]) -> float:
        """One forward computing several prompts' chunks [start, end) at once (a batched
        prefill step): their tokens, attention pairs and cached positions add up, one
        sequence each. A single chunk costs exactly ``prefill_chunk_time``."""
        if not chunks:
            raise ValueError("a prefill step needs at least one chunk")
        tokens, pairs, cached = 0, 0.0, 0
        for start, end in chunks:
            if not 0 <= start < end:
                raise ValueError(f"bad prefill chunk [{start}, {end})")
            tokens += end - start
            pairs += (end * (end + 1) - start * (start + 1)) / 2
            cached += start
        return self.forward_time(tokens, pairs, cached, seqs=len(chunks))

    def contention(self) -> float:
        """Slowdown of a forward starting now from the host's other busy members (1: none)."""
        if self.host is None:
            return 1.0
        return self.host.slowdown(self.host_member)

    def prefill_time(self, cached: int, total: int, chunk: int) -> float:
        """A whole prefill of positions [cached, total) in chunks of at most `chunk` tokens."""
        t, pos = 0.0, cached
        while pos < total:
            end = min(total, pos + chunk)
            t += self.prefill_chunk_time(pos, end)
            pos = end
        return t

    def decode_step_time(
        self,
        batch: int,
        context_tokens: float,
        extend_tokens: int = 0,
        extend_pairs: float = 0.0,
        extend_seqs: int | None = None,
        jitter: bool = True,
        extend_context: float = 0.0,
    ) -> float:
        """One continuous-batching step: `batch` sequences decode one token each over
        `context_tokens` cached positions in total, plus `extend_tokens` recomputed tokens
        (attending `extend_pairs` pairs) of `extend_seqs` sequences (default: one when there
        are extend tokens) batched into the same forward, on top of `extend_context` cached
        positions of theirs, whose KV the forward reads too (so an extend costs what the
        engine's paced forward over the same chunks costs: ``prefill_step_time``). With the
        chip's ``step_jitter_cv`` > 0 and ``jitter``, the time is multiplied by one seeded
        random factor of mean 1; ``jitter=False`` gives the mean (for estimates). On a shared
        host (``host``) the step, estimate or not, is slowed by ``contention()``: what a
        policy would measure there (the testbed's P sees RLD's measured step times)."""
        if batch + extend_tokens <= 0:
            return 0.0
        if extend_seqs is None:
            extend_seqs = 1 if extend_tokens > 0 else 0
        t = self.forward_time(
            batch + extend_tokens,
            context_tokens + extend_pairs,
            context_tokens + extend_context,
            seqs=batch + extend_seqs,
        )
        if jitter and self._jitter is not None:
            mu, sigma = self._jitter
            t *= self._jitter_rng.lognormvariate(mu, sigma)
        if self.host is not None:
            t *= self.host.slowdown(self.host_member)
        return t


class SharedHost:
    """Instances taking turns on one host's cores. A forward of member X that starts while
    the other members Y are active takes 1 + sum of ``weights[(X, Y)] x activity(Y)`` times
    as long (pairs not given weigh 0). A member's activity is what its callable returns: an
    instance says whether it is computing (True = 1, False = 0); a member that is not an
    instance (work outside the simulation, e.g. a recorded load average above its floor)
    says how much there is. It is read when a step (or a decode segment) starts, so a
    neighbour that starts or stops in the middle is seen from the next one on."""

    def __init__(self, weights: Mapping[tuple[str, str], float]) -> None:
        for pair, w in weights.items():
            if not (isinstance(pair, tuple) and len(pair) == 2 and pair[0] != pair[1]):
                raise ValueError(f"host weight key must be a pair of two members, got {pair!r}")
            if not isinstance(w, (int, float)) or isinstance(w, bool) or not w >= 0:
                raise ValueError(f"host weight {pair!r} must be a number >= 0, got {w!r}")
        self.weights = dict(weights)
        self.members: dict[str, Callable[[], float]] = {}

    def join(self, name: str, activity: Callable[[], float]) -> None:
        if name in self.members:
            raise ValueError(f"{name!r} has already joined this host")
        self.members[name] = activity

    def slowdown(self, name: str) -> float:
        if name not in self.members:
            raise ValueError(f"{name!r} is not a member of this host")
        f = 1.0
        for other, activity in self.members.items():
            w = self.weights.get((name, other), 0.0)
            if w and other != name:
                a = activity()
                if a < 0:
                    raise ValueError(f"host member {other!r} reports activity {a!r} < 0")
                f += w * a
        return f


def jitter_seed(chip_name: str) -> str:
    """Seed of a chip's step-jitter stream (a str seed: stable across runs and processes)."""
    return f"pddnet-sim-step-jitter:{chip_name}"


def attention_flops_per_pair(model: ModelProfile) -> float:
    """QK^T and AV of one (new token, token it attends to) pair, over every layer and head."""
    return 4.0 * model.num_layers * model.num_heads * model.head_dim


def prefill_flops(model: ModelProfile, tokens: int) -> float:
    """FLOPs of a prefill of ``tokens`` uncached tokens: the compute term of
    ``InstanceCost.prefill_chunk_time(0, tokens)``, which the calibration fits P's rate to."""
    return (
        2.0 * model.active_params * tokens
        + attention_flops_per_pair(model) * tokens * (tokens + 1) / 2
    )
