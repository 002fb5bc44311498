"""The chaos / fuzz / soak report under pytest-xdist (README's test command runs 2 workers): the
controller prints one table and writes one report.json holding every worker's cases. Run in a
child pytest with 2 workers, each of which records cases of its own."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.run_module import run_module

REPO = Path(__file__).resolve().parents[2]

CASES = """
import os

import pytest

from tests.chaos.harness import REPORT, CaseResult, install_report


@pytest.mark.parametrize("i", [0, 1])
def test_records_a_case(request, i):
    install_report(request.config)
    worker = os.environ["PYTEST_XDIST_WORKER"]
    REPORT.add(CaseResult("t", f"case {i} on {worker}", "none", None, sent=1, exact=1))
"""

# The child's report goes to its own folder, not to this checkout's results/chaos/.
CONFTEST = """
from pathlib import Path

from tests.chaos import harness


def pytest_configure(config):
    harness.RESULTS_DIR = Path(__file__).parent / "results"
"""


def test_one_report_holds_every_workers_cases(tmp_path: Path) -> None:
    (tmp_path / "test_cases.py").write_text(CASES)
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    env["PYTHONPATH"] = str(REPO)
    # --dist each: both workers run both tests, so each worker has cases to hand over
    proc = run_module(
        "pytest",
        *("-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "-n", "2", "--dist", "each"),
        *("-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path), str(tmp_path)),
        cwd=REPO,
        env=env,
        timeout=120,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    want = {f"case {i} on gw{w}" for i in (0, 1) for w in (0, 1)}
    report = json.loads((tmp_path / "results" / "report.json").read_text())
    assert {c["case"] for c in report["cases"]} == want
    assert report["totals"]["cases"] == 4 and report["totals"]["completed_token_exact"] == 4
    assert "pddnet chaos / fuzz / soak report" in out
    assert all(case in out for case in want), out
