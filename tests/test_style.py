"""The tree stays lint-clean and formatted (`ruff check`, `ruff format --check`), so that a
change's diff shows what it changes, not a reformatting. ruff is pinned in the test extras:
its formatting moves between versions."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, str(ROOT)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def test_ruff_check_is_clean() -> None:
    out = _ruff("check", "--no-cache")
    assert out.returncode == 0, f"ruff check found problems:\n{out.stdout}{out.stderr}"


def test_the_tree_is_formatted() -> None:
    out = _ruff("format", "--check", "--no-cache")
    assert out.returncode == 0, (
        f"files not formatted (run `ruff format .`):\n{out.stdout}{out.stderr}"
    )
