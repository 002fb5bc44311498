"""pddnet.cluster: start, find and stop a whole cluster (`pdd up`, `pdd serve`, `pdd status`).

    async with LocalCluster(mode="pdd", wan="proxy", rtt_ms=30) as cluster:
        url = cluster.url                      # the router, OpenAI-compatible
        await cluster.stats("relay")           # a daemon's stats()

See docs/cluster.md. Names are imported lazily so `pdd --help` stays fast.
"""

from __future__ import annotations

from pddnet.lazy import lazy_exports

_EXPORTS = {
    "LocalCluster": "local",
    "ClusterLauncher": "launcher",
    "ClusterStartError": "launcher",
    "read_run_file": "launcher",
    "choose_wan": "wan_setup",
    "WanChoice": "wan_setup",
    "WanUnavailable": "wan_setup",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
