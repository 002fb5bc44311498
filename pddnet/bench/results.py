"""Writing benchmark results: one JSON per run with the configuration and the machine inside."""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {"cores": os.cpu_count(), "platform": platform.platform(),
                            "python": platform.python_version()}
    try:
        import torch

        info["torch"] = torch.__version__
    except ImportError:  # pragma: no cover
        info["torch"] = None
    try:
        info["loadavg"] = os.getloadavg()
    except OSError:  # pragma: no cover
        pass
    return info


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (q in 0..100); None for no values."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float | None]:
    return {"n": len(values), "mean": (sum(values) / len(values)) if values else None,
            "p50": percentile(values, 50), "p90": percentile(values, 90),
            "p99": percentile(values, 99), "max": max(values) if values else None}


def write_result(bench: str, data: dict[str, Any], out_dir: str | Path = "results") -> Path:
    """results/<bench>/<timestamp>.json; returns the path (PNG files go beside it)."""
    folder = Path(out_dir) / bench
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / (time.strftime("%Y%m%d-%H%M%S") + ".json")
    payload = {"bench": bench, "time": time.time(), "machine": machine_info(), **data}
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str))
    return path


def device_report(stats_by_role: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The emulated devices of one cluster run, from its daemons' stats(): per role the device
    and its overruns, and whether the run's times are valid (every role at most 1% overrun
    forwards; else the dilation that would have made them so). ``{"emulated": False}`` for an
    unpaced run."""
    from pddnet.device.pacer import VALID_OVERRUN_SHARE

    roles = {r: s["device"] for r, s in stats_by_role.items()
             if isinstance(s.get("device"), dict) and s["device"].get("emulated")}
    if not roles:
        return {"emulated": False}
    steps = sum(d["steps"] for d in roles.values())
    overruns = sum(d["overruns"] for d in roles.values())
    valid = all(d["overrun_share"] <= VALID_OVERRUN_SHARE for d in roles.values())
    return {"emulated": True, "roles": roles, "steps": steps, "overruns": overruns,
            "overrun_share": overruns / steps if steps else 0.0, "valid": valid,
            "dilation": max(d["dilation"] for d in roles.values()),
            "dilation_needed": max(d["dilation_needed"] for d in roles.values())}


def validity_warning(report: dict[str, Any], what: str = "this run") -> str | None:
    """The line a benchmark prints when its emulated devices overran on more than 1% of the
    forwards: its times are not those of the modelled devices."""
    if not report.get("emulated") or report["valid"]:
        return None
    worst = max(report["roles"].items(), key=lambda kv: kv[1]["overrun_share"])
    return (f"NOT VALID: {what} overran its modelled devices on {report['overruns']} of "
            f"{report['steps']} forwards ({worst[0]}: {worst[1]['overrun_share']:.1%} > 1%), so "
            f"its times are this box's, not the devices'; rerun with --dilation "
            f"{report['dilation_needed']:g} or more (it ran at k = {report['dilation']:g})")
