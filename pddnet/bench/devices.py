"""The emulated devices of a cluster benchmark (pddnet.device): the flags every cluster
benchmark takes (`setup_devices`: check them and resolve ``--dilation auto`` once, before any
cluster starts) and what the benchmarks store and print about the devices afterwards
(`device_report` per cluster run, `print_validity`: a run whose devices overran on more than 1%
of the forwards says its times are not valid, and which k would make them so)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class DeviceSetup:
    """The emulated devices of a benchmark run, checked and with k numeric (auto resolved)."""

    overrides: dict[str, Any]  # config overrides for every cluster of the run
    dilation: float  # k: workload time x k, reported durations / k
    target_model: str | None = None  # None: unpaced
    devices: dict[str, str] | None = None  # role -> "8 x h100-sxm", over all the run's clusters
    auto: bool = False  # k came from --dilation auto's probe
    wire_scale: float = 1.0  # real / target KV bytes per token (1 unpaced)

    @property
    def emulated(self) -> bool:
        return self.target_model is not None

    def line(self) -> str:
        """One line naming the device profiles and k (every table prints it)."""
        if not self.emulated:
            return "devices: unpaced: this box's own times"
        on = ", ".join(f"{role} {desc}" for role, desc in (self.devices or {}).items())
        return (
            f"devices: emulated {self.target_model} on {on}; k = {self.dilation:g}"
            f"{' (auto)' if self.auto else ''} (times / k)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"emulated": self.emulated, **asdict(self)}

    def wall_rate_mbit(self, modelled_mbit: float) -> float:
        """A link rate of the modelled world (the target's KV bytes, modelled seconds) as the
        rate the emulator must run at on this box (real bytes, wall seconds): x scale / k."""
        return modelled_mbit * self.wire_scale / self.dilation

    def modelled_rate_mbit(self, wall_mbit: float) -> float:
        """The inverse of `wall_rate_mbit`."""
        return wall_mbit * self.dilation / self.wire_scale


UNPACED = DeviceSetup(overrides={}, dilation=1.0)


def setup_devices(
    args: argparse.Namespace, clusters: Mapping[str, Mapping[str, Any]], log: Any = print
) -> DeviceSetup:
    """Check the emulated-device flags (pddnet.device.flags) against every cluster the benchmark
    will start -- `clusters`: label -> the overrides its LocalCluster gets (with "mode" and
    "model.name") -- and resolve ``--dilation auto`` once, on the cluster with the most model
    roles, so that every cluster of the run uses the same numeric k. Raises ValueError (the
    benchmark's option error) before anything starts."""
    from pddnet.config import load_config
    from pddnet.device import flags
    from pddnet.device.dilation import real_kv_bytes_per_token
    from pddnet.device.emulated import DEVICE_ROLES

    if (
        getattr(args, "target_model", None) is None
        and not getattr(args, "device", None)
        and getattr(args, "dilation", None) is None
    ):
        return UNPACED
    try:
        dev = flags.overrides(args)
    except argparse.ArgumentTypeError as exc:
        raise ValueError(str(exc)) from None
    configs = {label: load_config(None, {**base, **dev}) for label, base in clusters.items()}
    auto = args.dilation == "auto"
    if auto:
        probe = max(configs.values(), key=lambda c: len(c.mode.model_roles))
        flags.resolve_auto(probe, args, log=log)
        dev["dilation"] = probe.dilation
        configs = {label: load_config(None, {**base, **dev}) for label, base in clusters.items()}
    emulated = [(c, e) for c in configs.values() if (e := c.emulation()) is not None]
    if not emulated:
        return UNPACED
    emulations = [e for _, e in emulated]
    scale = emulations[0].wire_scale(real_kv_bytes_per_token(emulated[0][0].model))
    described = [e.describe() for e in emulations]
    devices = {}
    for role in DEVICE_ROLES:
        for d in described:
            if role in d["devices"]:
                devices[role] = d["devices"][role]
                break
    return DeviceSetup(
        overrides=dev,
        dilation=emulations[0].dilation,
        target_model=emulations[0].target.name,
        devices=devices,
        auto=auto,
        wire_scale=scale,
    )


async def daemon_stats(cluster: Any) -> dict[str, dict[str, Any]]:
    """Every daemon's stats() but the router's (which runs no model)."""
    return {role: await cluster.stats(role) for role in cluster.daemons if role != "router"}


def device_reports(stats_by_run: Mapping[str, Mapping[str, dict[str, Any]]]) -> dict[str, Any]:
    """Per cluster run (label -> its daemons' stats), `results.device_report`."""
    return {label: device_report(dict(stats)) for label, stats in stats_by_run.items()}


def print_validity(reports: Mapping[str, dict[str, Any]], bench: str) -> list[str]:
    """Print, prominently, a `validity_warning` for every run that overran its modelled devices
    on more than 1% of its forwards; returns them (empty when every run kept pace)."""
    warnings = [
        w
        for label, r in reports.items()
        if (w := validity_warning(r, f"{bench} {label}".strip())) is not None
    ]
    if warnings:
        bar = "!" * 100
        print(f"\n{bar}")
        for w in warnings:
            print(f"!! {w}")
        print(bar, flush=True)
    return warnings


def device_report(stats_by_role: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The emulated devices of one cluster run, from its daemons' stats(): per role the device
    and its overruns, and whether the run's times are valid (every role at most 1% overrun
    forwards; else the dilation that would have made them so). ``{"emulated": False}`` for an
    unpaced run."""
    from pddnet.device.pacer import VALID_OVERRUN_SHARE

    roles = {
        r: s["device"]
        for r, s in stats_by_role.items()
        if isinstance(s.get("device"), dict) and s["device"].get("emulated")
    }
    if not roles:
        return {"emulated": False}
    steps = sum(d["steps"] for d in roles.values())
    overruns = sum(d["overruns"] for d in roles.values())
    valid = all(d["overrun_share"] <= VALID_OVERRUN_SHARE for d in roles.values())
    return {
        "emulated": True,
        "roles": roles,
        "steps": steps,
        "overruns": overruns,
        "overrun_share": overruns / steps if steps else 0.0,
        "valid": valid,
        "dilation": max(d["dilation"] for d in roles.values()),
        "dilation_needed": max(d["dilation_needed"] for d in roles.values()),
    }


def validity_warning(report: dict[str, Any], what: str = "this run") -> str | None:
    """The line a benchmark prints when its emulated devices overran on more than 1% of the
    forwards: its times are not those of the modelled devices."""
    if not report.get("emulated") or report["valid"]:
        return None
    worst = max(report["roles"].items(), key=lambda kv: kv[1]["overrun_share"])
    return (
        f"NOT VALID: {what} overran its modelled devices on {report['overruns']} of "
        f"{report['steps']} forwards ({worst[0]}: {worst[1]['overrun_share']:.1%} > 1%), so "
        f"its times are this box's, not the devices'; rerun with --dilation "
        f"{report['dilation_needed']:g} or more (it ran at k = {report['dilation']:g})"
    )
