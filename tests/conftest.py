"""Shared pytest setup: the --heavy flag, and one torch thread per test process.

The machine has 2 cores shared by tests, daemons and the WAN emulator, so the test process
itself uses one torch thread; daemons started by tests get their own explicit thread count.
"""

from __future__ import annotations

import os
import shutil

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--heavy",
        action="store_true",
        default=False,
        help="also run the heavy (long) cases: chaos suite, full soaks",
    )


def pytest_configure(config: pytest.Config) -> None:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    torch.set_num_threads(int(os.environ.get("PDD_TEST_TORCH_THREADS", "1")))


# Modules whose assertions are measurements of the emulated link against wall time (a delay
# median within 1 ms, a rate within 90-102%, a schedule step within 50 ms). On a shared 2-core
# machine one window can be disturbed by another process; such a test gets two more windows.
# Only an AssertionError is re-run, so a crash is never hidden, and a wrong emulator fails
# every window.
LINK_MEASUREMENT_MODULES = {
    "test_proxy_shell.py",
    "test_packet_shell.py",
    "test_control_api.py",
    "test_testbed.py",
    "test_kernel_shell.py",
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heavy = config.getoption("--heavy")
    skip_heavy = pytest.mark.skip(reason="heavy case: run with --heavy")
    for item in items:
        if not heavy and "heavy" in item.keywords:
            item.add_marker(skip_heavy)
        if item.path.name in LINK_MEASUREMENT_MODULES:
            item.add_marker(pytest.mark.flaky(reruns=2, only_rerun=["AssertionError"]))


def root_netns_missing_reason() -> str | None:
    """Why namespace/TUN tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    if shutil.which("true") is None:  # pragma: no cover
        return "no coreutils"
    return None
