"""Seeded long prompts at Poisson arrivals: the same prompts and times for every system."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    arrival_s: float  # offset from the start of the run
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def poisson_long_prompts(
    n: int,
    rate_per_s: float,
    prompt_len: tuple[int, int],
    max_tokens: tuple[int, int],
    seed: int = 0,
    vocab: int = 256,
) -> list[BenchRequest]:
    """`n` requests with Poisson arrivals, uniform prompt and output lengths in the given ranges."""
    if n < 1 or rate_per_s <= 0:
        raise ValueError("need n >= 1 and rate_per_s > 0")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        length = rng.randint(*prompt_len)
        prompt = tuple(rng.randrange(vocab) for _ in range(length))
        out.append(BenchRequest(round(t, 6), prompt, rng.randint(*max_tokens)))
        t += rng.expovariate(rate_per_s)
    return out
