"""Time dilation and the target model's bytes on the wire: from the config a user writes (the
modelled world: a 30 ms line at 10 Gbit/s carrying llama-3-70b's 320 KiB of KV per token) to
the settings the daemons and the emulated link run with on this box (wall clock, real bytes).

One factor k per cluster (Gupta et al., "To Infinity and Beyond: Time-Warped Network
Emulation", NSDI 2006): modelled compute x k (pddnet.device.pacer), link delay and jitter x k,
rates / k, every protocol timeout and heartbeat x k; every reported time is divided by k
(``modelled_seconds``). On top, both KV paths carry the real small model's KV but must take the
time the target's would take, so their rates are scaled by real / target bytes per token
(``Emulation.wire_scale``): a 64K-token llama-3-70b prompt (~21 GB) crosses a 10 Gbit/s line in
~17 s, and so does the small model's 64 MiB on a line of 10 Gbit/s x 64 MiB / 21 GB.

Token-ID handoff frames and other control messages share the WAN with the KV and keep their
real size, so on the scaled line they take (target / real) times longer than on the real one:
at most a fraction of a millisecond per frame on the lines pddnet models (docs/emulated-devices.md).
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING

from pddnet.device.emulated import Emulation

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.config import ClusterConfig, ModelSection

_WALLCLOCK = "_pdd_wallclock"  # marks a config already dilated (not a field: never serialized)


def real_kv_bytes_per_token(model: ModelSection) -> int:
    """KV bytes per token of the model the daemons really run (a preset or an HF folder)."""
    from pddnet.model.config import PRESETS, ModelConfig

    if model.name in PRESETS:
        return ModelConfig.preset(model.name, model.dtype).kv_bytes_per_token
    from pddnet.model.weights import config_from_hf, read_hf_config

    return config_from_hf(read_hf_config(model.name), model.name, model.dtype).kv_bytes_per_token


def wallclock(config: ClusterConfig) -> ClusterConfig:
    """The config in wall-clock terms: a dilated copy when the cluster emulates devices, the
    config itself otherwise. Idempotent (a dilated copy is returned as it is)."""
    emulation = config.emulation()
    if emulation is None or getattr(config, _WALLCLOCK, False):
        return config
    k = emulation.dilation
    scale = emulation.wire_scale(real_kv_bytes_per_token(config.model))
    out = copy.deepcopy(config)
    wan, tr, router, pol = out.wan, out.transport, out.router, out.policy
    wan.rtt_ms *= k
    wan.jitter_ms *= k
    if wan.queue_ms is not None:
        wan.queue_ms *= k
    wan.heartbeat_s *= k
    wan.heartbeat_deadline_s *= k
    if wan.bw_mbit is not None:
        wan.bw_mbit = wan.bw_mbit * scale / k
    if pol.wan_bw_mbit is not None:
        pol.wan_bw_mbit = pol.wan_bw_mbit * scale / k
    # bytes of the target's KV -> the real model's (a live transfer of 117 KB real stands for
    # 26 MB of the target's and must weigh as much in P's goodput estimate as in the simulator)
    pol.goodput_full_weight_bytes = max(1, round(pol.goodput_full_weight_bytes * scale))
    tr.deadline_s *= k
    if tr.abort_grace_s is not None:
        tr.abort_grace_s *= k
    tr.progress_timeout_s = math.ceil(tr.progress_timeout_s * k)
    router.request_timeout_s *= k
    router.stall_timeout_s *= k
    pol.direct_budget_s *= k
    pol.rld_step_s *= k
    object.__setattr__(out, _WALLCLOCK, True)
    return out


def rdma_bytes_per_s(config: ClusterConfig) -> float | None:
    """Wall-clock rate (real bytes/s) of P's intra-datacenter KV path: the P instance's NICs
    (the chip profile's scale-out bandwidth x gpus), scaled like the WAN. None when unpaced
    (then the path is as fast as the machine's memory)."""
    emulation = config.emulation()
    if emulation is None:
        return None
    return wire_rate(
        emulation,
        emulation.cost_of("prefill").rdma_bytes_per_s,
        real_kv_bytes_per_token(config.model),
    )


def wire_rate(emulation: Emulation, target_bytes_per_s: float, real_kvpt: int) -> float:
    """A modelled line of ``target_bytes_per_s`` carrying real KV, in wall-clock real bytes/s."""
    return target_bytes_per_s * emulation.wire_scale(real_kvpt) / emulation.dilation


# Linux's minimum retransmission timeout (TCP_RTO_MIN; the RTO is the smoothed RTT plus at least
# this): a protocol timeout like the others, so a dilated testbed's namespaces get k x this. The
# kernel's other fixed TCP timers stay as they are (docs/emulated-devices.md).
LINUX_TCP_RTO_MIN_MS = 200.0


def tcp_rto_min_ms(dilation: float) -> float | None:
    """TCP's minimum retransmission timeout (wall ms) on the testbed of a cluster dilated by
    `dilation`; None (the kernel's own) for an undilated one."""
    return None if dilation == 1 else LINUX_TCP_RTO_MIN_MS * dilation


def modelled_seconds(wall_seconds: float, dilation: float) -> float:
    """A measured wall-clock duration as the modelled world's time (what every output shows)."""
    return wall_seconds / dilation
