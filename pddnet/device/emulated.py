"""A cluster's emulated accelerators, resolved from its config: which modelled device each role
runs on, for which target model, at which time dilation k.

The config says it in user terms (``target_model = "llama-3-70b"``, ``dilation = 4``, and
``device = "h100-sxm"``, ``gpus = 8`` in ``[prefill]``, ``[relay]``, ``[main_decode]``).
``Emulation.from_config`` checks it all before anything starts (unknown names, k < 1, a device
on a role without one, a target model whose weights or KV do not fit the chosen chips) and
gives each role its ``InstanceCost``: the one roofline the simulator uses too.

Everything real stays real (tokens, KV, protocol, sockets, the emulated link); what is modelled
is the accelerator's clock (``pddnet.device.pacer``) and the target model's KV volume on the
wire (``wire_scale``, applied by ``pddnet.device.dilation``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Protocol

from pddnet.device.cost import InstanceCost
from pddnet.device.profiles import ModelProfile, list_profiles, load_chip, load_model

DEVICE_ROLES = ("prefill", "relay", "main_decode")  # the roles that run a model
ROLE_OF_FLAG = {
    "prefill": "prefill",
    "p": "prefill",
    "relay": "relay",
    "rld": "relay",
    "main_decode": "main_decode",
    "main-decode": "main_decode",
    "md": "main_decode",
}


class EmulationError(ValueError):
    """The emulated devices are misconfigured; the message says which setting and why."""


# What emulation reads from a cluster config (pddnet.config.ClusterConfig), said as protocols:
# the config validates its emulation by calling this module, so this one must not import it.
# Besides these, the section of each role in DEVICE_ROLES (``getattr(config, role)``): its
# device, gpus, num_blocks and block_size.
class _Mode(Protocol):
    @property
    def value(self) -> str: ...
    @property
    def model_roles(self) -> tuple[str, ...]: ...


class EmulatedCluster(Protocol):
    @property
    def target_model(self) -> str: ...
    @property
    def dilation(self) -> float: ...
    @property
    def mode(self) -> _Mode: ...


@dataclass(frozen=True)
class Emulation:
    target: ModelProfile
    dilation: float
    devices: dict[str, InstanceCost]  # role section name -> the modelled instance

    @classmethod
    def from_config(cls, config: EmulatedCluster) -> Emulation | None:
        """The cluster's emulation, or None when no target model is set (then no device may be
        set either: a device without a model to pace would be silently ignored)."""
        roles = config.mode.model_roles
        devices = {r: getattr(config, r).device for r in DEVICE_ROLES if getattr(config, r).device}
        for role in sorted(set(devices) - set(roles)):
            # a role this mode does not run may keep its device (one set of flags serves the
            # three modes of a benchmark), but a misspelt chip is still an error
            _profile(load_chip, "chip", devices[role])
        if not config.target_model:
            if devices:
                raise EmulationError(
                    f"device set for {', '.join(sorted(devices))} but no target_model: name the "
                    f"model whose speed to emulate (--target-model NAME; known: "
                    f"{', '.join(list_profiles('models'))})"
                )
            if config.dilation != 1.0:
                raise EmulationError(
                    "dilation is set but no target_model: time dilation "
                    "stretches a modelled device's clock; set --target-model"
                )
            return None
        check_dilation(config.dilation)
        target = _profile(load_model, "model", config.target_model)
        missing = [r for r in roles if r not in devices]
        if missing:
            raise EmulationError(
                f"target_model {target.name!r} is set but {', '.join(missing)} "
                f"{'has' if len(missing) == 1 else 'have'} no device: "
                f"give every role of mode {config.mode.value} one (--device ROLE=CHIP; chips: "
                f"{', '.join(list_profiles('chips'))})"
            )
        costs: dict[str, InstanceCost] = {}
        for role in roles:
            sec = getattr(config, role)
            chip = _profile(load_chip, "chip", sec.device)
            try:
                cost = InstanceCost(chip, target, gpus=sec.gpus)
            except ValueError as exc:
                raise EmulationError(f"{role}: {exc}") from None
            pool_tokens = sec.num_blocks * sec.block_size
            fits = cost.kv_capacity_tokens()
            if pool_tokens > fits:
                raise EmulationError(
                    f"{role}: its KV pool holds {pool_tokens} tokens ({sec.num_blocks} blocks of "
                    f"{sec.block_size}), {pool_tokens * target.kv_bytes_per_token / 1e9:.1f} GB "
                    f"of {target.name} KV; {sec.gpus} x {chip.name} hold {fits} tokens "
                    f"({cost.kv_capacity_bytes / 1e9:.1f} GB after the weights): set "
                    f"{role}.num_blocks <= {fits // sec.block_size} or more gpus"
                )
            costs[role] = cost
        return cls(target, float(config.dilation), costs)

    def cost_of(self, role: str) -> InstanceCost:
        try:
            return self.devices[role]
        except KeyError:
            raise EmulationError(f"{role} has no emulated device") from None

    def wire_scale(self, real_kv_bytes_per_token: int) -> float:
        """Real over target KV bytes per token: a link carrying real KV at rate x this takes the
        time the target model's KV would take at the rate."""
        if real_kv_bytes_per_token < 1:
            raise EmulationError(
                f"real KV bytes per token must be >= 1, got {real_kv_bytes_per_token}"
            )
        return real_kv_bytes_per_token / self.target.kv_bytes_per_token

    def describe(self) -> dict[str, Any]:
        """What every output that shows a time says about how it was produced."""
        return {
            "target_model": self.target.name,
            "dilation": self.dilation,
            "target_kv_bytes_per_token": self.target.kv_bytes_per_token,
            "devices": {r: f"{c.gpus} x {c.chip.name}" for r, c in self.devices.items()},
        }


def check_dilation(k: Any) -> float:
    if isinstance(k, bool) or not isinstance(k, (int, float)) or not 1 <= k < math.inf:
        raise EmulationError(
            f"dilation must be a number >= 1, got {k!r} (k < 1 would ask the "
            f"2-core host to run faster than real time)"
        )
    return float(k)


def parse_device_flags(flags: list[str]) -> dict[str, Any]:
    """``--device ROLE=CHIP[:GPUS]`` flags -> config overrides, e.g. ``{"relay.device":
    "h100-sxm", "relay.gpus": 8}``."""
    out: dict[str, Any] = {}
    for flag in flags:
        role, sep, value = flag.partition("=")
        key = role.strip().lower()
        chip, colon, gpus = value.strip().partition(":")
        if not sep or not chip:
            raise EmulationError(
                f"--device takes ROLE=CHIP[:GPUS] (e.g. prefill=h100-sxm:8), got {flag!r}"
            )
        if key not in ROLE_OF_FLAG:
            raise EmulationError(
                f"--device {flag!r}: {role!r} runs no model (roles with a "
                f"device: prefill, relay, main-decode)"
            )
        section = ROLE_OF_FLAG[key]
        out[f"{section}.device"] = chip
        if colon:
            if not (gpus.isascii() and gpus.isdigit()) or int(gpus) < 1:
                raise EmulationError(f"--device {flag!r}: GPUS must be an integer >= 1")
            out[f"{section}.gpus"] = int(gpus)
    return out


def _profile(loader: Any, kind: str, name: str) -> Any:
    try:
        return loader(name)
    except ValueError as exc:
        raise EmulationError(str(exc)) from None
