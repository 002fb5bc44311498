"""Writing benchmark results: one JSON per run with the configuration and the machine inside,
and the lines a run ends with (where it wrote)."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import time
from argparse import Namespace
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from pddnet.bench.devices import print_validity


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        info["torch"] = None
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    info["commit"] = source_commit()
    return info


@functools.cache
def source_commit() -> str | None:
    """The commit the running pddnet comes from (``+dirty`` with uncommitted changes), so
    that every figure names its code; None outside a git checkout. Read once per process (the
    benchmark CLI reads it before a run starts: the code that runs is what was there then)."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(here), "rev-parse", "--short=7", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if head.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", str(here), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")


def run_config(args: Namespace) -> dict[str, Any]:
    """The run's options as its JSON stores them: the parsed flags, without the CLI's own."""
    return {
        k: (list(v) if isinstance(v, tuple) else v)
        for k, v in vars(args).items()
        if k not in ("handler", "bench_spec")
    }


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float | None]:
    return {
        "n": len(values),
        "mean": (sum(values) / len(values)) if values else None,
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
    }


def write_result(bench: str, data: dict[str, Any], out_dir: str | Path = "results") -> Path:
    """results/<bench>/<timestamp>.json; returns the path (PNG files go beside it)."""
    folder = Path(out_dir) / bench
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (time.strftime("%Y%m%d-%H%M%S") + ".json")
    payload = {"bench": bench, "time": time.time(), "machine": machine_info(), **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    return path


def announce(path: Path, plots: Iterable[Path | str | None] = ()) -> None:
    """Say where a run's JSON (and each plot it drew; None: a plot it could not draw) went."""
    print(f"wrote {path}" + "".join(f"\nwrote {p}" for p in plots if p))


def closing(
    path: Path, png: Path | None, reports: Mapping[str, dict[str, Any]], bench: str
) -> dict[str, Any]:
    """The end a cluster benchmark with one plot shares: where its JSON and plot went, then the
    prominent warning for every run whose emulated devices did not keep pace; returns the keys
    of its result that say so ("path", "plot", "warnings")."""
    announce(path, [png])
    warnings = print_validity(reports, bench)
    return {"path": str(path), "plot": str(png) if png else None, "warnings": warnings}
