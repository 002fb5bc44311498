"""Shared pytest setup: the --heavy flag, and one torch thread per test process.

The machine has 2 cores shared by tests, daemons and the WAN emulator, so the test process
itself uses one torch thread; daemons started by tests get their own explicit thread count.
"""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--heavy", action="store_true", default=False,
                     help="also run the heavy (long) cases: chaos suite, full soaks")


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    torch.set_num_threads(int(os.environ.get("PDD_TEST_TORCH_THREADS", "1")))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--heavy"):
        return
    skip_heavy = pytest.mark.skip(reason="heavy case: run with --heavy")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip_heavy)


def root_netns_missing_reason() -> str | None:
    """Why namespace/TUN tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    if shutil.which("true") is None:  # pragma: no cover
        return "no coreutils"
    return None
