"""How much of a workload an ideal prefix cache would hit: the agent workload's yardstick.

``ideal_hit_ratios`` measures each request against an unlimited RadixCache; ``hit_distribution``
bins the ratios in the source report's seven intervals; ``token_weighted_hit`` is the share of
prompt tokens hit over the run.
"""

from __future__ import annotations

from collections.abc import Sequence

from pddnet.kv.allocator import BlockAllocator
from pddnet.kv.hit_histogram import HIT_INTERVAL_LABELS, hit_interval
from pddnet.kv.radix import RadixCache
from pddnet.workload.agent import AgentRequest


def ideal_hit_ratios(requests: Sequence[AgentRequest], block_size: int = 16) -> list[float]:
    """Per request (in the given order) the prefix hit ratio against an unlimited RadixCache
    that holds every earlier request's KV (prompt + output but its last token, which is sampled,
    never computed) and matches like MD (whole blocks, never the block of the last token)."""
    need = sum(-(-(len(r.prompt_token_ids) + r.max_tokens) // block_size) for r in requests)
    cache = RadixCache(BlockAllocator(max(need, 1)), block_size)
    ratios = []
    for r in requests:
        prompt = r.prompt_token_ids
        m = cache.match_prefix(prompt, max_blocks=(len(prompt) - 1) // block_size)
        cache.lock(m.handle)
        ratios.append(m.hit_tokens / len(prompt))
        with_kv = prompt + r.output_token_ids[:-1]
        table = list(m.block_ids) + cache.allocate(
            -(-len(with_kv) // block_size) - len(m.block_ids)
        )
        cache.insert_finished(with_kv, table)
    return ratios


def hit_distribution(ratios: Sequence[float]) -> dict[str, float]:
    """Fraction of requests in each of the source's seven hit intervals (0-20% ... 95-100%)."""
    if not ratios:
        raise ValueError("no hit ratios to bin")
    counts = [0] * len(HIT_INTERVAL_LABELS)
    for r in ratios:
        counts[hit_interval(r)] += 1
    return {label: c / len(ratios) for label, c in zip(HIT_INTERVAL_LABELS, counts, strict=True)}


def token_weighted_hit(requests: Sequence[AgentRequest], ratios: Sequence[float]) -> float:
    """Hit tokens / prompt tokens over the run: 1 - this is the share of KV that must cross."""
    total = sum(len(r.prompt_token_ids) for r in requests)
    hit = sum(round(x * len(r.prompt_token_ids)) for r, x in zip(requests, ratios, strict=True))
    return hit / total
