"""pddnet.roles: the daemons. P (prefill), RLD (relay), MD (main decode) and the router.

    daemon = make_daemon("relay", config)   # `pdd serve relay --config FILE` serves it
                                            # (pddnet.cluster.cli.serve_daemon)

Each daemon is a thin asyncio shell (common.py) around the sans-IO request machines in
pddnet.lifecycle and an Engine driven by one EngineWorker thread.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imports stay lazy: `pdd --help` must not load torch
    from pddnet.config import ClusterConfig
    from pddnet.roles.common import Daemon

ROLE_NAMES = {
    "prefill": "prefill",
    "relay": "relay",
    "main-decode": "main_decode",
    "main_decode": "main_decode",
    "router": "router",
}


def make_daemon(role: str, config: ClusterConfig) -> Daemon:
    """The P, RLD or MD daemon for `role` (not started)."""
    name = ROLE_NAMES.get(role)
    if name is None or name == "router":
        choices = "prefill, relay, main-decode"
        raise ValueError(f"unknown daemon role {role!r}; expected one of {choices}")
    if name == "prefill":
        from pddnet.roles.prefill import PrefillDaemon

        return PrefillDaemon(config)
    if name == "relay":
        from pddnet.roles.relay import RelayDaemon

        return RelayDaemon(config)
    from pddnet.roles.main_decode import MainDecodeDaemon

    return MainDecodeDaemon(config)


__all__ = ["make_daemon", "ROLE_NAMES"]
