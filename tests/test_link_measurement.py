"""The re-run rule of tests/conftest.py: a test marked link_measurement is re-run when one of its
measurement asserts misses, and only then (a logic assert fails at once, and so does a miss in
a test that is not marked). Run in a child pytest, which counts how often each test ran."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.link_measurement import LinkMeasurementMiss, assert_measured

REPO = Path(__file__).resolve().parents[1]

CASES = """
import os

import pytest

from tests.link_measurement import assert_measured


def ran(name: str) -> int:
    with open(os.environ["RUNS_FILE"], "a+") as f:
        f.write(name + "\\n")
        f.seek(0)
        return f.read().split().count(name)


@pytest.mark.link_measurement
def test_marked_miss():
    ran("marked_miss")
    assert_measured(31.5, 29.0, 31.0, "RTT median (ms)")


@pytest.mark.link_measurement
def test_marked_miss_then_hit():
    n = ran("marked_miss_then_hit")
    assert_measured(30.5 if n == 2 else 31.5, 29.0, 31.0, "RTT median (ms)")


@pytest.mark.link_measurement
def test_marked_logic_assert():
    ran("marked_logic_assert")
    assert_measured(30.0, 29.0, 31.0, "RTT median (ms)")
    assert 29.9 >= 30.0  # never early: a logic assert


def test_unmarked_miss():
    ran("unmarked_miss")
    assert_measured(31.5, 29.0, 31.0, "RTT median (ms)")
"""


def test_assert_measured_passes_the_value_and_names_a_miss() -> None:
    assert assert_measured(30.2, 29.0, 31.0, "RTT median (ms)") == 30.2
    assert assert_measured(29.0, 29.0, 29.0, "bound") == 29.0  # bounds are inclusive
    with pytest.raises(LinkMeasurementMiss, match=r"RTT median \(ms\): measured 31.5, expected"):
        assert_measured(31.5, 29.0, 31.0, "RTT median (ms)")
    assert issubclass(LinkMeasurementMiss, AssertionError)  # a plain failure outside pytest


def test_only_measurement_misses_of_marked_tests_are_rerun(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    runs = tmp_path / "runs.txt"
    env = {**os.environ, "PYTHONPATH": str(REPO), "RUNS_FILE": str(runs)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest"]
        + ["-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "3 failed, 1 passed, 3 rerun" in proc.stdout, proc.stdout + proc.stderr
    assert Counter(runs.read_text().split()) == {
        "marked_miss": 3,  # two more windows, then it fails
        "marked_miss_then_hit": 2,  # the second window hit: it passes
        "marked_logic_assert": 1,
        "unmarked_miss": 1,
    }
