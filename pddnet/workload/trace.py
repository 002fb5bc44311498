"""JSONL trace replay as the simulator's stream of units, one request per line.

Fields: arrival (``arrival_s`` or Mooncake's ``timestamp`` in ms), prompt length
(``prompt_tokens`` / ``input_length``), output length (``output_tokens`` / ``output_length``),
the prompt's blocks as ids or hashes (``prefix_ids`` / ``hash_ids``, one per ``block_tokens``
tokens: equal ids = equal content) and optionally a ``conversation`` id for sticky routing.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pddnet.workload.units import SimRequest, units_for

_TRACE_KEYS = {
    "arrival": ("arrival_s", "timestamp"),
    "prompt": ("prompt_tokens", "input_length"),
    "output": ("output_tokens", "output_length"),
    "ids": ("prefix_ids", "hash_ids"),
}


def trace_stream(
    path: str | Path, tokens_per_unit: int, max_requests: int | None = None
) -> Iterator[SimRequest]:
    """Replay a JSONL trace (see the module docstring); ``tokens_per_unit`` is the trace's
    block size. Arrivals must not go backwards."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace file {path} does not exist")
    fresh = itertools.count(-1, -1)  # unique ids for uncovered units and outputs
    last = -1.0
    with path.open() as f:
        n = 0
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            if max_requests is not None and n >= max_requests:
                return
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from None

            def get(key: str, rec: dict = rec, lineno: int = lineno) -> Any:
                for name in _TRACE_KEYS[key]:
                    if name in rec:
                        return rec[name]
                if key == "ids":
                    return []
                raise ValueError(f"{path}:{lineno}: missing {' or '.join(_TRACE_KEYS[key])}")

            arrival = float(get("arrival"))
            if "arrival_s" not in rec:
                arrival /= 1000.0  # Mooncake timestamps are in ms
            if arrival < last:
                raise ValueError(
                    f"{path}:{lineno}: arrival {arrival} before the previous "
                    f"line's {last}: sort the trace by time"
                )
            last = arrival
            prompt, output = int(get("prompt")), int(get("output"))
            if prompt < 1 or output < 1:
                raise ValueError(f"{path}:{lineno}: prompt and output lengths must be >= 1")
            ids = [int(x) for x in get("ids")]
            need = units_for(prompt, tokens_per_unit)
            if len(ids) > need:
                raise ValueError(
                    f"{path}:{lineno}: {len(ids)} block ids for {prompt} tokens "
                    f"(at most {need} at {tokens_per_unit} tokens per block)"
                )
            units = tuple(ids) + tuple(next(fresh) for _ in range(need - len(ids)))
            out_units = tuple(next(fresh) for _ in range(units_for(output, tokens_per_unit)))
            conv = int(rec.get("conversation", -lineno))
            yield SimRequest(n, conv, arrival, units, prompt, output, out_units)
            n += 1
