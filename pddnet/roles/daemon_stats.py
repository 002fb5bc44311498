"""What a daemon reports about itself (`stats`, the metrics page, `pdd status`): its requests,
KV blocks, bytes per lane, queues, counters, step times, peers, readiness and the modelled
accelerator it runs on."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .common import Daemon


def daemon_stats(d: Daemon) -> dict[str, Any]:
    """A daemon's JSON-able counters: requests, KV blocks, bytes per lane and message type."""
    engine = d.engine
    blocks: dict[str, int] = {}
    if engine is not None:
        free = engine.num_available_blocks
        blocks = {
            "total": engine.num_blocks,
            "free": free,
            "used": engine.num_blocks - free,
            "block_size": engine.block_size,
        }
    lanes: dict[str, dict[str, int]] = {}
    conns = list(d.server.connections) if d.server is not None else []
    conns += [box.conn for box in d._outboxes if box.conn not in conns]
    for conn in conns:
        lane = lanes.setdefault(conn.lane, {"bytes_in": 0, "bytes_out": 0})
        lane["bytes_in"] += sum(conn.stats["bytes_in"].values())
        lane["bytes_out"] += sum(conn.stats["bytes_out"].values())
    queues: dict[str, int] = {}
    if engine is not None:
        queues = {
            "engine_waiting": len(engine.scheduler.waiting),
            "engine_running": len(engine.scheduler.running),
        }
    return {
        "role": d.role,
        "instance": d.instance_id,
        "port": d.port,
        "metrics_url": d.metrics.url if d.metrics is not None else None,
        "requests": d.request_stats(),
        "kv_blocks": blocks,
        "lanes": lanes,
        "queues": queues,
        "counters": dict(d.counters),
        "threads": d.config.model.threads,
        **d.step_times.to_stats(),
        "tasks": len(asyncio.all_tasks()),
        "peers": {p.name: p.stats() for p in d.peers},
        "ready": d.ready,
        "device": device_stats(d),
    }


def device_stats(d: Daemon) -> dict[str, Any]:
    """The modelled accelerator this daemon runs on and how well the box kept up with it."""
    if d.emulation is None or d.pacer is None:
        return {"emulated": False}
    cost = d.pacer.cost
    return {
        "emulated": True,
        "chip": cost.chip.name,
        "gpus": cost.gpus,
        "target_model": d.emulation.target.name,
        "wire_scale": d.wire_scale,
        **d.pacer.to_stats(),
    }
