"""Chip and model profiles: TOML data files under ``profiles/`` (or any path a user gives).

A chip is the source report's four dimensions plus cost: peak dense compute per dtype, memory
capacity, memory bandwidth, scale-up and scale-out interconnect bandwidth, price per hour, and
the achievable fractions of peak (the roofline's efficiency factors), plus two optional host-side
terms a CPU engine needs and a GPU does not (``step_per_seq_us``, ``step_per_ctx_token_ns``: see
pddnet/device/cost.py; 0 by default), and ``step_jitter_cv``, a seeded random spread of decode-step
times for a chip shared with other work (0 by default: GPU profiles are deterministic rooflines).
A model is its shape: what
the cost model needs to count FLOPs per token, bytes read per decode step and KV bytes per token.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

PROFILE_DIR = Path(__file__).with_name("profiles")
DTYPES = ("bf16", "fp8", "fp32")


@dataclass(frozen=True)
class ChipProfile:
    name: str
    tflops: dict[str, float]  # dense peak per dtype (TFLOP/s)
    memory_gb: float  # HBM capacity (1 GB = 1e9 bytes)
    memory_bw_gbs: float  # HBM bandwidth (GB/s)
    scale_up_gbs: float  # per-GPU NVLink-class bandwidth inside an instance, both
    #                                 directions added, as datasheets give it (GB/s)
    scale_out_gbit: float  # per-GPU NIC for RDMA between instances (Gbit/s)
    price_per_hour: float  # USD per GPU-hour (an assumption in every shipped profile)
    compute_efficiency: float = 0.55
    bandwidth_efficiency: float = 0.75
    step_overhead_ms: float = 1.5
    step_per_seq_us: float = 0.0  # serial work per sequence in a forward (CPU engines)
    step_per_ctx_token_ns: float = 0.0  # serial work per context token attended (KV gather)
    step_jitter_cv: float = 0.0  # decode-step spread (coefficient of variation, mean 1)

    def __post_init__(self) -> None:
        for f in ("memory_gb", "memory_bw_gbs", "scale_up_gbs", "scale_out_gbit"):
            _positive(self.name, f, getattr(self, f))
        if self.price_per_hour < 0:
            raise ValueError(f"chip {self.name!r}: price_per_hour must be >= 0")
        for f in ("compute_efficiency", "bandwidth_efficiency"):
            if not 0 < getattr(self, f) <= 1:
                raise ValueError(
                    f"chip {self.name!r}: {f} must be in (0, 1], got {getattr(self, f)!r}"
                )
        for f in ("step_overhead_ms", "step_per_seq_us", "step_per_ctx_token_ns", "step_jitter_cv"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                raise ValueError(f"chip {self.name!r}: {f} must be a finite number >= 0, got {v!r}")
        if not self.tflops:
            raise ValueError(f"chip {self.name!r}: [tflops] needs at least one dtype")
        for k, v in self.tflops.items():
            if k not in DTYPES:
                raise ValueError(
                    f"chip {self.name!r}: unknown dtype {k!r} in [tflops] "
                    f"(known: {', '.join(DTYPES)})"
                )
            _positive(self.name, f"tflops.{k}", v)

    def flops_per_s(self, dtype: str) -> float:
        if dtype not in self.tflops:
            raise ValueError(
                f"chip {self.name!r} has no {dtype} rate in [tflops] "
                f"(has: {', '.join(sorted(self.tflops))})"
            )
        return self.tflops[dtype] * 1e12


@dataclass(frozen=True)
class ModelProfile:
    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    total_params: float
    active_params: float
    compute_dtype: str = "bf16"
    weight_bytes_per_param: float = 2
    kv_bytes_per_elem: float = 2
    kv_latent_dim: int = 0  # MLA: values cached per layer and token (0: GQA K and V)
    expert_params: float = 0.0  # MoE: parameters in routed experts (part of total)
    num_experts: int = 0
    experts_per_token: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for f in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "total_params",
            "active_params",
            "weight_bytes_per_param",
            "kv_bytes_per_elem",
        ):
            _positive(self.name, f, getattr(self, f))
        if self.active_params > self.total_params:
            raise ValueError(f"model {self.name!r}: active_params > total_params")
        if self.compute_dtype not in DTYPES:
            raise ValueError(
                f"model {self.name!r}: compute_dtype must be one of "
                f"{', '.join(DTYPES)}, got {self.compute_dtype!r}"
            )
        if self.expert_params:
            if not 0 < self.experts_per_token <= self.num_experts:
                raise ValueError(
                    f"model {self.name!r}: an MoE needs 0 < experts_per_token <= num_experts"
                )
            if self.expert_params >= self.total_params:
                raise ValueError(f"model {self.name!r}: expert_params must be < total_params")

    @property
    def kv_bytes_per_token(self) -> int:
        per_layer = self.kv_latent_dim or 2 * self.num_kv_heads * self.head_dim
        return int(self.num_layers * per_layer * self.kv_bytes_per_elem)

    @property
    def weight_bytes(self) -> float:
        return self.total_params * self.weight_bytes_per_param


def _positive(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{owner!r}: {name} must be a number > 0, got {value!r}")


def _read(kind: str, ref: str | Path) -> tuple[dict[str, Any], Path]:
    path = Path(ref)
    if not (path.suffix == ".toml" and path.exists()):
        path = PROFILE_DIR / kind / f"{ref}.toml"
    if not path.exists():
        known = ", ".join(list_profiles(kind))
        raise ValueError(
            f"unknown {kind[:-1]} profile {str(ref)!r}: not a .toml file and not "
            f"one of the shipped ones ({known})"
        )
    try:
        return tomllib.loads(path.read_text()), path
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"{path}: bad TOML: {exc}") from None


def _build(cls: type, data: dict[str, Any], path: Path) -> Any:
    known = {f.name for f in fields(cls)} - {"extra"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(
            f"{path}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    try:
        return cls(**data)
    except TypeError as exc:  # a required field is missing
        raise ValueError(f"{path}: {exc}") from None


def load_chip(ref: str | Path) -> ChipProfile:
    """A shipped chip by name (``gpu-a``, ``h100-sxm``, ...) or a path to a TOML file."""
    data, path = _read("chips", ref)
    data.setdefault("name", path.stem)
    data["tflops"] = {k: float(v) for k, v in dict(data.get("tflops", {})).items()}
    return _build(ChipProfile, data, path)


def load_model(ref: str | Path) -> ModelProfile:
    """A shipped model shape by name (``deepseek-v3``, ``small``, ...) or a TOML path."""
    data, path = _read("models", ref)
    data.setdefault("name", path.stem)
    return _build(ModelProfile, data, path)


def list_profiles(kind: str) -> list[str]:
    """Names of the shipped profiles of a kind (``chips`` or ``models``)."""
    return sorted(p.stem for p in (PROFILE_DIR / kind).glob("*.toml"))
