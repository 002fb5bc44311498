"""Shared clusters for the chaos suite, and the report at the end of the run.

Starting a cluster costs ~10 s of the shared 2 cores, so cases whose fault heals completely
share one cluster per configuration (`chaos_clusters.get(key, ...)`). Before a cluster is handed
out it must be fit (every daemon alive, router /health ok); a case that breaks it, or whose
fault is destructive (SIGKILL, connection reset), drops it, and the next case gets a new one.
A cluster dropped after a failed case keeps its run directory (the daemons' logs).
"""

from __future__ import annotations

from typing import Any

import pytest
import pytest_asyncio

from pddnet.cluster.local import LocalCluster
from tests.chaos.harness import install_report, pid_alive, wait_healthy


class ClusterPool:
    def __init__(self) -> None:
        self._clusters: dict[str, LocalCluster] = {}

    async def get(self, key: str, **kwargs: Any) -> LocalCluster:
        cluster = self._clusters.get(key)
        if cluster is not None and not await self._fit(cluster):
            await self.drop(key, keep_logs=True)
            cluster = None
        if cluster is None:
            cluster = LocalCluster(**kwargs)
            await cluster.__aenter__()
            self._clusters[key] = cluster
        return cluster

    @staticmethod
    async def _fit(cluster: LocalCluster) -> bool:
        if not all(pid_alive(d.pid) for d in cluster.daemons.values()):
            return False
        return await wait_healthy(cluster, timeout_s=5.0) is None

    async def drop(self, key: str, keep_logs: bool = False) -> None:
        cluster = self._clusters.pop(key, None)
        if cluster is not None:
            exc = AssertionError("a chaos case failed on this cluster") if keep_logs else None
            await cluster.__aexit__(type(exc) if exc else None, exc, None)

    async def close_all(self) -> None:
        for key in list(self._clusters):
            await self.drop(key)


# Package scope: the clusters go when the chaos suite ends, so that no idle cluster (its WAN
# shell, heartbeats) shares the cores with the tests that measure the emulated link afterwards.
@pytest_asyncio.fixture(scope="package", loop_scope="session")
async def chaos_clusters():
    pool = ClusterPool()
    try:
        yield pool
    finally:
        await pool.close_all()


@pytest.fixture(scope="session", autouse=True)
def _chaos_report(request: pytest.FixtureRequest) -> None:
    install_report(request.config)
