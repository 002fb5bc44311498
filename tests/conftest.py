"""Shared pytest setup: the --heavy flag, re-runs for link measurements, one torch thread per
test process, and under pytest-xdist: link measurements alone, the chaos report's cases handed
over by the workers.

The machine has 2 cores shared by tests, daemons and the WAN emulator, so the test process
itself uses one torch thread; daemons started by tests get their own explicit thread count.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--heavy",
        action="store_true",
        default=False,
        help="also run the heavy (long) cases: chaos suite, full soaks",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "link_measurement: measures a real link against wall time; re-run only when an "
        "assert_measured (tests/link_measurement.py) misses",
    )
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    torch.set_num_threads(int(os.environ.get("PDD_TEST_TORCH_THREADS", "1")))


# A test marked link_measurement gets two more windows, and only when a measurement assert
# missed: the miss is a LinkMeasurementMiss (tests/link_measurement.py), matched here by its
# name (the class may be imported under two module names, so not by identity). A logic assert,
# a timeout or a crash in the same test fails at once.
MEASUREMENT_RERUN = pytest.mark.flaky(reruns=2, only_rerun=["^LinkMeasurementMiss: "])


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    heavy = config.getoption("--heavy")
    skip_heavy = pytest.mark.skip(reason="heavy case: run with --heavy")
    for item in items:
        if not heavy and "heavy" in item.keywords:
            item.add_marker(skip_heavy)
        if item.get_closest_marker("link_measurement") is not None:
            item.add_marker(MEASUREMENT_RERUN)


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """A pytest-xdist worker: a link measurement runs alone (tests/alone.py), the other workers
    waiting between their tests: it holds a real link to wall-clock bounds of a millisecond,
    which 2 workers' clusters on the 2 cores would miss. Outermost (tryfirst), so the wait is
    outside the test's timeout and its re-runs are inside."""
    if not hasattr(item.config, "workerinput"):
        yield
        return
    from tests.alone import turn

    folder = item.config._tmp_path_factory.getbasetemp().parent  # the run's, all workers'
    with turn(folder, alone=item.get_closest_marker("link_measurement") is not None):
        yield


@pytest.hookimpl(optionalhook=True)  # a pytest-xdist hook: only called where xdist runs
def pytest_testnodedown(node: Any, error: object | None) -> None:
    """The controller of pytest-xdist workers: a finished worker hands over its chaos / fuzz /
    soak cases, so that the one report (tests/chaos/harness.py) covers the whole run."""
    from tests.chaos.harness import merge_worker_cases

    merge_worker_cases(node.config, getattr(node, "workeroutput", None) or {})


def root_netns_missing_reason() -> str | None:
    """Why namespace/TUN tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, TUN devices)"
    if not os.path.exists("/dev/net/tun"):
        return "needs /dev/net/tun"
    if shutil.which("true") is None:  # pragma: no cover
        return "no coreutils"
    return None
