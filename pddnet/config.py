"""Cluster configuration: one TOML file describes a whole cluster; flags override it.

Every address a daemon listens on or dials comes from here (no loopback assumptions in the
daemons), so the same file serves `pdd up` on one box and `pdd serve ROLE` on separate hosts.

Each daemon has a `host`/`port` it listens on and a `dial` address ("HOST:PORT") by which its
peers reach it. They differ when something sits in between: on one box with the proxy shell, MD
listens on 127.0.0.1:7300 but datacenter A dials the WAN proxy in front of it.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pddnet.device.emulated import Emulation, EmulationError
from pddnet.policy.estimators import FULL_WEIGHT_BYTES
from pddnet.policy.handoff import HandoffMode

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]


class ClusterMode(str, enum.Enum):
    PDD = "pdd"  # P + RLD in A, MD in B: the system under study
    CROSS_DC = "cross-dc"  # P in A, decode in B, KV over the WAN only: the naive design
    SAME_DC = "same-dc"  # P and one decode instance in A over shared memory: the ideal

    @property
    def model_roles(self) -> tuple[str, ...]:
        """The roles that run a model in this mode (same-dc's decode instance is `relay`)."""
        return _MODEL_ROLES[self]


_MODEL_ROLES = {
    ClusterMode.PDD: ("prefill", "relay", "main_decode"),
    ClusterMode.SAME_DC: ("prefill", "relay"),
    ClusterMode.CROSS_DC: ("prefill", "main_decode"),
}


PIPELINE_CHOICES = ("auto", "p_rld_md", "p_md", "p_rld")
INTRA_DC_TRANSPORTS = ("shm", "mooncake")  # P -> RLD
WAN_TRANSPORTS = ("tcp", "mooncake")  # P -> MD
MOONCAKE_PROTOCOLS = ("tcp", "rdma")
PREFIX_CACHE_KINDS = ("hash", "radix", "off")


class ConfigError(ValueError):
    """A configuration value is missing, of the wrong type or out of range."""


@dataclass
class ModelSection:
    name: str = "tiny"  # preset name or a folder in the Hugging Face Llama layout
    seed: int = 0
    dtype: str | None = None  # None: the preset's own dtype
    threads: int = 1  # torch threads per daemon (the machine is shared)


@dataclass
class DaemonSection:
    host: str = "127.0.0.1"
    port: int = 0
    dial: str | None = None  # "HOST:PORT" peers use; default host:port
    num_blocks: int = 1024
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    prefix_cache: str = "hash"  # hash | radix | off (MD's decode-side cache is the radix tree)
    metrics_port: int | None = None  # Prometheus /metrics on host:port (0: any); None: off
    # The modelled accelerator this daemon's forwards are paced to (pddnet.device): a chip
    # profile name or TOML path, and the chips per instance; "" = unpaced (the CPU's own time).
    device: str = ""
    gpus: int = 1

    def dial_address(self) -> tuple[str, int]:
        if self.dial:
            return parse_address(self.dial)
        return self.host, self.port


@dataclass
class RouterSection:
    host: str = "127.0.0.1"
    port: int = 8000
    max_concurrent_requests: int = 256
    max_tokens_limit: int = 4096
    max_body_bytes: int = 1 << 20
    request_timeout_s: float = 300.0
    stall_timeout_s: float = 30.0  # no event for a request this long: replay it (once)


@dataclass
class WanSection:
    shell: str = "auto"  # auto | kernel | packet | proxy
    rtt_ms: float = 30.0
    jitter_ms: float = 0.0
    bw_mbit: float | None = 1000.0
    # the bottleneck's queue in ms of the line's rate (a router's buffer; dilated like every
    # delay, so in bytes it holds the same share of the target's traffic at any k); unset:
    # the emulator's default, 1 MiB of real bytes whatever the rate
    queue_ms: float | None = None
    loss_pct: float = 0.0
    stripes: int = 4  # parallel TCP streams for KV chunks
    chunk_tokens: int = 64  # KV tokens per KV_CHUNK frame
    control: str = "127.0.0.1:0"  # the emulator's control API
    heartbeat_s: float = 1.0  # PING period on every control / events lane (P's RTT samples)
    heartbeat_deadline_s: float = 3.0  # nothing from the peer this long: lost (hung, cut off)


@dataclass
class PolicySection:
    handoff: str = "dynamic"  # one-shot | streaming | dynamic
    handoff_threshold_tokens: int = 64
    handoff_chunk: int = 16
    rld_load_limit: float = 0.8
    # Pipeline choice in pdd mode: auto (per request, pddnet.policy.pipeline) or one forced.
    pipeline: str = "auto"  # auto | p_rld_md | p_md | p_rld
    direct_budget_s: float = 0.2  # P->MD when the incremental KV crosses faster than this
    singular_filter: bool = True
    singular_margin: float = 1.0
    rld_step_s: float = 0.02  # RLD's seconds per output token until RLD reports its own
    wan_bw_mbit: float | None = None  # initial bandwidth estimate (None: wan.bw_mbit or 1000)
    # A goodput sample's weight grows with its transfer's bytes up to this (smaller transfers
    # are dominated by the RTT), in the modelled model's KV bytes: emulated clusters scale it
    # onto the real model's bytes like every KV rate (pddnet.device.dilation.wallclock)
    goodput_full_weight_bytes: int = FULL_WEIGHT_BYTES
    # RLD admission (pddnet.policy.admission): RLD is a small pool and must never be flooded.
    rld_max_requests: int = 16
    rld_max_running_tokens: int = 0  # 0: the relay pool's capacity (num_blocks * block_size)


@dataclass
class TransportSection:
    """Which KV backend each path uses (pddnet.transport.backends) and how they are bounded."""

    intra_dc: str = "shm"  # P -> RLD: shm (one machine) | mooncake
    wan: str = "tcp"  # P -> MD: tcp (striped KV_CHUNK streams) | mooncake
    deadline_s: float = 10.0  # pddnet's bound on one KV write (a hung receiver)
    abort_grace_s: float | None = None  # wait for in-flight writes on abort (None: per backend)
    mooncake_protocol: str = "tcp"  # tcp | rdma (needs RDMA NICs)
    mooncake_device: str = ""  # rdma: NIC names, e.g. "mlx5_0,mlx5_1"; "": engine's choice
    progress_timeout_s: int = 2  # the engine's no-progress bound (whole seconds)
    mooncake_staging_mib: int = 64  # sender's registered staging buffer per destination
    mooncake_port_min: int = 0  # with _max: the ports the engine binds (0: any)
    mooncake_port_max: int = 0

    def backend_of(self, path: str) -> str:
        """The backend of a path: "intra_dc" or "wan"."""
        if path not in ("intra_dc", "wan"):
            raise ValueError(f"unknown KV path {path!r}: intra_dc or wan")
        return self.intra_dc if path == "intra_dc" else self.wan

    def validate(self) -> None:
        if self.intra_dc not in INTRA_DC_TRANSPORTS:
            raise ConfigError(
                f"transport.intra_dc must be {'|'.join(INTRA_DC_TRANSPORTS)}, got "
                f"{self.intra_dc!r}"
                + (" (tcp is the WAN's backend)" if self.intra_dc == "tcp" else "")
            )
        if self.wan not in WAN_TRANSPORTS:
            raise ConfigError(
                f"transport.wan must be {'|'.join(WAN_TRANSPORTS)}, got "
                f"{self.wan!r}" + (" (shm cannot cross datacenters)" if self.wan == "shm" else "")
            )
        if self.deadline_s <= 0:
            raise ConfigError(f"transport.deadline_s must be > 0, got {self.deadline_s}")
        if self.abort_grace_s is not None and self.abort_grace_s < 0:
            raise ConfigError(f"transport.abort_grace_s must be >= 0, got {self.abort_grace_s}")
        if self.mooncake_protocol not in MOONCAKE_PROTOCOLS:
            raise ConfigError(
                f"transport.mooncake_protocol must be tcp|rdma, got {self.mooncake_protocol!r}"
            )
        if any(c.isspace() for c in self.mooncake_device):
            raise ConfigError(
                f"transport.mooncake_device must be NIC names separated by commas "
                f"(no spaces), got {self.mooncake_device!r}"
            )
        if self.progress_timeout_s < 1:
            raise ConfigError(
                f"transport.progress_timeout_s must be >= 1 (whole seconds), got "
                f"{self.progress_timeout_s}"
            )
        if not 1 <= self.mooncake_staging_mib <= 16384:
            raise ConfigError(
                f"transport.mooncake_staging_mib must be in 1..16384, got "
                f"{self.mooncake_staging_mib}"
            )
        lo, hi = self.mooncake_port_min, self.mooncake_port_max
        if (lo or hi) and not 0 < lo <= hi <= 65535:
            raise ConfigError(
                f"transport.mooncake_port_min..mooncake_port_max must be a port "
                f"range (1 <= min <= max <= 65535, or both 0 for any), got "
                f"{lo}..{hi}"
            )


@dataclass
class ClusterConfig:
    name: str = "pdd"
    mode: ClusterMode = ClusterMode.PDD
    secret: str = ""  # shared secret for peer authentication ("" = generated by pdd up)
    run_dir: str = "runs/pdd"
    # Emulated accelerators (docs/emulated-devices.md): the model whose speed and KV volume the
    # daemons emulate (a profile of pddnet/device/profiles/models, "" = off) and the time
    # dilation k (modelled compute and link delays x k, rates / k; reported times / k).
    target_model: str = ""
    dilation: float = 1.0
    model: ModelSection = field(default_factory=ModelSection)
    router: RouterSection = field(default_factory=RouterSection)
    prefill: DaemonSection = field(default_factory=lambda: DaemonSection(port=7100))
    relay: DaemonSection = field(default_factory=lambda: DaemonSection(port=7200, num_blocks=512))
    main_decode: DaemonSection = field(
        default_factory=lambda: DaemonSection(port=7300, prefix_cache="radix")
    )
    wan: WanSection = field(default_factory=WanSection)
    policy: PolicySection = field(default_factory=PolicySection)
    transport: TransportSection = field(default_factory=TransportSection)

    def validate(self) -> ClusterConfig:
        self.mode = _enum(ClusterMode, self.mode, "mode")
        HandoffMode.parse(self.policy.handoff)
        pol = self.policy
        if pol.pipeline not in PIPELINE_CHOICES:
            raise ConfigError(
                f"policy.pipeline must be one of {'|'.join(PIPELINE_CHOICES)}, got {pol.pipeline!r}"
            )
        if pol.direct_budget_s < 0 or pol.singular_margin <= 0 or pol.rld_step_s <= 0:
            raise ConfigError(
                "policy.direct_budget_s must be >= 0, policy.singular_margin and "
                "policy.rld_step_s > 0"
            )
        if pol.wan_bw_mbit is not None and pol.wan_bw_mbit <= 0:
            raise ConfigError(f"policy.wan_bw_mbit must be > 0, got {pol.wan_bw_mbit}")
        if pol.goodput_full_weight_bytes < 1:
            raise ConfigError(
                "policy.goodput_full_weight_bytes must be >= 1, "
                f"got {pol.goodput_full_weight_bytes}"
            )
        if pol.rld_max_requests < 1 or pol.rld_max_running_tokens < 0:
            raise ConfigError(
                "policy.rld_max_requests must be >= 1 and policy.rld_max_running_tokens >= 0"
            )
        if not 0 < self.wan.heartbeat_s < self.wan.heartbeat_deadline_s:
            raise ConfigError(
                f"need 0 < wan.heartbeat_s < wan.heartbeat_deadline_s, got "
                f"{self.wan.heartbeat_s}, {self.wan.heartbeat_deadline_s}"
            )
        if self.wan.shell not in ("auto", "kernel", "packet", "proxy"):
            raise ConfigError(f"wan.shell must be auto|kernel|packet|proxy, got {self.wan.shell!r}")
        for name in ("prefill", "relay", "main_decode"):
            sec: DaemonSection = getattr(self, name)
            _check_port(f"{name}.port", sec.port)
            for attr in ("num_blocks", "block_size", "max_num_batched_tokens", "max_num_seqs"):
                if getattr(sec, attr) < 1:
                    raise ConfigError(f"{name}.{attr} must be >= 1, got {getattr(sec, attr)}")
            if sec.dial:
                parse_address(sec.dial)
            if sec.metrics_port is not None:
                _check_port(f"{name}.metrics_port", sec.metrics_port)
            if sec.gpus < 1:
                raise ConfigError(f"{name}.gpus must be >= 1, got {sec.gpus}")
            if sec.prefix_cache not in PREFIX_CACHE_KINDS:
                raise ConfigError(
                    f"{name}.prefix_cache must be one of "
                    f"{'|'.join(PREFIX_CACHE_KINDS)}, got {sec.prefix_cache!r}"
                )
        _check_port("router.port", self.router.port)
        if self.router.stall_timeout_s <= 0:
            raise ConfigError(
                f"router.stall_timeout_s must be > 0, got {self.router.stall_timeout_s}"
            )
        self.transport.validate()
        self.emulation()
        if self.model.threads < 1:
            raise ConfigError(f"model.threads must be >= 1, got {self.model.threads}")
        if self.wan.stripes < 1:
            raise ConfigError(f"wan.stripes must be >= 1, got {self.wan.stripes}")
        if self.wan.chunk_tokens < 1:
            raise ConfigError(f"wan.chunk_tokens must be >= 1, got {self.wan.chunk_tokens}")
        if self.wan.rtt_ms < 0 or self.wan.jitter_ms < 0:
            raise ConfigError("wan.rtt_ms and wan.jitter_ms must be >= 0")
        if self.wan.queue_ms is not None and not self.wan.queue_ms > 0:
            raise ConfigError(f"wan.queue_ms must be > 0 (or unset), got {self.wan.queue_ms}")
        if self.wan.bw_mbit is not None and self.wan.bw_mbit <= 0:
            raise ConfigError(
                f"wan.bw_mbit must be > 0 (or absent for unlimited), got {self.wan.bw_mbit}"
            )
        return self

    def emulation(self) -> Emulation | None:
        """The emulated devices (None: unpaced); raises ConfigError on a bad device setting."""
        try:
            return Emulation.from_config(self)
        except EmulationError as exc:
            raise ConfigError(str(exc)) from None

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["mode"] = self.mode.value
        return _drop_none(out)

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())


def load_config(
    path: str | Path | None = None, overrides: dict[str, Any] | None = None
) -> ClusterConfig:
    """Read a TOML file (or start from defaults), apply dotted overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = data
        *parents, leaf = dotted.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> ClusterConfig:
    return _build(ClusterConfig(), data, "").validate()


def parse_address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise ConfigError(f"address {text!r} is not HOST:PORT")
    try:
        number = int(port)
    except ValueError:
        raise ConfigError(f"address {text!r} has a non-numeric port") from None
    _check_port(f"port of {text!r}", number)
    return host.strip("[]"), number


def _build(defaults: Any, data: dict[str, Any], prefix: str) -> Any:
    """`defaults` with the keys of `data` replaced (tables recursively), each value checked.

    Starting from the default *instance* keeps per-section defaults (relay's smaller pool, each
    daemon's port) for keys a partial table leaves out.
    """
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a table")
    fields = {f.name for f in dataclasses.fields(defaults)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise ConfigError(
            f"unknown key(s) in {prefix.rstrip('.') or 'config'}: {', '.join(unknown)}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        default = getattr(defaults, name)
        if dataclasses.is_dataclass(default):
            kwargs[name] = _build(default, value, f"{prefix}{name}.")
        else:
            kwargs[name] = _coerce(value, default, f"{prefix}{name}")
    return dataclasses.replace(defaults, **kwargs)


def _coerce(value: Any, default: Any, where: str) -> Any:
    if isinstance(default, enum.Enum):
        return _enum(type(default), value, where)
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false, got {value!r}")
        return value
    if isinstance(default, int) and not isinstance(default, bool):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return value
    if default is None and isinstance(value, int) and not isinstance(value, bool):
        return value  # an optional int stays one (a port); optional floats accept ints too
    if isinstance(default, float) or (default is None and isinstance(value, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        return float(value)
    if isinstance(default, str) or default is None:
        if not isinstance(value, str):
            raise ConfigError(f"{where} must be a string, got {value!r}")
        return value
    return value


def _enum(cls: type[enum.Enum], value: Any, where: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        choices = "|".join(m.value for m in cls)
        raise ConfigError(f"{where} must be {choices}, got {value!r}") from None


def _check_port(where: str, port: int) -> None:
    if not 0 <= port <= 65535:
        raise ConfigError(f"{where} must be in 0..65535, got {port}")


def _drop_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: _drop_none(v) if isinstance(v, dict) else v for k, v in d.items() if v is not None}


def dump_toml(data: dict[str, Any]) -> str:
    """Minimal TOML writer for this config's shape (scalars and one level of tables)."""
    scalars = [f"{k} = {_toml_value(v)}" for k, v in data.items() if not isinstance(v, dict)]
    lines = scalars[:]
    for k, v in data.items():
        if isinstance(v, dict):
            lines.append("")
            lines.append(f"[{k}]")
            lines.extend(f"{kk} = {_toml_value(vv)}" for kk, vv in v.items())
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, enum.Enum):
        v = v.value
    escaped = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{escaped}"'
