"""``--dilation auto``: the smallest time dilation k at which this box keeps up with the modelled
devices, found by a short probe of the real engine before the cluster starts.

The probe runs the cluster's real model in this process on the shapes the daemons will run:
a prefill of ``context`` tokens in the prefill daemon's chunks, then ``batch`` requests sharing
that prefix (prefix-cache hits) decoding together. Each forward's real time is set against the
modelled time of the same forward on each role's device; a role needs k >= the largest ratio of
the forwards it will run (prefill chunks for P, decode steps for RLD and MD). The daemons then
share the box's cores (three daemons with one torch thread each on two cores), so the probe's
k is multiplied by the daemons per core. Longer contexts or larger batches than probed can
still overrun: every daemon counts its overruns at run time and every output reports them.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from pddnet.device.emulated import EmulationError
from pddnet.device.pacer import dilation_for

PROBE_BATCH = 4
PROBE_DECODE_STEPS = 8
PROBE_MAX_CONTEXT = 8192


@dataclass
class ProbeResult:
    dilation: float
    context: int
    batch: int
    host_share: float  # daemons per core (>= 1)
    seconds: float = 0.0
    ratio_by_role: dict[str, float] = field(default_factory=dict)  # worst real / modelled

    def to_dict(self) -> dict[str, Any]:
        rounded = {r: round(v, 3) for r, v in self.ratio_by_role.items()}
        return {**asdict(self), "seconds": round(self.seconds, 3), "ratio_by_role": rounded}


def probe_dilation(
    config: Any,
    context: int | None = None,
    batch: int = PROBE_BATCH,
    log: Callable[[str], Any] = print,
) -> ProbeResult:
    """Probe the real engine and return the k the config's devices need on this box."""
    import torch

    from pddnet.engine.engine import Engine
    from pddnet.engine.sampling import SamplingParams
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
    base = [rng.randrange(vocab) for _ in range(context)]
    steps: list[tuple[tuple[tuple[int, int], ...], float, bool]] = []
    with Engine(
        model,
        tokenizer,
        num_blocks=blocks,
        block_size=p.block_size,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_num_seqs=max(batch, 1),
    ) as engine:
        greedy = SamplingParams(temperature=0.0)
        for i in range(batch):
            engine.add_request(base + [i % vocab], PROBE_DECODE_STEPS, greedy, ignore_eos=True)
        while engine.has_work():
            if not engine.step():
                break
            s = engine.last_step
            if s is not None:
                steps.append((s.chunks, s.duration_s, s.num_prefill_tokens > 0))
    share = max(1.0, len(roles) / (os.cpu_count() or 1))
    ratios: dict[str, float] = {}
    for role in roles:
        cost = emulation.cost_of(role)
        wants_prefill = role == "prefill"
        rs = [
            real / cost.prefill_step_time(list(chunks))
            for chunks, real, is_prefill in steps
            if is_prefill == wants_prefill
        ]
        ratios[role] = dilation_for(rs, share=0.0) if rs else 1.0
    k = max(1.0, math.ceil(max(ratios.values()) * share * 10 - 1e-9) / 10)
    result = ProbeResult(k, context, batch, share, time.monotonic() - t0, ratios)
    log(
        f"pdd: dilation auto -> k = {k:g} (worst real/modelled per role: "
        f"{', '.join(f'{r} {v:g}' for r, v in ratios.items())}; x {share:g} daemons per core; "
        f"probe took {result.seconds:.1f} s)"
    )
    return result
