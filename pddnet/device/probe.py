"""``--dilation auto``: the smallest time dilation k at which this box keeps up with the modelled
devices, found by a short probe of the real engine before the cluster starts.

The probe runs the cluster's real model in this process on the shapes the daemons will run:
a prefill of ``context`` tokens in the prefill daemon's chunks, then ``batch`` requests sharing
that prefix (prefix-cache hits) decoding together. Each forward's real time is set against the
modelled time of the same forward on each role's device (prefill chunks for P, decode steps for
RLD and MD).

One such pass is noisy (a handful of forwards, the first of each kind paying the process's
warm-up), so the probe runs a short warm-up pass it does not time, then several timed passes on
fresh prompts with the start-up heap frozen out of the garbage collector (as the daemons do),
and takes for each role the ratio that at most ``PROBE_TAIL`` of its forwards exceeded, over
all passes: a high percentile, not a max of a few samples. k is the worst role's ratio x
``PROBE_MARGIN`` x the daemons per core (three daemons with one torch thread each on two
cores: 1.5), rounded up to a tenth. The pure part is ``estimate``.

Longer contexts or larger batches than probed can still overrun: every daemon counts its
overruns at run time and every output reports them.
"""

from __future__ import annotations

import gc
import math
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from pddnet.device.emulated import EmulationError
from pddnet.device.pacer import ratio_within

PROBE_BATCH = 4
PROBE_DECODE_STEPS = 16  # per pass
PROBE_MAX_CONTEXT = 8192
# The untimed pass's context: a chunk's prefill and the decode steps after it are every kind of
# forward once (a warm-up of one token left the first timed pass slower; 8K did no better).
PROBE_WARM_UP_CONTEXT = 2048
PROBE_PASSES = (2, 12)  # timed passes: at least, at most
PROBE_BUDGET_S = 1.5  # more timed passes (up to the most) while the timed ones took less
# The ratio at most this share of the probe's forwards exceeded (its 95th percentile): the
# daemons may overrun on 1% of their forwards, but a probe of a few dozen forwards per role
# cannot place its 99th percentile; the margin covers the rest.
PROBE_TAIL = 0.05
# Above that ratio: what a probe of seconds does not see (the box's slower moments over a
# run of minutes, the run's other shapes, the cluster's other processes). Chosen on this box:
# with 1.2 the probe's own later forwards still went above the ratio x margin on a few
# percent of them, with 1.5 on about 1% or less while nothing else ran.
PROBE_MARGIN = 1.5

Sample = tuple[float, float]  # one forward: (real seconds, modelled seconds)
Forward = tuple[tuple[tuple[int, int], ...], float, bool]  # chunks, real seconds, a prefill


@dataclass(frozen=True)
class RoleRatio:
    """What the probe measured for one role: ``ratio`` over every timed forward, and the same
    ratio within each pass (``low`` .. ``high``: how much the passes disagreed)."""

    ratio: float
    samples: int
    low: float
    high: float


@dataclass(frozen=True)
class Estimate:
    dilation: float
    by_role: dict[str, RoleRatio]


def role_ratio(passes: Sequence[Sequence[Sample]], tail: float = PROBE_TAIL) -> RoleRatio:
    """The real / modelled ratio that at most ``tail`` of the forwards of all ``passes``
    exceeded, with the spread of the same ratio across passes; all 0 without forwards."""
    ratios = [[real / model if model > 0 else math.inf for real, model in p] for p in passes]
    every = [r for p in ratios for r in p]
    per_pass = [ratio_within(p, tail) for p in ratios if p]
    return RoleRatio(
        ratio_within(every, tail),
        len(every),
        min(per_pass, default=0.0),
        max(per_pass, default=0.0),
    )


def estimate(
    samples_by_role: Mapping[str, Sequence[Sequence[Sample]]],
    host_share: float,
    tail: float = PROBE_TAIL,
    margin: float = PROBE_MARGIN,
) -> Estimate:
    """k from each role's timed forwards (per pass): the worst role's ``role_ratio`` x
    ``margin`` x ``host_share`` (daemons per core), rounded up to a tenth, at least 1."""
    by_role = {role: role_ratio(passes, tail) for role, passes in samples_by_role.items()}
    worst = max((r.ratio for r in by_role.values()), default=0.0)
    if not math.isfinite(worst):
        return Estimate(math.inf, by_role)
    k = max(1.0, math.ceil(worst * margin * host_share * 10 - 1e-9) / 10)
    return Estimate(k, by_role)


@dataclass
class ProbeResult:
    dilation: float
    context: int
    batch: int
    host_share: float  # daemons per core (>= 1)
    seconds: float = 0.0
    ratio_by_role: dict[str, float] = field(default_factory=dict)  # at PROBE_TAIL, all passes
    passes: int = 0  # timed passes (the warm-up pass is not counted)
    samples_by_role: dict[str, int] = field(default_factory=dict)  # timed forwards
    spread_by_role: dict[str, tuple[float, float]] = field(default_factory=dict)  # per pass
    percentile: float = 100 * (1 - PROBE_TAIL)
    margin: float = PROBE_MARGIN

    def to_dict(self) -> dict[str, Any]:
        rounded = {r: round(v, 3) for r, v in self.ratio_by_role.items()}
        spread = {r: [round(lo, 3), round(hi, 3)] for r, (lo, hi) in self.spread_by_role.items()}
        return {
            **asdict(self),
            "seconds": round(self.seconds, 3),
            "ratio_by_role": rounded,
            "spread_by_role": spread,
        }

    def summary(self) -> str:
        """The one line ``pdd up`` prints."""
        roles = []
        for i, (role, ratio) in enumerate(self.ratio_by_role.items()):
            lo, hi = self.spread_by_role.get(role, (ratio, ratio))
            n = self.samples_by_role.get(role, 0)
            of, passes = ("forwards ", "passes ") if i == 0 else ("", "")
            roles.append(f"{role} {ratio:.2f} of {n} {of}[{passes}{lo:.2f}-{hi:.2f}]")
        return (
            f"pdd: dilation auto -> k = {self.dilation:g} (p{self.percentile:g} real/modelled, "
            f"{self.passes} passes: {', '.join(roles)}; x {self.margin:g} margin x "
            f"{self.host_share:g} daemons per core; probe took {self.seconds:.1f} s)"
        )


def probe_dilation(
    config: Any,
    context: int | None = None,
    batch: int = PROBE_BATCH,
    log: Callable[[str], Any] = print,
) -> ProbeResult:
    """Probe the real engine and return the k the config's devices need on this box."""
    import torch

    from pddnet.engine.engine import Engine
    from pddnet.model.loader import load_model

    emulation = config.emulation()
    if emulation is None:
        raise EmulationError(
            "--dilation auto needs emulated devices: set --target-model and --device ROLE=CHIP"
        )
    t0 = time.monotonic()
    roles = config.mode.model_roles
    model, tokenizer = load_model(config.model.name, config.model.dtype, config.model.seed)
    decode_pool = min(
        getattr(config, r).num_blocks * getattr(config, r).block_size
        for r in roles
        if r != "prefill"
    )
    if context is None:
        context = min(PROBE_MAX_CONTEXT, model.config.max_position // 2, decode_pool // (batch + 1))
    context = max(16, context)
    p = config.prefill
    blocks = -(-(context + batch + PROBE_DECODE_STEPS) // p.block_size) * (batch + 1)
    torch.set_num_threads(config.model.threads)
    log(
        f"pdd: probing the dilation: {config.model.name} on this box, a {context}-token "
        f"prefill then {batch} sequences decoding, against {emulation.target.name} on "
        f"{', '.join(f'{r}={c.gpus} x {c.chip.name}' for r, c in emulation.devices.items())}"
    )
    rng = random.Random(0)
    vocab = min(model.config.vocab_size, 256)
    passes: list[list[Forward]] = []
    with Engine(
        model,
        tokenizer,
        num_blocks=blocks,
        block_size=p.block_size,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_num_seqs=max(batch, 1),
    ) as engine:
        run_pass(engine, rng, min(context, PROBE_WARM_UP_CONTEXT), batch, vocab)  # not timed
        # The daemons serve with their start-up heap frozen (pddnet.cluster.cli.freeze_start_up):
        # a full collection over the model and the engine would be a pause they do not pay.
        gc.collect()
        gc.freeze()
        try:
            timed = time.monotonic()
            least, most = PROBE_PASSES
            while len(passes) < least or (
                len(passes) < most and time.monotonic() - timed < PROBE_BUDGET_S
            ):
                passes.append(run_pass(engine, rng, context, batch, vocab))
        finally:
            gc.unfreeze()
    share = max(1.0, len(roles) / (os.cpu_count() or 1))
    samples = {}
    for role in roles:
        cost = emulation.cost_of(role)
        wants_prefill = role == "prefill"
        samples[role] = [
            [
                (real, cost.prefill_step_time(list(chunks)))
                for chunks, real, is_prefill in forwards
                if is_prefill == wants_prefill
            ]
            for forwards in passes
        ]
    got = estimate(samples, share)
    result = ProbeResult(
        got.dilation,
        context,
        batch,
        share,
        time.monotonic() - t0,
        {r: v.ratio for r, v in got.by_role.items()},
        len(passes),
        {r: v.samples for r, v in got.by_role.items()},
        {r: (v.low, v.high) for r, v in got.by_role.items()},
    )
    log(result.summary())
    return result


def run_pass(
    engine: Any, rng: random.Random, context: int, batch: int, vocab: int
) -> list[Forward]:
    """One pass on a fresh prompt (no prefix-cache hit on an earlier pass): its prefill, then
    ``batch`` sequences sharing it decoding PROBE_DECODE_STEPS tokens; every forward's shape and
    real time."""
    from pddnet.engine.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    base = [rng.randrange(vocab) for _ in range(context)]
    for i in range(batch):
        engine.add_request(base + [i % vocab], PROBE_DECODE_STEPS, greedy, ignore_eos=True)
    forwards: list[Forward] = []
    while engine.has_work():
        if not engine.step():
            break
        s = engine.last_step
        if s is not None:
            forwards.append((s.chunks, s.duration_s, s.num_prefill_tokens > 0))
    return forwards
