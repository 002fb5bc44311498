"""`pdd bench reproduce`'s three workloads, all drawn from the agent generator
(pddnet.workload.agent) with the run's seed:

- the source's traffic (`main`): conversations as `pdd sim reproduce`'s, cut to their first
  turns, served by the three clusters for the TTFT and serving figures;
- the source's 64K-in / 1K-out shape (`shape`): conversations on one ~56K-token shared context
  whose turns ask for 1K tokens, after one warm-up request that puts that context in MD's
  cache, for RLD's share of the tokens (what the source's 6.2% measures: RLD decodes while the
  uncached KV crosses, MD makes the rest);
- long conversations (`drc`): every turn until the 64K context is full, so that the
  decode-side hit averages what the source reports (~90%, most requests above 95%), for the
  WAN KV bytes with and without the decode-side cache;
- the host-latency probe (`host_probe`): a few requests of random ids over the main
  workload's prompt lengths, sent one at a time to the idle same-DC cluster, whose TTFTs less
  the modelled ones measure the testbed's host path for the simulator.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from typing import Any

from pddnet.workload.agent import (
    AgentRequest,
    AgentWorkloadParams,
    generate_agent_workload,
    uniform_ids,
)
from pddnet.workload.hits import hit_distribution, ideal_hit_ratios

# `pdd sim reproduce`'s full scenario (pddnet/sim/reproduce.py) offers its 40 P instances 1.8
# new conversations per second.
SOURCE_P_INSTANCES = 40
SOURCE_CONVERSATION_RATE = 1.8

# The main workload, field by field: (--quick's, a full run's); lengths in tokens. A full run's
# are `pdd sim reproduce`'s AGENT_LENGTHS and output range (the context reaches 64K through the
# large tool results). With 4 conversations (--conversations) of 8-16 turns, the first
# --max-requests (36) are about as warm as the source's traffic, ~90% prefix hit with 70-80% of
# the requests above 95% (`workload_hits`): seed 0 gives 89% and 81%, seeds 0-5 81-89% and
# 50-81%. The 8 conversations of 4-10 turns cut to 24 used before gave 74-82% and 25-58% (more
# first turns, whose prompts are cold, and fewer late ones).
SHAPES: dict[str, tuple[Any, Any]] = {
    "think_time_s": (0.5, 2.0),
    "system_prompt_len": ((256, 512), (4000, 16000)),
    "task_len": ((32, 64), (1000, 4000)),
    "small_tool_len": ((8, 32), (64, 1024)),
    "large_tool_len": ((128, 256), (8000, 32000)),
    "large_tool_prob": (0.3, 0.18),
    "output_len": ((8, 16), (64, 1024)),
    "max_turns": ((2, 3), (8, 16)),
    "max_context": (2048, 65536),
}

# The 64K-in / 1K-out shape: (--quick's, a full run's). One shared context (a code base, a
# long document) that every conversation starts from, a task, 1K tokens out, a tool result, 1K
# out again: prompts of 58-63K tokens of which 2-3K are new to MD (~95% hit, as the source's
# 70-80% of requests above 95%) once the warm-up has put the context there. Three
# conversations arrive ~5 s apart, so that their transfers and decodes overlap as at a busy
# instance. (--quick's prompts are small enough for P->MD: it checks consistency only.)
SOURCE_SHAPE: dict[str, tuple[Any, Any]] = {
    "num_conversations": (2, 3),
    "conversation_rate_per_s": (2.0, 0.2),
    "think_time_s": (0.5, 2.0),
    "num_system_prompts": (1, 1),
    "system_prompt_len": ((1024, 1024), (56000, 56000)),
    "task_len": ((32, 64), (2000, 3000)),
    "small_tool_len": ((16, 32), (2000, 3000)),
    "large_tool_prob": (0.0, 0.0),
    "output_len": ((16, 16), (1024, 1024)),
    "max_turns": ((1, 1), (2, 2)),
    "max_context": (2048, 65536),
}
# The warm-up's output: long enough that P's planner sends it P->RLD->MD (RLD would not finish
# it before the shared context's KV crosses), so MD caches that context, as its cache holds a
# conversation's history in steady state. Twice the shape's output (the planner compares
# max_tokens x RLD's step time with the KV's crossing time: ~18 s against ~13 s at 2 Gbit/s).
WARM_UP_TOKENS = (128, 2048)

# Long conversations for the decode-side cache's bytes: (--quick's, a full run's). Turn budgets
# past what a 64K context holds, so each conversation runs until its context is full (as the
# source's agents do); 3 conversations give ~50 requests at ~88-90% mean hit with 75-83% of
# them above 95% (pddnet.workload.hits on seeds 0-2).
DRC_SHAPE: dict[str, tuple[Any, Any]] = {
    "num_conversations": (2, 3),
    "max_turns": ((4, 5), (24, 32)),
    # bytes do not depend on time: the conversations start together and think briefly (the
    # same token ids: the generator draws the same numbers, only the times differ)
    "conversation_rate_per_s": (10.0, 10.0),
    "think_time_s": (0.1, 0.1),
}


# The host-latency probe: (--quick's, a full run's) number of requests, their prompt lengths
# spread geometrically over the main workload's; a couple of tokens out (TTFT is the figure).
HOST_PROBE_REQUESTS = (4, 6)
HOST_PROBE_MAX_TOKENS = 2


def _pick(table: dict[str, tuple[Any, Any]], quick: bool) -> dict[str, Any]:
    return {field: values[0 if quick else 1] for field, values in table.items()}


def main_params(args: argparse.Namespace) -> AgentWorkloadParams:
    # Four times one P's share of the scenario's conversation rate: a run of minutes reaches
    # the concurrency the scenario has at steady state (conversations last minutes there).
    rate = args.conversation_rate or (
        2.0 if args.quick else 4 * SOURCE_CONVERSATION_RATE / SOURCE_P_INSTANCES
    )
    count = 2 if args.quick else args.conversations
    return AgentWorkloadParams(
        num_conversations=count, conversation_rate_per_s=rate, **_pick(SHAPES, args.quick)
    )


def main_workload(args: argparse.Namespace) -> list[AgentRequest]:
    """The agent conversations, cut to the first --max-requests turns by arrival (each
    conversation keeps a prefix of its turns, so every prompt's history is intact)."""
    requests = generate_agent_workload(main_params(args), seed=args.seed)
    return requests[: 4 if args.quick else args.max_requests]


def workload_hits(requests: list[AgentRequest]) -> dict[str, float]:
    """The workload's prefix hits against an ideal cache (pddnet.workload.hits), in arrival
    order: the mean per request and the share in the source's top interval (95-100%), beside
    the source's ~90% and 70-80%."""
    ratios = ideal_hit_ratios(sorted(requests, key=lambda r: r.arrival_s))
    return {
        "mean": sum(ratios) / len(ratios),
        "above_95": hit_distribution(ratios)["95-100%"],
    }


def shape_workload(args: argparse.Namespace) -> tuple[AgentRequest, list[AgentRequest]]:
    """The warm-up request (the shared context alone, WARM_UP_TOKENS out) and the shape's
    conversations, whose arrivals count from the warm-up's end."""
    shape = _pick(SOURCE_SHAPE, args.quick)
    params = AgentWorkloadParams(**shape)
    requests = generate_agent_workload(params, seed=args.seed)
    context = requests[0].prompt_token_ids[: shape["system_prompt_len"][0]]
    n_out = WARM_UP_TOKENS[0 if args.quick else 1]
    output = uniform_ids(random.Random(args.seed), params.vocab, n_out)
    warm = AgentRequest(-1, 0, 0.0, context, n_out, output, context)
    return warm, requests


def drc_workload(args: argparse.Namespace) -> list[AgentRequest]:
    """The main workload's lengths, every turn of a few conversations that run to 64K."""
    params = dataclasses.replace(main_params(args), **_pick(DRC_SHAPE, args.quick))
    return generate_agent_workload(params, seed=args.seed)


def host_probe_workload(args: argparse.Namespace, main: list[AgentRequest]) -> list[AgentRequest]:
    """The host-latency probe's requests, shortest first: prompts from the main workload's
    shortest to its longest, spaced geometrically, of ids drawn from a generator of their own,
    so that no prompt shares a block with the workload or another probe (no prefix-cache hit
    in either direction). Each is a conversation of its own (ids -2, -3, ...: none of the
    workload's), arriving at 0: the caller sends them one at a time."""
    lengths = [len(r.prompt_token_ids) for r in main]
    lo, hi = min(lengths), max(lengths)
    n = HOST_PROBE_REQUESTS[0 if args.quick else 1]
    rng = random.Random(f"host-probe-{args.seed}")
    vocab = main_params(args).vocab
    out = []
    for i in range(n):
        length = round(lo * (hi / lo) ** (i / (n - 1))) if n > 1 else hi
        prompt = uniform_ids(rng, vocab, length)
        output = uniform_ids(rng, vocab, HOST_PROBE_MAX_TOKENS)
        out.append(AgentRequest(-2 - i, 0, 0.0, prompt, HOST_PROBE_MAX_TOKENS, output, prompt))
    return out
