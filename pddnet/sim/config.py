"""Simulation config: one TOML (or JSON) file, validated with messages that name the field.

seed = 0
model = "deepseek-v3"            # a shipped model profile or a path to a TOML file
tokens_per_unit = 64              # workload granularity (see workload.py)
systems = ["same-dc", "cross-dc", "pdd", "pdd-no-drc"]

[chips]                           # role -> chip profile (name or path)
a = "gpu-a"
b = "gpu-b"

[pdd]                             # the cross-datacenter deployment
prefill = { chip = "a", instances = 4, gpus = 16 }
relay = { chip = "a", instances = 1, gpus = 16 }
main_decode = { chip = "b", instances = 6, gpus = 8 }

[baseline]                        # same-DC homogeneous PD
prefill = { chip = "a", instances = 4, gpus = 16 }
decode = { chip = "a", instances = 6, gpus = 16 }

[line]      bw_gbit, rtt_ms, jitter_ms, queue_mb, piece_mb, piece_ms, price_per_gbit_hour
[engine]    block_tokens, chunk_tokens, max_seqs, p_max_seqs, memory_utilisation, segment_steps,
            rdma_latency_us, p_prefix_cache, host_latency_us, host_latency_per_token_us,
            host_latency_per_step_us
[policy]    direct_budget_s, singular_filter, singular_margin, handoff, handoff_threshold,
            handoff_chunk, rld_load_limit, rld_max_requests
[sla]       ttft_s, tpot_s, attainment
[workload]  kind = "agent" | "trace", requests, rate_scale, path (trace),
            arrivals = "closed" | "baseline" | "open", and any AgentWorkloadParams field with lengths
            in tokens
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from pddnet.device.profiles import ChipProfile, ModelProfile, load_chip, load_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ARRIVALS = ("closed", "baseline", "open")
SYSTEMS = ("same-dc", "cross-dc", "cross-dc-no-drc", "pdd", "pdd-no-drc", "pdd-no-rld")


@dataclass(frozen=True)
class Pool:
    chip: ChipProfile
    instances: int
    gpus: int

    @property
    def num_gpus(self) -> int:
        return self.instances * self.gpus


@dataclass(frozen=True)
class Deployment:
    prefill: Pool
    decode: Pool  # MD (pdd) or D (baseline)
    relay: Pool | None = None

    def pools(self) -> dict[str, Pool]:
        out = {"prefill": self.prefill, "decode": self.decode}
        if self.relay is not None:
            out["relay"] = self.relay
        return out

    def gpus_by_chip(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.pools().values():
            out[p.chip.name] = out.get(p.chip.name, 0) + p.num_gpus
        return dict(sorted(out.items()))

    def describe(self) -> dict[str, Any]:
        return {
            k: {"chip": p.chip.name, "instances": p.instances, "gpus": p.gpus}
            for k, p in self.pools().items()
        }


@dataclass(frozen=True)
class Line:
    bw_gbit: float = 100.0
    rtt_ms: float = 30.0
    jitter_ms: float = 0.0
    # the bottleneck queue; unset: room for one KV piece plus the control messages' 1 MB
    # reserve (65 MB at the default piece size, ~20 ms of line time on a line over 26 Gbit/s)
    queue_mb: float | None = None
    piece_mb: float = 64.0
    # A KV piece is also at least this much line time, so a fast line does not cost more link
    # items per byte than a slow one (round-robin fairness stays at the same time resolution).
    piece_ms: float = 20.0
    price_per_gbit_hour: float = 0.5

    def piece_bytes(self) -> int:
        by_time = self.bw_gbit * 1e9 / 8 * self.piece_ms / 1e3
        return max(1, int(max(self.piece_mb * (1 << 20), by_time)))


@dataclass(frozen=True)
class Engine:
    block_tokens: int = 16
    chunk_tokens: int = 8192
    max_seqs: int = 256
    # P's prompts per step: 1 (the default) is one prompt at a time, FIFO; more lets waiting
    # prompts into the token budget a running one leaves (its last chunk), as the daemons'
    # engine does with its max_num_seqs (PrefillInstance)
    p_max_seqs: int = 1
    memory_utilisation: float = 0.9
    segment_steps: int = 32
    rdma_latency_us: float = 20.0
    p_prefix_cache: bool = True
    # The host path of a request before P can start on it (the client's JSON, the router's
    # parse, the daemons' event loops and message checks, the engine's admission): the request
    # reaches the routers, P's queue and MD's KV_ALLOC this long after it was sent, a fixed part
    # plus a part per prompt token. 0 by default: at datacenter scale it is noise; `pdd bench
    # reproduce` measures its testbed's (pddnet/sim/host_latency.py) so that the comparison
    # with the live daemons isolates network, queueing and protocol.
    host_latency_us: float = 0.0
    host_latency_per_token_us: float = 0.0
    # The host's time per engine step, beyond the forward's (the engine loop between two
    # forwards: handing the outputs over, queued calls, the thread's wake-up): every prefill,
    # decode and extend step lasts this much longer, while what a policy is told of a step
    # (RLD's time per token) stays the forward's, as the daemons measure it. 0 by default
    # (noise at datacenter scale); `pdd bench reproduce` measures its testbed's.
    host_latency_per_step_us: float = 0.0


@dataclass(frozen=True)
class Policy:
    direct_budget_s: float = 0.2
    singular_filter: bool = True
    singular_margin: float = 1.0
    handoff: str = "dynamic"
    handoff_threshold: int = 64
    handoff_chunk: int = 16
    rld_load_limit: float = 0.8
    rld_max_requests: int = 64


@dataclass(frozen=True)
class Sla:
    ttft_s: float = 5.0
    tpot_s: float = 0.1
    attainment: float = 0.9  # share of requests meeting both, for capacity searches


@dataclass(frozen=True)
class WorkloadSpec:
    kind: str = "agent"
    requests: int = 10000
    rate_scale: float = 1.0  # multiplies the conversation (agent) or replay (trace) rate
    path: str | None = None
    # "closed": a conversation's next turn waits for the previous one to finish (an agent needs
    # the answer), so a faster system is offered more requests per second. "baseline": the
    # baseline runs closed loop and every other system is offered the baseline's send times
    # (equal offered load; causality still holds). "open": every request at its own time,
    # whatever the system does (trace replay; a turn may overlap its predecessor, counted).
    arrivals: str = "closed"
    agent: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SimConfig:
    model: ModelProfile
    pdd: Deployment
    baseline: Deployment
    seed: int = 0
    tokens_per_unit: int = 1
    systems: tuple[str, ...] = ("same-dc", "cross-dc", "pdd", "pdd-no-drc")
    line: Line = Line()
    engine: Engine = Engine()
    policy: Policy = Policy()
    sla: Sla = Sla()
    workload: WorkloadSpec = WorkloadSpec()
    source: dict[str, Any] = field(default_factory=dict, compare=False)

    def with_rate(self, scale: float) -> SimConfig:
        return replace(self, workload=replace(self.workload, rate_scale=scale))


def _section(cls: type, data: dict[str, Any] | None, where: str) -> Any:
    data = dict(data or {})
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(
            f"[{where}]: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})"
        )
    defaults = cls()
    for k, v in data.items():
        want = type(getattr(defaults, k))
        if want is type(None):
            want = float  # an optional number (e.g. queue_mb), unset by default
        if want is bool and not isinstance(v, bool):
            raise ValueError(f"[{where}] {k}: expected true/false, got {v!r}")
        if want in (int, float) and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise ValueError(f"[{where}] {k}: expected a number, got {v!r}")
        if want is int and not isinstance(v, int):
            raise ValueError(f"[{where}] {k}: expected an integer, got {v!r}")
        if want in (int, float) and v < 0:
            raise ValueError(f"[{where}] {k}: must be >= 0, got {v!r}")
    return replace(defaults, **data)


def _pool(data: Any, chips: dict[str, ChipProfile], where: str) -> Pool:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected a table {{chip, instances, gpus}}, got {data!r}")
    unknown = sorted(set(data) - {"chip", "instances", "gpus"})
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)}")
    chip = data.get("chip")
    if not isinstance(chip, str):
        raise ValueError(
            f"{where}.chip: expected a role of [chips] or a profile name, got {chip!r}"
        )
    if chip not in chips:
        try:
            prof = load_chip(chip)
        except ValueError as exc:
            raise ValueError(
                f"{where}: chip {chip!r} is neither a role in [chips] "
                f"({', '.join(chips)}) nor a profile: {exc}"
            ) from None
        chips[chip] = prof
    n, g = data.get("instances", 1), data.get("gpus", 1)
    for k, v in (("instances", n), ("gpus", g)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{where}.{k}: must be an integer >= 1, got {v!r}")
    return Pool(chips[chip], n, g)


def parse_config(data: dict[str, Any], base_dir: Path | None = None) -> SimConfig:
    data = dict(data)
    top = {
        "seed",
        "model",
        "tokens_per_unit",
        "systems",
        "chips",
        "pdd",
        "baseline",
        "line",
        "engine",
        "policy",
        "sla",
        "workload",
    }
    unknown = sorted(set(data) - top)
    if unknown:
        raise ValueError(
            f"unknown top-level key(s) {', '.join(unknown)} (known: {', '.join(sorted(top))})"
        )

    def resolve(ref: str) -> str:
        p = Path(ref)
        if base_dir is not None and p.suffix == ".toml" and not p.is_absolute():
            p2 = base_dir / p
            if p2.exists():
                return str(p2)
        return ref

    chips = {role: load_chip(resolve(ref)) for role, ref in dict(data.get("chips", {})).items()}
    model = load_model(resolve(data.get("model", "small")))
    systems = tuple(data.get("systems", SimConfig.__dataclass_fields__["systems"].default))
    for s in systems:
        if s not in SYSTEMS:
            raise ValueError(f"unknown system {s!r}; known: {', '.join(SYSTEMS)}")
    if not systems:
        raise ValueError("systems: give at least one system to simulate")

    def deployment(name: str, decode_key: str) -> Deployment:
        d = data.get(name)
        if not isinstance(d, dict):
            raise ValueError(
                f"[{name}] is required: prefill, {decode_key}"
                + (", relay" if name == "pdd" else "")
            )
        allowed = {"prefill", decode_key} | ({"relay"} if name == "pdd" else set())
        unknown = sorted(set(d) - allowed)
        if unknown:
            raise ValueError(
                f"[{name}]: unknown pool(s) {', '.join(unknown)} "
                f"(known: {', '.join(sorted(allowed))})"
            )
        for k in ("prefill", decode_key):
            if k not in d:
                raise ValueError(f"[{name}]: missing pool {k!r}")
        relay = _pool(d["relay"], chips, f"[{name}].relay") if "relay" in d else None
        return Deployment(
            _pool(d["prefill"], chips, f"[{name}].prefill"),
            _pool(d[decode_key], chips, f"[{name}].{decode_key}"),
            relay,
        )

    wl = dict(data.get("workload", {}))
    spec_keys = {"kind", "requests", "rate_scale", "path", "arrivals"}
    spec = _section(
        WorkloadSpec, {k: v for k, v in wl.items() if k in spec_keys and k != "path"}, "workload"
    )
    path = wl.get("path")
    if path is not None and base_dir is not None and not Path(path).is_absolute():
        path = str(base_dir / path)
    spec = replace(spec, path=path, agent={k: v for k, v in wl.items() if k not in spec_keys})
    if spec.kind not in ("agent", "trace"):
        raise ValueError(f"[workload] kind must be 'agent' or 'trace', got {spec.kind!r}")
    if spec.arrivals not in ARRIVALS:
        raise ValueError(
            f"[workload] arrivals must be one of {', '.join(ARRIVALS)}, got {spec.arrivals!r}"
        )
    if spec.kind == "trace" and not spec.path:
        raise ValueError("[workload] kind = 'trace' needs path = 'FILE.jsonl'")
    if spec.requests < 1 or spec.rate_scale <= 0:
        raise ValueError("[workload] requests must be >= 1 and rate_scale > 0")
    q = data.get("tokens_per_unit", 1)
    if isinstance(q, bool) or not isinstance(q, int) or q < 1:
        raise ValueError(f"tokens_per_unit must be an integer >= 1, got {q!r}")
    seed = data.get("seed", 0)
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")
    cfg = SimConfig(
        model=model,
        pdd=deployment("pdd", "main_decode"),
        baseline=deployment("baseline", "decode"),
        seed=seed,
        tokens_per_unit=q,
        systems=systems,
        line=_section(Line, data.get("line"), "line"),
        engine=_section(Engine, data.get("engine"), "engine"),
        policy=_section(Policy, data.get("policy"), "policy"),
        sla=_section(Sla, data.get("sla"), "sla"),
        workload=spec,
        source=data,
    )
    if cfg.line.bw_gbit <= 0:
        raise ValueError("[line] bw_gbit must be > 0")
    if (
        (cfg.line.queue_mb is not None and cfg.line.queue_mb * (1 << 20) < 1500)
        or cfg.line.piece_mb <= 0
        or cfg.line.rtt_ms < 0
    ):
        raise ValueError(
            "[line] queue_mb must hold at least one 1500-byte packet, piece_mb "
            "must be > 0 and rtt_ms >= 0"
        )
    e = cfg.engine
    if min(e.block_tokens, e.chunk_tokens, e.max_seqs, e.p_max_seqs) < 1:
        raise ValueError(
            "[engine] block_tokens, chunk_tokens, max_seqs and p_max_seqs must be >= 1"
        )
    if q > 1 and q % cfg.engine.block_tokens and cfg.engine.block_tokens % q:
        raise ValueError(
            f"tokens_per_unit {q} and [engine] block_tokens "
            f"{cfg.engine.block_tokens} must divide one another"
        )
    return cfg


def load_config(path: str | Path) -> SimConfig:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"{path}: cannot parse: {exc}") from None
    return parse_config(data, path.parent)
