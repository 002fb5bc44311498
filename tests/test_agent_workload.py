"""The seeded multi-turn agent workload: structure, determinism and the source's hit skew."""

from __future__ import annotations

import random
import statistics

import pytest

from pddnet.kv.hit_histogram import HIT_INTERVAL_LABELS
from pddnet.workload.agent import (
    AgentWorkloadParams,
    follow_up_prompt,
    generate_agent_workload,
    uniform_ids,
)
from pddnet.workload.hits import hit_distribution, ideal_hit_ratios, token_weighted_hit

PARAMS = AgentWorkloadParams(num_conversations=200)


@pytest.fixture(scope="module")
def workload():
    reqs = generate_agent_workload(PARAMS, seed=7)
    return reqs, ideal_hit_ratios(reqs, block_size=16)


def test_turns_append_to_the_previous_prompt_and_output(workload):
    reqs, _ = workload
    assert len(reqs) >= 2000
    assert [r.arrival_s for r in reqs] == sorted(r.arrival_s for r in reqs)
    by_conv: dict[int, list] = {}
    for r in reqs:
        by_conv.setdefault(r.conversation_id, []).append(r)
        assert len(r.output_token_ids) == r.max_tokens >= 1
        assert len(r.prompt_token_ids) + r.max_tokens <= PARAMS.max_context
        assert all(0 <= t < PARAMS.vocab for t in r.appended_token_ids)
    assert len(by_conv) == PARAMS.num_conversations
    for turns in by_conv.values():
        assert [r.turn for r in turns] == list(range(len(turns)))
        for prev, cur in zip(turns, turns[1:], strict=False):
            assert cur.arrival_s > prev.arrival_s
            assert cur.prompt_token_ids == (
                prev.prompt_token_ids + prev.output_token_ids + cur.appended_token_ids
            )
            assert (
                follow_up_prompt(cur, prev.prompt_token_ids, prev.output_token_ids)
                == cur.prompt_token_ids
            )
    # first turns share one of a few system prompts
    heads = {r.prompt_token_ids[: PARAMS.system_prompt_len[0]] for r in reqs if r.turn == 0}
    assert len(heads) <= PARAMS.num_system_prompts


def test_same_seed_same_workload_other_seed_other_workload():
    small = AgentWorkloadParams(num_conversations=5)
    assert generate_agent_workload(small, 3) == generate_agent_workload(small, 3)
    assert generate_agent_workload(small, 3) != generate_agent_workload(small, 4)


def test_hit_distribution_reproduces_the_source_skew(workload):
    reqs, ratios = workload
    dist = hit_distribution(ratios)
    assert list(dist) == list(HIT_INTERVAL_LABELS)
    assert sum(dist.values()) == pytest.approx(1.0)
    mean = statistics.mean(ratios)
    assert 0.86 <= mean <= 0.94, mean  # "about 90% average prefix hit"
    assert 0.70 <= dist["95-100%"] <= 0.80, dist  # "70-80% of requests hit > 95%"
    assert token_weighted_hit(reqs, ratios) >= 0.885  # >= ~9x fewer WAN KV bytes, ideally
    assert sum(dist[k] for k in HIT_INTERVAL_LABELS[:4]) >= 0.1  # a real low-hit tail
    first = [x for r, x in zip(reqs, ratios, strict=True) if r.turn == 0]
    later = [x for r, x in zip(reqs, ratios, strict=True) if r.turn > 0]
    assert statistics.mean(first) < 0.8 < statistics.mean(later)


def test_ideal_cache_hits_exactly_the_previous_turn_when_nothing_is_shared():
    p = AgentWorkloadParams(
        num_conversations=1, num_system_prompts=1, max_turns=(3, 3), large_tool_prob=0.0
    )
    reqs = generate_agent_workload(p, seed=1)
    ratios = ideal_hit_ratios(reqs, block_size=16)
    assert ratios[0] == 0.0
    for prev, cur, x in zip(reqs, reqs[1:], ratios[1:], strict=False):
        with_kv = len(prev.prompt_token_ids) + prev.max_tokens - 1
        limit = (len(cur.prompt_token_ids) - 1) // 16
        assert round(x * len(cur.prompt_token_ids)) == min(with_kv // 16, limit) * 16


@pytest.mark.parametrize(
    ("params", "error"),
    [
        ({"max_context": 100}, "max_context"),
        ({"large_tool_prob": 1.5}, "large_tool_prob"),
        ({"output_len": (5, 2)}, "range"),
    ],
)
def test_bad_parameters_are_refused(params, error):
    with pytest.raises(ValueError, match=error):
        AgentWorkloadParams(**params)


def test_no_requests_have_no_hit_distribution():
    with pytest.raises(ValueError, match="no hit ratios"):
        hit_distribution([])


def test_uniform_ids_are_the_draws_of_random_choices() -> None:
    for vocab in (1, 7, 32000, 1 << 40):
        a, b = random.Random(vocab), random.Random(vocab)
        for k in (0, 1, 5, 300):
            assert uniform_ids(a, vocab, k) == tuple(b.choices(range(vocab), k=k))
        assert a.random() == b.random()  # the generators stayed in step
