"""Prometheus `/metrics` for every daemon, built from its `stats()` dict at scrape time.

A daemon keeps plain counters (its `stats()` dict, also written to the stats file); nothing in
the request path touches prometheus-client. At each scrape `StatsCollector` calls the daemon's
`collect()` and translates the dict, so /metrics can never disagree with `stats()`:

    stats key                                   metric (every sample also has role, instance)
    requests: {"active": n, outcome: n}         pdd_requests_active (gauge),
                                                pdd_requests_total{state=outcome} (counter)
    active_phases: {request_id: phase}          pdd_requests_in_phase{phase} (gauge)
    pipelines: {pipeline: n}                    pdd_requests_by_pipeline_total{pipeline}
    kv_blocks: {total, free, used, block_size}  pdd_kv_blocks{state="used"|"free"},
                                                pdd_kv_blocks_capacity, pdd_kv_block_size_tokens
    lanes: {lane: {bytes_in, bytes_out, chunks}}  pdd_lane_bytes_total{lane, direction},
                                                pdd_lane_chunks_total{lane}
    wan_bytes: {"in"|"out": {kind: n}}          pdd_wan_bytes_total{direction, kind}; without
                                                it, MD's lanes (MD is reached only over the
                                                WAN) are reported as its WAN bytes by lane kind
    handoffs: {mode: n}                         pdd_handoffs_total{mode}
    max_extend_tokens: {mode: n}                pdd_max_extend_tokens{mode} (gauge)
    drc: {lookups, hits, hit_tokens, lookup_tokens, evicted_blocks: counters;
          cached_blocks: gauge; hit_intervals: {label: n}: counter}
                                                pdd_drc_<key>[_total], pdd_drc_requests_by_hit_total{interval}
    queues: {name: depth}                       pdd_queue_depth{queue}
    histograms: {name: LatencyHistogram.to_stats()}  pdd_<name> (histogram)
    counters: {name: n}                         pdd_events_total{event}
    any other number / {key: number}            pdd_stat_<key> (gauge) / pdd_stat_<key>{key}

`LatencyHistogram` is the daemon-side helper for TTFT / inter-token histograms (pure, no
prometheus import needed by its users). `start_metrics_server(host, port, collect)` serves it.
"""

from __future__ import annotations

import bisect
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

log = logging.getLogger("pddnet.obs.metrics")

DEFAULT_BUCKETS_S = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_DRC_COUNTERS = ("lookups", "hits", "hit_tokens", "lookup_tokens", "evicted_blocks")
_HANDLED = {
    "role",
    "instance",
    "instance_id",
    "port",
    "requests",
    "active_phases",
    "pipelines",
    "kv_blocks",
    "lanes",
    "wan_bytes",
    "handoffs",
    "max_extend_tokens",
    "drc",
    "queues",
    "histograms",
    "counters",
    "device",
}
_NAME_RE = re.compile(r"[^a-zA-Z0-9_]")


def _metric_name(key: str) -> str:
    name = _NAME_RE.sub("_", key).strip("_") or "unnamed"
    return name if not name[0].isdigit() else "_" + name


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


class LatencyHistogram:
    """Fixed-bucket histogram of seconds; `to_stats()` is what goes into `stats()['histograms']`."""

    def __init__(self, buckets: Sequence[float] = DEFAULT_BUCKETS_S) -> None:
        edges = list(buckets)
        if not edges or sorted(edges) != edges or len(set(edges)) != len(edges) or edges[0] <= 0:
            raise ValueError(f"histogram buckets must be increasing positive seconds, got {edges}")
        self.buckets = edges
        self.counts = [0] * (len(edges) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, seconds: float) -> None:
        if not _number(seconds) or seconds < 0:
            raise ValueError(f"a latency must be a number >= 0 s, got {seconds!r}")
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def to_stats(self) -> dict[str, Any]:
        cumulative, running = [], 0
        for le, c in zip([*self.buckets, float("inf")], self.counts, strict=True):
            running += c
            cumulative.append([le if le != float("inf") else "+Inf", running])
        return {"buckets": cumulative, "sum": self.sum, "count": self.count}


class StatsCollector:
    """A prometheus-client collector that reads `collect()` (a daemon's stats()) per scrape."""

    def __init__(self, collect: Callable[[], Mapping[str, Any]], role: str | None = None) -> None:
        self._collect = collect
        self._role = role

    def describe(self) -> list[Metric]:
        return []  # unchecked collector: the metric set follows the stats dict

    def collect(self) -> Iterator[Metric]:
        try:
            stats = self._collect()
        except Exception as exc:  # a scrape must not take the daemon's HTTP server down
            log.exception("stats() failed during a /metrics scrape")
            g = GaugeMetricFamily(
                "pdd_scrape_ok", "1 when stats() answered this scrape", labels=["error"]
            )
            g.add_metric([f"{type(exc).__name__}: {exc}"[:200]], 0)
            yield g
            return
        base = {
            "role": str(stats.get("role", self._role or "unknown")),
            "instance": str(stats.get("instance", stats.get("instance_id", ""))),
        }
        ok = GaugeMetricFamily(
            "pdd_scrape_ok", "1 when stats() answered this scrape", labels=list(base)
        )
        ok.add_metric(list(base.values()), 1)
        yield ok
        yield from _translate(stats, base)


def _family(
    kind: type, name: str, doc: str, base: Mapping[str, str], extra: Sequence[str] = ()
) -> Any:
    return kind(name, doc, labels=[*base, *extra])


def _translate(stats: Mapping[str, Any], base: Mapping[str, str]) -> Iterator[Metric]:
    bl = list(base.values())
    reqs = stats.get("requests")
    if isinstance(reqs, Mapping):
        active = _family(GaugeMetricFamily, "pdd_requests_active", "requests in flight here", base)
        total = _family(
            CounterMetricFamily, "pdd_requests", "requests by how they ended here", base, ["state"]
        )
        for k, v in reqs.items():
            if _number(v):
                if k == "active":
                    active.add_metric(bl, v)
                else:
                    total.add_metric([*bl, str(k)], v)
        yield active
        yield total
    phases = stats.get("active_phases")
    if isinstance(phases, Mapping):
        counts = Counter(str(phase) for phase in phases.values())
        yield from _labelled(
            dict(sorted(counts.items())),
            GaugeMetricFamily,
            "pdd_requests_in_phase",
            "live requests by protocol phase (first few)",
            base,
            "phase",
        )
    yield from _labelled(
        stats.get("pipelines"),
        CounterMetricFamily,
        "pdd_requests_by_pipeline",
        "requests by pipeline",
        base,
        "pipeline",
    )
    blocks = stats.get("kv_blocks")
    if isinstance(blocks, Mapping) and blocks:
        g = _family(GaugeMetricFamily, "pdd_kv_blocks", "KV blocks in use / free", base, ["state"])
        for state in ("used", "free"):
            if _number(blocks.get(state)):
                g.add_metric([*bl, state], blocks[state])
        yield g
        for key, name, doc in (
            ("total", "pdd_kv_blocks_capacity", "KV blocks in the pool"),
            ("block_size", "pdd_kv_block_size_tokens", "tokens per block"),
        ):
            if _number(blocks.get(key)):
                f = _family(GaugeMetricFamily, name, doc, base)
                f.add_metric(bl, blocks[key])
                yield f
    lanes = stats.get("lanes")
    if isinstance(lanes, Mapping):
        b = _family(
            CounterMetricFamily,
            "pdd_lane_bytes",
            "bytes on this daemon's connections, by lane kind",
            base,
            ["lane", "direction"],
        )
        chunks = _family(CounterMetricFamily, "pdd_lane_chunks", "KV chunks sent", base, ["lane"])
        for lane, d in lanes.items():
            if not isinstance(d, Mapping):
                continue
            for key, direction in (("bytes_in", "in"), ("bytes_out", "out")):
                if _number(d.get(key)):
                    b.add_metric([*bl, str(lane), direction], d[key])
            if _number(d.get("chunks")):
                chunks.add_metric([*bl, str(lane)], d["chunks"])
        yield b
        yield chunks
    yield from _wan_bytes(stats, base)
    yield from _labelled(
        stats.get("handoffs"), CounterMetricFamily, "pdd_handoffs", "handoffs by mode", base, "mode"
    )
    yield from _labelled(
        stats.get("max_extend_tokens"),
        GaugeMetricFamily,
        "pdd_max_extend_tokens",
        "most tokens one step extended after a handoff, by mode",
        base,
        "mode",
    )
    yield from _drc(stats.get("drc"), base)
    yield from _device(stats.get("device"), base)
    yield from _labelled(
        stats.get("queues"),
        GaugeMetricFamily,
        "pdd_queue_depth",
        "items waiting, by queue",
        base,
        "queue",
    )
    hists = stats.get("histograms")
    if isinstance(hists, Mapping):
        for name, h in hists.items():
            if isinstance(h, Mapping) and "buckets" in h:
                f = _family(
                    HistogramMetricFamily,
                    f"pdd_{_metric_name(str(name))}",
                    f"{name} (seconds)",
                    base,
                )
                f.add_metric(bl, [(str(le), c) for le, c in h["buckets"]], sum_value=h["sum"])
                yield f
    yield from _labelled(
        stats.get("counters"),
        CounterMetricFamily,
        "pdd_events",
        "daemon counters by event",
        base,
        "event",
    )
    for key, v in stats.items():
        if key in _HANDLED:
            continue
        name = f"pdd_stat_{_metric_name(str(key))}"
        if _number(v):
            g = _family(GaugeMetricFamily, name, f"stats()['{key}']", base)
            g.add_metric(bl, v)
            yield g
        elif isinstance(v, Mapping) and v and all(_number(x) for x in v.values()):
            yield from _labelled(v, GaugeMetricFamily, name, f"stats()['{key}']", base, "key")


def _labelled(
    d: Any, kind: type, name: str, doc: str, base: Mapping[str, str], label: str
) -> Iterator[Metric]:
    if not isinstance(d, Mapping):
        return
    f = _family(kind, name, doc, base, [label])
    for k, v in d.items():
        if _number(v):
            f.add_metric([*base.values(), str(k)], v)
    yield f


def _wan_bytes(stats: Mapping[str, Any], base: Mapping[str, str]) -> Iterator[Metric]:
    wan = stats.get("wan_bytes")
    if not isinstance(wan, Mapping):
        lanes = stats.get("lanes")
        if base["role"] != "main_decode" or not isinstance(lanes, Mapping):
            return
        wan = {
            "in": {k: d.get("bytes_in", 0) for k, d in lanes.items() if isinstance(d, Mapping)},
            "out": {k: d.get("bytes_out", 0) for k, d in lanes.items() if isinstance(d, Mapping)},
        }
    f = _family(
        CounterMetricFamily,
        "pdd_wan_bytes",
        "bytes over the WAN by direction and kind",
        base,
        ["direction", "kind"],
    )
    for direction, kinds in wan.items():
        if isinstance(kinds, Mapping):
            for kind, n in kinds.items():
                if _number(n):
                    f.add_metric([*base.values(), str(direction), str(kind)], n)
    yield f


def _drc(drc: Any, base: Mapping[str, str]) -> Iterator[Metric]:
    if not isinstance(drc, Mapping):
        return
    bl = list(base.values())
    for key, v in drc.items():
        if key == "hit_intervals":
            yield from _labelled(
                v,
                CounterMetricFamily,
                "pdd_drc_requests_by_hit",
                "DRC lookups by prefix-hit interval",
                base,
                "interval",
            )
        elif _number(v):
            counter = key in _DRC_COUNTERS
            f = _family(
                CounterMetricFamily if counter else GaugeMetricFamily,
                f"pdd_drc_{_metric_name(str(key))}",
                f"decode-side RadixCache {key}",
                base,
            )
            f.add_metric(bl, v)
            yield f


# An emulated device's counters (pddnet.device.pacer): name, kind, help
_DEVICE_METRICS = (
    ("steps", CounterMetricFamily, "forwards paced to the modelled device"),
    (
        "overruns",
        CounterMetricFamily,
        "forwards whose real compute outlasted the modelled time x k (the box could not keep up)",
    ),
    (
        "overrun_lost_s",
        CounterMetricFamily,
        "wall seconds by which overrun forwards exceeded their paced time",
    ),
    ("modelled_busy_s", CounterMetricFamily, "modelled device seconds of every forward"),
    ("overrun_share", GaugeMetricFamily, "share of forwards that overran (valid: <= 1%)"),
    ("dilation", GaugeMetricFamily, "time dilation k this daemon runs at"),
    (
        "dilation_needed",
        GaugeMetricFamily,
        "smallest k at which <= 1% of recent forwards would overrun",
    ),
)


def _device(dev: Any, base: Mapping[str, str]) -> Iterator[Metric]:
    if not isinstance(dev, Mapping) or not dev.get("emulated"):
        return
    labels = [*base.values(), str(dev.get("chip")), str(dev.get("target_model"))]
    for key, kind, doc in _DEVICE_METRICS:
        if _number(dev.get(key)):
            f = _family(kind, f"pdd_device_{key}", doc, base, ["chip", "target_model"])
            f.add_metric(labels, dev[key])
            yield f


def registry_for(
    collect: Callable[[], Mapping[str, Any]], role: str | None = None
) -> CollectorRegistry:
    """A registry of its own holding one StatsCollector (no process-global default metrics)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(collect, role))  # type: ignore[arg-type]
    return registry


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The exposition text and its content type."""
    return generate_latest(registry), CONTENT_TYPE_LATEST


class MetricsServer:
    """`GET /metrics` on host:port (0 = any free port; `.port` tells which)."""

    def __init__(
        self,
        host: str,
        port: int,
        collect: Callable[[], Mapping[str, Any]],
        role: str | None = None,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535, got {port}")
        self.host, self.requested_port = host, port
        self.registry = registry_for(collect, role)
        self.port: int | None = None
        self._runner: Any = None

    async def start(self) -> int:
        from aiohttp import web

        async def metrics(request: web.Request) -> web.Response:
            body, content_type = render(self.registry)
            return web.Response(body=body, headers={"Content-Type": content_type})

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.requested_port)
        await site.start()
        server = site._server  # aiohttp exposes the bound port only here
        self.port = server.sockets[0].getsockname()[1] if server else self.requested_port
        return self.port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/metrics"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> MetricsServer:
        if self._runner is None:
            await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


async def start_metrics_server(
    host: str, port: int, collect: Callable[[], Mapping[str, Any]], role: str | None = None
) -> MetricsServer:
    """Start serving /metrics now; `await server.close()` (or `async with`) stops it."""
    server = MetricsServer(host, port, collect, role)
    await server.start()
    return server


class RouterMetrics:
    """The router's own Prometheus metrics (its GET /metrics): it has no stats() to translate,
    the figures are observed as completions end."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdd_router_requests",
            "completions by how they ended",
            ["finish_reason"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "pdd_router_output_tokens",
            "output tokens by producer",
            ["producer"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdd_router_ttft_seconds",
            "time to first token at the router",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.active = Gauge(
            "pdd_router_active_requests", "requests in flight", registry=self.registry
        )
        self.inter_token = Histogram(
            "pdd_router_inter_token_seconds",
            "gap between token releases to the client",
            buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.by_pipeline = Counter(
            "pdd_router_requests_by_pipeline",
            "completions by the pipeline that served them",
            ["pipeline", "finish_reason"],
            registry=self.registry,
        )
        self.replays = Counter(
            "pdd_router_replays",
            "requests replayed by token ids after the daemon producing them was lost",
            registry=self.registry,
        )
        self.stall_replays = Counter(
            "pdd_router_stall_replays",
            "replays by the last resort: no progress for "
            "router.stall_timeout_s (expected 0: a lost daemon is "
            "replayed within its heartbeat deadline)",
            registry=self.registry,
        )

    def observe_gaps(self, gaps: Sequence[float]) -> None:
        for g in gaps:
            self.inter_token.observe(g)

    def observe(self, finish_reason: str, tokens: dict[str, int], ttft: float | None) -> None:
        self.requests.labels(finish_reason).inc()
        for producer, n in tokens.items():
            self.tokens.labels(producer).inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> tuple[bytes, str]:
        return render(self.registry)
