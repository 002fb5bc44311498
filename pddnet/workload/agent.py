"""Seeded multi-turn agent workload: the traffic the decode-side RadixCache is for.

An agent conversation starts from one of a few shared system prompts plus a task; every later
turn's prompt is the previous prompt + the assistant's previous output + a tool result (mostly
short, sometimes a large file or search dump). So prompts only ever grow by appending, and an
ideal prefix cache holding every finished request (prompt + generated tokens) hits all but the
new tail. With the default parameters that reproduces the source report's skew: about 90%
average prefix hit, 70-80% of requests hitting more than 95%, the rest spread over the lower
intervals by large tool outputs and first turns (pddnet.workload.hits measures it).

Each request carries the assistant output the conversation history records (``output_token_ids``,
exactly ``max_tokens`` long). A live benchmark whose model produces other tokens (with
``ignore_eos`` it produces exactly ``max_tokens``) builds turn t's prompt from what really came
back: ``follow_up_prompt(request, previous_prompt, previous_output)``; it also cannot send turn
t before turn t-1 finished, so its send time is max(arrival_s, previous turn done).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, fields


@dataclass(frozen=True)
class AgentRequest:
    conversation_id: int
    turn: int  # 0 for the first request of a conversation
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    output_token_ids: tuple[int, ...]  # the reply the history records (max_tokens long)
    appended_token_ids: tuple[int, ...]  # what this turn adds after the previous output


@dataclass(frozen=True)
class AgentWorkloadParams:
    """Lengths in tokens; defaults fit the tiny model (max_position 4096, byte vocabulary)."""

    num_conversations: int = 300
    conversation_rate_per_s: float = 4.0  # Poisson arrivals of new conversations
    think_time_s: float = 2.0  # mean gap between a turn and the next (tool + user)
    num_system_prompts: int = 4  # shared by every conversation of that agent type
    system_prompt_len: tuple[int, int] = (400, 1200)
    task_len: tuple[int, int] = (100, 600)
    max_turns: tuple[int, int] = (6, 30)  # a conversation's turn budget (uniform)
    small_tool_len: tuple[int, int] = (4, 48)
    large_tool_len: tuple[int, int] = (400, 2000)
    large_tool_prob: float = 0.18
    output_len: tuple[int, int] = (4, 32)  # max_tokens of each turn
    max_context: int = 4096  # prompt + max_tokens; the conversation ends there
    vocab: int = 256  # token ids drawn from [0, vocab)

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, tuple):
                lo, hi = v
                if not 0 < lo <= hi:
                    raise ValueError(f"{f.name} must be a range 0 < lo <= hi, got {v}")
        if self.num_conversations < 1 or self.num_system_prompts < 1:
            raise ValueError("num_conversations and num_system_prompts must be >= 1")
        if self.conversation_rate_per_s <= 0 or self.think_time_s <= 0:
            raise ValueError("conversation_rate_per_s and think_time_s must be > 0")
        if not 0.0 <= self.large_tool_prob <= 1.0:
            raise ValueError(f"large_tool_prob must be in [0, 1], got {self.large_tool_prob}")
        if self.vocab < 2:
            raise ValueError(f"vocab must be >= 2, got {self.vocab}")
        first = self.system_prompt_len[1] + self.task_len[1] + self.output_len[1]
        if first > self.max_context:
            raise ValueError(
                f"a first turn may need {first} tokens > max_context {self.max_context}"
            )


def uniform_ids(rng: random.Random, vocab: int, k: int) -> tuple[int, ...]:
    """``tuple(rng.choices(range(vocab), k=k))``: the same ids from the same draws (CPython's
    ``choices`` computes ``floor(random() * float(n))``), in a loop the simulator's compiled
    copy runs as C, where ``choices`` is interpreted Python (1-2% of a large simulation)."""
    draw = rng.random
    n = float(vocab)
    return tuple([math.floor(draw() * n) for _ in range(k)])


def generate_agent_workload(
    params: AgentWorkloadParams | None = None, seed: int = 0
) -> list[AgentRequest]:
    """Every turn of every conversation, in arrival order (a pure function of params, seed)."""
    p = params or AgentWorkloadParams()
    rng = random.Random(seed)

    def tokens(length_range: tuple[int, int]) -> tuple[int, ...]:
        return uniform_ids(rng, p.vocab, rng.randint(*length_range))

    systems = [tokens(p.system_prompt_len) for _ in range(p.num_system_prompts)]
    out: list[AgentRequest] = []
    start = 0.0
    for conv in range(p.num_conversations):
        start += rng.expovariate(p.conversation_rate_per_s)
        t = start
        appended = rng.choice(systems) + tokens(p.task_len)
        prompt = appended
        for turn in range(rng.randint(*p.max_turns)):
            output = tokens(p.output_len)
            if len(prompt) + len(output) > p.max_context:
                break  # the agent's context is full: the conversation ends
            out.append(AgentRequest(conv, turn, round(t, 6), prompt, len(output), output, appended))
            large = rng.random() < p.large_tool_prob
            appended = tokens(p.large_tool_len if large else p.small_tool_len)
            prompt = prompt + output + appended
            t += rng.expovariate(1.0 / p.think_time_s)
    out.sort(key=lambda r: (r.arrival_s, r.conversation_id, r.turn))
    return out


def follow_up_prompt(
    request: AgentRequest, previous_prompt: Sequence[int], previous_output: Sequence[int]
) -> tuple[int, ...]:
    """Turn t's prompt built from what turn t-1 really was (a live run's model output)."""
    if request.turn == 0:
        return request.prompt_token_ids
    return tuple(previous_prompt) + tuple(previous_output) + request.appended_token_ids
