"""What a daemon reports about itself (`stats`, the metrics page, `pdd status`): its requests,
KV blocks, bytes per lane, queues, counters, step times, peers, readiness and the modelled
accelerator it runs on."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

from pddnet.config import ClusterConfig
from pddnet.device.emulated import Emulation
from pddnet.device.pacer import StepPacer
from pddnet.engine.engine import Engine
from pddnet.obs.step_times import StepTimes
from pddnet.transport import Server

from .outbox import Outbox
from .peer import Peer


class DaemonStats:
    """The Daemon base's stats (the Daemon sets these attributes in its __init__; a subclass
    adds its own figures to ``stats()`` and gives ``request_stats``)."""

    role: str
    instance_id: str
    port: int | None
    config: ClusterConfig
    counters: Counter[str]
    engine: Engine | None
    server: Server | None
    metrics: Any
    peers: list[Peer]
    step_times: StepTimes
    emulation: Emulation | None
    pacer: StepPacer | None
    wire_scale: float
    _outboxes: list[Outbox]

    @property
    def ready(self) -> bool:  # pragma: no cover
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        """JSON-able counters: requests, KV blocks, bytes per lane and message type."""
        engine = self.engine
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
        conns = list(self.server.connections) if self.server is not None else []
        conns += [box.conn for box in self._outboxes if box.conn not in conns]
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
            "role": self.role,
            "instance": self.instance_id,
            "port": self.port,
            "metrics_url": self.metrics.url if self.metrics is not None else None,
            "requests": self.request_stats(),
            "kv_blocks": blocks,
            "lanes": lanes,
            "queues": queues,
            "counters": dict(self.counters),
            "threads": self.config.model.threads,
            **self.step_times.to_stats(),
            "tasks": len(asyncio.all_tasks()),
            "peers": {p.name: p.stats() for p in self.peers},
            "ready": self.ready,
            "device": self.device_stats(),
        }

    def device_stats(self) -> dict[str, Any]:
        """The modelled accelerator this daemon runs on and how well the box kept up with it."""
        if self.emulation is None or self.pacer is None:
            return {"emulated": False}
        cost = self.pacer.cost
        return {
            "emulated": True,
            "chip": cost.chip.name,
            "gpus": cost.gpus,
            "target_model": self.emulation.target.name,
            "wire_scale": self.wire_scale,
            **self.pacer.to_stats(),
        }

    def request_stats(self) -> dict[str, int]:  # pragma: no cover
        raise NotImplementedError
