"""What the simulator serves: a stream of requests in arrival order, never all in memory.

Requests are sequences of *units*: one unit stands for ``tokens_per_unit`` consecutive tokens
(1 for the calibration runs, where units are the testbed's real token ids; 16-512 at datacenter
scale, where a 64K-token prompt becomes a few hundred units). Every prefix cache in the
simulator (MD's DRC, P's cache) is a real ``RadixCache`` over these units, so its matching,
locking and eviction are exactly the daemons'; only its granularity is coarser.

Two sources:
- ``agent_stream``: the seeded multi-turn agent generator of pddnet.bench.agent_workload, run in
  chunks of conversations (each chunk one call with its own derived seed and time offset) and
  merged by arrival time, so a million requests stream in bounded memory. Its lengths are given
  in tokens and converted to units here.
- ``trace_stream``: JSONL replay, one request per line: arrival (``arrival_s`` or Mooncake's
  ``timestamp`` in ms), prompt length (``prompt_tokens`` / ``input_length``), output length
  (``output_tokens`` / ``output_length``), the prompt's blocks as ids or hashes (``prefix_ids`` /
  ``hash_ids``, one per ``block_tokens`` tokens: equal ids = equal content) and optionally a
  ``conversation`` id for sticky routing.
"""

from __future__ import annotations

import heapq
import itertools
import json
import random
from collections.abc import Iterator
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from pddnet.bench.agent_workload import AgentWorkloadParams, generate_agent_workload


@dataclass(frozen=True, slots=True)
class SimRequest:
    rid: int
    conversation: int
    arrival_s: float
    units: tuple[int, ...]  # prompt content, one id per unit
    prompt_tokens: int
    output_tokens: int
    output_units: tuple[int, ...]  # what the reply adds to the conversation's history

    # (written out: mypyc compiles it; a dataclass's generated one stays interpreted)
    def __init__(
        self,
        rid: int,
        conversation: int,
        arrival_s: float,
        units: tuple[int, ...],
        prompt_tokens: int,
        output_tokens: int,
        output_units: tuple[int, ...],
    ) -> None:
        object.__setattr__(self, "rid", rid)
        object.__setattr__(self, "conversation", conversation)
        object.__setattr__(self, "arrival_s", arrival_s)
        object.__setattr__(self, "units", units)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "output_tokens", output_tokens)
        object.__setattr__(self, "output_units", output_units)

    def sent_at(self, t: float) -> SimRequest:
        """The same request offered at ``t`` (``dataclasses.replace``, compiled: once per turn)."""
        return SimRequest(
            self.rid,
            self.conversation,
            t,
            self.units,
            self.prompt_tokens,
            self.output_tokens,
            self.output_units,
        )


def units_for(tokens: int, tokens_per_unit: int) -> int:
    return max(1, -(-tokens // tokens_per_unit))


def agent_params_in_units(params: dict[str, Any], tokens_per_unit: int) -> AgentWorkloadParams:
    """AgentWorkloadParams from lengths in TOKENS (config) to lengths in units."""
    known = {f.name for f in fields(AgentWorkloadParams)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise ValueError(
            f"unknown agent workload field(s): {', '.join(unknown)} "
            f"(known: {', '.join(sorted(known))})"
        )
    out: dict[str, Any] = {}
    for k, v in params.items():
        if k in ("system_prompt_len", "task_len", "small_tool_len", "large_tool_len", "output_len"):
            lo, hi = v
            out[k] = (units_for(lo, tokens_per_unit), units_for(hi, tokens_per_unit))
        elif k == "max_context":
            out[k] = max(1, int(v) // tokens_per_unit)
        else:
            out[k] = tuple(v) if isinstance(v, list) else v
    if tokens_per_unit > 1:
        # A unit is many tokens: draw its id from a huge space, so unrelated units never match.
        out.setdefault("vocab", 1 << 40)
    return AgentWorkloadParams(**out)


def agent_stream(
    params: AgentWorkloadParams,
    seed: int,
    tokens_per_unit: int,
    max_requests: int,
    chunk_conversations: int = 64,
) -> Iterator[SimRequest]:
    """Up to ``max_requests`` agent requests in arrival order (``params.num_conversations``
    caps the conversations; the stream is generated chunk by chunk)."""
    if max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {max_requests!r}")
    q = tokens_per_unit
    rids = itertools.count()
    heap: list[tuple[float, int, int, Any, int]] = []  # (arrival, conv, turn, request, conv)
    offset, chunk, conv_base, emitted = 0.0, 0, 0, 0
    next_chunk_at = 0.0
    total_convs = params.num_conversations
    while emitted < max_requests:
        while conv_base < total_convs and (not heap or heap[0][0] >= next_chunk_at):
            n = min(chunk_conversations, total_convs - conv_base)
            part = generate_agent_workload(
                replace(params, num_conversations=n), seed=_derive(seed, chunk)
            )
            last_start = 0.0
            for r in part:
                conv = conv_base + r.conversation_id
                heapq.heappush(heap, (round(offset + r.arrival_s, 6), conv, r.turn, r, conv))
                if r.turn == 0:
                    last_start = max(last_start, r.arrival_s)
            offset += last_start
            next_chunk_at = offset
            conv_base += n
            chunk += 1
        if not heap:
            return
        arrival, conv, _, r, _ = heapq.heappop(heap)
        yield SimRequest(
            next(rids),
            conv,
            arrival,
            r.prompt_token_ids,
            len(r.prompt_token_ids) * q,
            r.max_tokens * q,
            r.output_token_ids,
        )
        emitted += 1


def _derive(seed: int, chunk: int) -> int:
    return random.Random(f"pddnet-sim:{seed}:{chunk}").getrandbits(63)


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
