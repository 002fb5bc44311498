"""pddnet.roles: the daemons. P (prefill), RLD (relay), MD (main decode) and the router.

    await run_role("relay", config)      # what `pdd serve relay --config FILE` runs

Each daemon is a thin asyncio shell (common.py) around the sans-IO request machines in
pddnet.lifecycle and an Engine driven by one EngineWorker thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
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


async def run_role(role: str, config: ClusterConfig) -> None:
    """Build the daemon for `role`, start it, serve until SIGTERM/SIGINT, then close it (no task,
    socket, thread or shared-memory segment left)."""
    name = ROLE_NAMES.get(role)
    if name is None:
        raise ValueError(
            f"unknown role {role!r}; expected one of prefill, relay, main-decode, router"
        )
    if name == "router":
        from pddnet.roles.router import run_router

        await run_router(config)
        return
    daemon = make_daemon(name, config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
            installed.append(sig)
    try:
        await daemon.start()
        serving = asyncio.ensure_future(daemon.serve_forever())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        for t in (serving, stopping):
            t.cancel()
        await asyncio.gather(serving, stopping, return_exceptions=True)
    finally:
        await daemon.close()
        for sig in installed:
            loop.remove_signal_handler(sig)


__all__ = ["run_role", "make_daemon", "ROLE_NAMES"]
