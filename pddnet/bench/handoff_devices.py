"""handoff bench: RLD's and MD's emulated accelerators (--target-model, --device ROLE=CHIP[:GPUS],
--dilation K|auto; docs/emulated-devices.md).

The flags are checked and k resolved by `pddnet.bench.devices.setup_devices`, as for every
cluster benchmark, against the PDD cluster the two engines stand for; each engine's pacer is the
one its daemon would build (`StepPacer(emulation.cost_of(role), k)`, pddnet/roles/engine_host.py).
Only relay and main-decode are paced: P's prefill is setup here, never timed, so without a
`--device prefill=...` the check gives P the relay's chip (the source's P and RLD are both H100)
or MD's.
The engines are stepped in the bench's own threads, not in an `EngineWorker`, so `paced_step`
does what the worker does after a forward: tell the pacer its shape and wall time and sleep what
it answers. As in the daemons, KV imports and exports are not forwards and are not paced."""

from __future__ import annotations

import argparse
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from pddnet.bench.devices import UNPACED, DeviceSetup, device_report, setup_devices
from pddnet.device.pacer import StepPacer

PACED_ROLES = ("relay", "main_decode")  # the two engines a handoff runs on


@dataclass
class HandoffDevices:
    """The run's devices (`setup`: k, wire scale) and the pacer of each paced engine."""

    setup: DeviceSetup = field(default_factory=lambda: UNPACED)
    pacers: dict[str, StepPacer] = field(default_factory=dict)  # empty: unpaced
    target_model: str | None = None

    @property
    def k(self) -> float:
        return self.setup.dilation

    @property
    def emulated(self) -> bool:
        return self.setup.emulated

    def pacer(self, role: str) -> StepPacer | None:
        return self.pacers.get(role)

    def target_bytes(self, real_kv_bytes: int) -> int:
        """Real KV bytes as the target model's (real x target / real bytes per token)."""
        return round(real_kv_bytes / self.setup.wire_scale)

    def report(self) -> dict[str, Any]:
        """`device_report` of the two engines, from their pacers as a daemon's stats() gives
        them (pddnet/roles/daemon_stats.py)."""
        return device_report(
            {
                role: {
                    "device": {
                        "emulated": True,
                        "chip": p.cost.chip.name,
                        "gpus": p.cost.gpus,
                        "target_model": self.target_model,
                        "wire_scale": self.setup.wire_scale,
                        **p.to_stats(),
                    }
                }
                for role, p in self.pacers.items()
            }
        )


def cluster_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The PDD cluster whose relay and main-decode engines the bench runs, for the flags' check;
    P (not paced here) gets the relay's chip, or MD's, unless --device prefill=... names one."""
    from pddnet.device.emulated import parse_device_flags

    base: dict[str, Any] = {"mode": "pdd", "model.name": args.model}
    given = parse_device_flags(getattr(args, "device", None) or [])
    if "prefill.device" not in given:
        for role in PACED_ROLES:
            if f"{role}.device" in given:
                base["prefill.device"] = given[f"{role}.device"]
                base["prefill.gpus"] = given.get(f"{role}.gpus", 1)
                break
    return base


def setup_handoff_devices(args: argparse.Namespace, log: Any = print) -> HandoffDevices:
    """Check the flags, resolve --dilation auto, and build the relay's and MD's pacers. Raises
    ValueError (the bench's option error) before anything starts."""
    from pddnet.config import load_config

    base = cluster_overrides(args)
    setup = setup_devices(args, {"handoff": base}, log=log)
    if not setup.emulated:
        return HandoffDevices(setup)
    emulation = load_config(None, {**base, **setup.overrides}).emulation()
    assert emulation is not None
    shown = {r: d for r, d in (setup.devices or {}).items() if r in PACED_ROLES}
    return HandoffDevices(
        dataclasses.replace(setup, devices=shown),
        {r: StepPacer(emulation.cost_of(r), emulation.dilation) for r in PACED_ROLES},
        emulation.target.name,
    )


def paced_step(engine: Any, pacer: StepPacer | None) -> list[Any]:
    """One engine step; with a pacer, the forward then lasts k x its modelled time (as
    `EngineWorker._pace`: nothing is waited on an overrun, which the pacer counts)."""
    before = engine.last_step
    outputs = engine.step()
    step = engine.last_step
    if pacer is not None and step is not None and step is not before:
        wait = pacer.pace(step.chunks, 0.0, step.duration_s)
        if wait > 0:
            time.sleep(wait)
    return outputs
