"""The seeded agent workload (pddnet.workload.agent) as the simulator's stream of units.

The generator runs in chunks of conversations (each chunk one call with its own derived seed and
time offset) merged by arrival time, so a million requests stream in bounded memory. Its lengths
are given in tokens (config) and converted to units here.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

from pddnet.workload.agent import AgentWorkloadParams, generate_agent_workload
from pddnet.workload.units import SimRequest, units_for


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
