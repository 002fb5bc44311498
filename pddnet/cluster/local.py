"""`LocalCluster`: a whole cluster for tests and scripts, as an async context manager.

    async with LocalCluster(mode="pdd", wan="proxy", rtt_ms=30, jitter_ms=2, bw_mbit=4) as c:
        c.url            # router base URL (http://127.0.0.1:PORT)
        c.run_file       # the run file (JSON) the launcher wrote
        await c.stats("main_decode")   # that daemon's stats(), fresh
        await c.complete(prompt=[1, 2, 3], max_tokens=8, temperature=0)  # one completion

`placement="hosts"` (with wan="packet" or "kernel") runs every daemon in a namespace of its own,
as on separate machines (pddnet.cluster.wan_setup.HostsPlacement).

It writes a config into its run directory and starts the daemons as separate processes through
`ClusterLauncher` (exactly what `pdd up` does); leaving the block stops everything and records
the stop report (`c.stop_report`). The run directory is a fresh temporary one unless given; it
is removed on a clean exit and kept (with the daemons' logs) when the block raised.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from pddnet.cluster.launcher import ClusterLauncher, StopReport
from pddnet.config import ClusterConfig, load_config


class LocalCluster:
    def __init__(
        self,
        mode: str = "pdd",
        model: str = "tiny",
        wan: str = "proxy",
        rtt_ms: float = 30.0,
        jitter_ms: float = 0.0,
        bw_mbit: float | None = None,
        run_dir: str | Path | None = None,
        config: ClusterConfig | None = None,
        overrides: dict[str, Any] | None = None,
        startup_timeout: float = 120.0,
        keep_run_dir: bool = False,
        placement: str = "datacenter",
    ) -> None:
        if config is None:
            base: dict[str, Any] = {
                "mode": mode,
                "model.name": model,
                "wan.shell": wan,
                "wan.rtt_ms": rtt_ms,
                "wan.jitter_ms": jitter_ms,
                "router.port": 0,
                "prefill.port": 0,
                "relay.port": 0,
                "main_decode.port": 0,
            }
            if bw_mbit is not None:
                base["wan.bw_mbit"] = bw_mbit
            base.update(overrides or {})
            config = load_config(None, base)
        self.config = config
        self._own_dir = run_dir is None
        self.run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="pdd-cluster-"))
        self.keep_run_dir = keep_run_dir
        self.startup_timeout = startup_timeout
        self.launcher = ClusterLauncher(
            config, self.run_dir, wan=config.wan.shell, placement=placement
        )
        self.info: dict[str, Any] = {}
        self.stop_report: StopReport | None = None

    async def __aenter__(self) -> LocalCluster:
        try:
            self.info = await self.launcher.start(self.startup_timeout)
        except BaseException:
            self._cleanup(keep=True)
            raise
        return self

    async def __aexit__(self, exc_type: Any, *exc: object) -> None:
        await self.stop()
        self._cleanup(keep=exc_type is not None)

    async def restart(self, role: str, timeout: float = 60.0) -> Any:
        """Start a killed daemon again (same ports); see ClusterLauncher.restart."""
        return await self.launcher.restart(role, timeout)

    async def stop(self) -> StopReport:
        if self.stop_report is None:
            self.stop_report = await self.launcher.stop()
        return self.stop_report

    def _cleanup(self, keep: bool) -> None:
        if self._own_dir and not keep and not self.keep_run_dir:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    @property
    def url(self) -> str:
        assert self.launcher.router_url is not None, "the cluster is not up"
        return self.launcher.router_url

    @property
    def run_file(self) -> Path:
        return self.launcher.run_file

    @property
    def wan(self) -> dict[str, Any]:
        return self.info.get("wan", {})

    @property
    def daemons(self) -> dict[str, Any]:
        return self.launcher.daemons

    async def stats(self, role: str) -> dict[str, Any]:
        if role == "router":
            return await self._get_json("/stats")
        return await self.launcher.stats(role)

    async def health(self) -> dict[str, Any]:
        return await self._get_json("/health")

    async def _get_json(self, path: str) -> dict[str, Any]:
        import aiohttp

        async with aiohttp.ClientSession() as s, s.get(self.url + path) as r:
            return await r.json()

    async def complete(self, **body: Any) -> dict[str, Any]:
        """POST /v1/completions (non-streaming) with the served model; returns the JSON body
        (raises for a non-200 answer, with the server's error message)."""
        import aiohttp

        body.setdefault("model", self.config.model.name)
        async with (
            aiohttp.ClientSession() as s,
            s.post(self.url + "/v1/completions", json=body) as r,
        ):
            data = await r.json()
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {data}")
            return data
