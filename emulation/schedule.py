"""Time-varying link schedules: steps or a trace file, optionally looped (sans-IO).

A schedule is a list of steps; each step changes effects at a time relative to when the
schedule is loaded:

    {"at": 2.0, "rate_mbit": 10, "duration": 3.0}            # both directions, reverts at 5 s
    {"at": 0.5, "direction": "a_to_b", "delay_ms": 80}        # one direction, stays
    [2.0, {"rate_mbit": 10}]                                   # the (at, change) pair form

A trace file replays measured conditions: CSV with a header whose first column is `time` (s)
and the others effect names (typically `time,rate_mbit,delay_ms`), or JSONL with one object per
line (`{"time": 0, "rate_mbit": 100, "delay_ms": 20}`). An empty CSV cell means "no change";
`null` / `unlimited` in a rate column means no limit.

With loop the steps repeat every `period` seconds: by default the last step's time plus the gap
before it, so an evenly spaced trace repeats seamlessly.
"""

from __future__ import annotations

import csv
import itertools
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from emulation.effects import EFFECTS

_DIRECTIONS = ("both", "a_to_b", "b_to_a")
_RESERVED = ("at", "time", "direction", "duration")


@dataclass(frozen=True)
class Step:
    at: float  # seconds after the schedule is loaded
    direction: str  # both | a_to_b | b_to_a
    changes: dict[str, Any]
    duration: float | None


def _number(value: Any, what: str, positive: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{what} must be a number of seconds, got {value!r}")
    value = float(value)
    if value != value or value in (float("inf"), float("-inf")):
        raise ValueError(f"{what} must be finite, got {value!r}")
    if positive and value <= 0:
        raise ValueError(f"{what} must be > 0 s, got {value:g}")
    if not positive and value < 0:
        raise ValueError(f"{what} must be >= 0 s, got {value:g}")
    return value


def _parse_step(raw: Any, index: int, check: Callable[[dict], dict]) -> Step:
    where = f"schedule step {index}"
    if isinstance(raw, (list, tuple)):
        if len(raw) != 2 or not isinstance(raw[1], dict):
            raise ValueError(f"{where}: a pair must be [at, {{effect: value}}], got {raw!r}")
        raw = {"at": raw[0], **raw[1]}
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: must be an object with 'at' and effects, got {raw!r}")
    if "at" in raw and "time" in raw:
        raise ValueError(f"{where}: give 'at' or 'time', not both")
    if "at" not in raw and "time" not in raw:
        raise ValueError(f"{where}: missing 'at' (seconds after loading)")
    try:
        at = _number(raw.get("at", raw.get("time")), "at")
        direction = raw.get("direction", "both")
        if direction not in _DIRECTIONS:
            raise ValueError(f"unknown direction {direction!r} (known: {', '.join(_DIRECTIONS)})")
        duration = raw.get("duration")
        if duration is not None:
            duration = _number(duration, "duration", positive=True)
        changes = check({k: v for k, v in raw.items() if k not in _RESERVED})
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if not changes:
        raise ValueError(f"{where}: no effects to change")
    return Step(at, direction, changes, duration)


def _csv_value(name: str, text: str) -> Any:
    text = text.strip()
    spec = EFFECTS.get(name)
    if spec is None:
        raise ValueError(f"unknown effect {name!r} (known: {', '.join(EFFECTS)})")
    if spec.kind == "bool":
        if text.lower() not in ("true", "false"):
            raise ValueError(f"{name} must be true or false, got {text!r}")
        return text.lower() == "true"
    if spec.kind == "choice":
        return text
    if spec.nullable and text.lower() in ("null", "none", "unlimited", "off"):
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number ({spec.unit}), got {text!r}") from None


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    """Rows of a CSV or JSONL trace file as step dicts (validated later, by build_schedule)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace file {str(path)!r} does not exist")
    text = path.read_text()
    rows: list[dict[str, Any]] = []
    if path.suffix.lower() in (".jsonl", ".ndjson", ".json"):
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            if not isinstance(data, list):
                raise ValueError(f"{path}: a .json schedule must be a list of steps")
            return data
        for lineno, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: bad JSON: {exc.msg}") from None
        return rows
    reader = csv.reader(line for line in text.splitlines() if line.strip())
    header = next(reader, None)
    if not header or header[0].strip() not in ("time", "at"):
        raise ValueError(
            f"{path}: a CSV trace needs a header starting with 'time' "
            "(e.g. time,rate_mbit,delay_ms)"
        )
    names = [h.strip() for h in header]
    for lineno, cells in enumerate(reader, 2):
        if len(cells) != len(names):
            raise ValueError(f"{path}:{lineno}: {len(cells)} cells, header has {len(names)}")
        try:
            row: dict[str, Any] = {"at": float(cells[0])}
            for name, cell in zip(names[1:], cells[1:], strict=True):
                if cell.strip():
                    row[name] = cell.strip() if name in _RESERVED else _csv_value(name, cell)
            if "duration" in row:
                row["duration"] = float(row["duration"])
        except ValueError as exc:
            raise ValueError(f"{path}:{lineno}: {exc}") from None
        rows.append(row)
    return rows


class Schedule:
    """Validated steps plus the loop rule; produces each direction's absolute-time events."""

    def __init__(self, steps: list[Step], loop: bool, period: float | None, source: str) -> None:
        self.steps = sorted(steps, key=lambda s: s.at)  # stable: same-time steps keep order
        self.loop = loop
        self.source = source
        self.period = None
        if loop:
            if period is None:
                if len(self.steps) < 2:
                    raise ValueError("a looped schedule with one step needs an explicit period")
                last, before = self.steps[-1].at, self.steps[-2].at
                if last == before:
                    raise ValueError(
                        "cannot infer the loop period (the last two steps share a "
                        "time); give period explicitly"
                    )
                period = last + (last - before)
            period = _number(period, "period", positive=True)
            if self.steps[-1].at >= period:
                raise ValueError(
                    f"period ({period:g} s) must be later than the last step "
                    f"({self.steps[-1].at:g} s)"
                )
            self.period = period

    def iterate(self, start: float, direction: str) -> Iterator[tuple[float, dict, float | None]]:
        mine = [s for s in self.steps if s.direction in ("both", direction)]
        if not mine:
            return iter(())
        if self.period is None:
            return ((start + s.at, s.changes, s.duration) for s in mine)
        period = self.period
        return (
            (start + k * period + s.at, s.changes, s.duration)
            for k in itertools.count()
            for s in mine
        )

    def info(self, start: float, direction: str) -> dict[str, Any]:
        return {
            "source": self.source,
            "loaded_at": start,
            "loop": self.loop,
            "period_s": self.period,
            "finished": False,
            "steps": sum(1 for s in self.steps if s.direction in ("both", direction)),
        }


def build_schedule(
    steps: list | str | Path,
    loop: bool = False,
    period: float | None = None,
    check: Callable[[dict], dict] | None = None,
) -> Schedule:
    """Parse and validate a schedule (steps list or trace path); ValueError names the step."""
    from emulation.effects import validate_effects

    check = check or validate_effects
    if isinstance(steps, (str, Path)):
        source = str(steps)
        raw = read_trace(steps)
    elif isinstance(steps, list):
        source = "steps"
        raw = steps
    else:
        raise ValueError(
            f"a schedule is a list of steps or a trace file path, got {type(steps).__name__}"
        )
    if not raw:
        raise ValueError("schedule has no steps")
    if not isinstance(loop, bool):
        raise ValueError(f"loop must be true or false, got {loop!r}")
    parsed = [_parse_step(r, i, check) for i, r in enumerate(raw)]
    return Schedule(parsed, loop, period, source)
