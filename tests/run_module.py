"""One way for tests to run a CLI as its own process: `python -m MODULE ARGS` with this
interpreter, output captured as text, always bounded by a timeout."""

from __future__ import annotations

import subprocess
import sys
from typing import Any


def run_module(
    module: str, *args: str, timeout: float, **kwargs: Any
) -> subprocess.CompletedProcess[str]:
    """The finished process (`kwargs`: more of subprocess.run's, e.g. env, cwd, check)."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        **kwargs,
    )
