"""Asserts that measure a real (emulated) link against wall time: the only asserts re-run.

A delay median within 1 ms, a rate within 90-102 %, a schedule step within 50 ms: on a shared
2-core machine another process can disturb one measurement window, so a test marked
`@pytest.mark.link_measurement` gets two more windows (tests/conftest.py), but only when one of
these asserts misses. A logic assert in the same test (bytes intact, nothing early, a counter)
fails at once: a wrong emulator fails every window, and a crash or timeout is never hidden.
"""

from __future__ import annotations


class LinkMeasurementMiss(AssertionError):
    """A value measured on a live link fell outside its tolerance."""


def assert_measured(value: float, lo: float, hi: float, what: str) -> float:
    """`value` if lo <= value <= hi, else LinkMeasurementMiss naming `what` and the bounds."""
    if not lo <= value <= hi:
        raise LinkMeasurementMiss(f"{what}: measured {value:g}, expected within [{lo:g}, {hi:g}]")
    return value
