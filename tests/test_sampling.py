"""Sampler: greedy ties, top-k/top-p support, randomness a pure function of (seed, position)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet.engine.sampling import SamplingParams, sample_batch, sample_token, uniform_for


def probs_to_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float64)


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> Counter[int]:
    return Counter(sample_token(logits, params, pos) for pos in range(n))


@pytest.mark.parametrize(("params", "message"), [
    (SamplingParams(temperature=-0.1), r"temperature must be a finite number >= 0, got -0.1"),
    (SamplingParams(temperature=float("nan")), r"temperature must be a finite number >= 0"),
    (SamplingParams(temperature=float("inf")), r"temperature must be a finite number >= 0"),
    (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
    (SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
    (SamplingParams(top_k=-1), r"top_k must be an integer >= 0 \(0 = no limit\), got -1"),
    (SamplingParams(top_k=2.5), r"top_k must be an integer >= 0"),  # type: ignore[arg-type]
    (SamplingParams(seed=-3), r"seed must be None or an integer in \[0, 2\*\*64\), got -3"),
    (SamplingParams(seed=2**64), r"seed must be None or an integer in \[0, 2\*\*64\)"),
])
def test_validation_errors(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate()
    with pytest.raises(ValueError, match=message):
        sample_token(torch.zeros(4), params, 0)


def test_valid_params_pass() -> None:
    for params in (SamplingParams(), SamplingParams(1.0, 0.9, 5, 7), SamplingParams(top_p=1)):
        params.validate()


def test_other_errors() -> None:
    with pytest.raises(ValueError, match="temperature > 0 needs a seed"):
        sample_token(torch.zeros(4), SamplingParams(temperature=1.0), 0)
    with pytest.raises(ValueError, match=r"logits must be a non-empty 1-D \[vocab\] tensor"):
        sample_token(torch.zeros(2, 4), SamplingParams(), 0)
    with pytest.raises(ValueError, match="logits contain NaN"):
        sample_token(torch.tensor([0.0, float("nan")]), SamplingParams(), 0)
    with pytest.raises(ValueError, match="position must be >= 0, got -1"):
        sample_token(torch.zeros(4), SamplingParams(), -1)
    with pytest.raises(ValueError, match="must agree on B"):
        sample_batch(torch.zeros(2, 4), [SamplingParams()], [0, 1])


def test_greedy_takes_lowest_id_on_ties() -> None:
    logits = torch.tensor([0.0, 3.0, 1.0, 3.0, 3.0])
    assert sample_token(logits, SamplingParams(), 0) == 1
    assert sample_batch(torch.stack([logits, logits.flip(0)]), [SamplingParams()] * 2,
                        [0, 1]) == [1, 0]


def test_same_seed_and_position_same_token_different_positions_vary() -> None:
    logits = torch.randn(259, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    params = SamplingParams(temperature=1.5, seed=42)
    first = [sample_token(logits, params, pos) for pos in range(64)]
    torch.manual_seed(999)  # global RNG state must not matter
    again = [sample_token(logits.clone(), params, pos) for pos in range(64)]
    assert first == again
    assert len(set(first)) > 10
    other_seed = [sample_token(logits, SamplingParams(1.5, seed=43), pos) for pos in range(64)]
    assert other_seed != first
    # float32 logits with the same values give the same tokens
    assert [sample_token(logits.float().double(), params, p) for p in range(64)] == [
        sample_token(logits.float(), params, p) for p in range(64)]


def test_top_k_restricts_support() -> None:
    logits = torch.tensor([0.1, 2.0, 0.3, 1.9, 1.8, 0.0], dtype=torch.float64)
    seen = draws(logits, SamplingParams(temperature=3.0, top_k=3, seed=1))
    assert set(seen) == {1, 3, 4}
    assert set(draws(logits, SamplingParams(temperature=3.0, top_k=1, seed=1))) == {1}
    assert set(draws(logits, SamplingParams(temperature=3.0, top_k=100, seed=1))) == set(range(6))


def test_top_k_boundary_ties_keep_lowest_ids() -> None:
    logits = torch.tensor([1.0, 1.0, 1.0, 0.0])
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=2, seed=5))) == {0, 1}
    flat = torch.zeros(5000)
    assert set(draws(flat, SamplingParams(temperature=1.0, top_k=10, seed=5))) == set(range(10))


def test_top_p_keeps_smallest_nucleus() -> None:
    logits = probs_to_logits([0.05, 0.5, 0.15, 0.3])
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.75, seed=2))) == {1, 3}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.85, seed=2))) == {1, 2, 3}
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.4, seed=2))) == {1}
    # exactly at the boundary: one of two equal tokens already reaches top_p = 0.5
    assert set(draws(torch.zeros(2), SamplingParams(temperature=1.0, top_p=0.5, seed=2))) == {0}
    both = SamplingParams(temperature=1.0, top_k=2, top_p=0.99, seed=2)  # top-k applies first
    assert set(draws(logits, both)) == {1, 3}


def test_draw_frequencies_follow_probabilities() -> None:
    logits = probs_to_logits([0.75, 0.25])
    counts = draws(logits, SamplingParams(temperature=1.0, seed=11), n=4000)
    assert abs(counts[0] / 4000 - 0.75) < 0.03
    # temperature sharpens: at T=0.5 the odds 3:1 become 9:1
    counts = draws(logits, SamplingParams(temperature=0.5, seed=11), n=4000)
    assert abs(counts[0] / 4000 - 0.9) < 0.03


def test_uniform_is_in_unit_interval_and_spread() -> None:
    values = [uniform_for(7, pos) for pos in range(2000)]
    assert all(0.0 <= u < 1.0 for u in values)
    assert abs(sum(values) / len(values) - 0.5) < 0.03
    assert uniform_for(7, 3) == uniform_for(7, 3) != uniform_for(8, 3)


def test_sample_batch_mixes_greedy_and_random_rows() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    params = [SamplingParams(), SamplingParams(1.0, 0.9, 10, seed=4), SamplingParams(0.7, seed=9)]
    positions = [5, 17, 2]
    assert sample_batch(logits, params, positions) == [
        sample_token(row, p, pos) for row, p, pos in zip(logits, params, positions, strict=True)]


finite = st.floats(min_value=-30, max_value=30, allow_nan=False)
params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=5.0)),
    top_p=st.floats(min_value=1e-3, max_value=1.0),
    top_k=st.integers(min_value=0, max_value=20),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
)


@settings(max_examples=150, deadline=None)
@given(values=st.lists(finite, min_size=1, max_size=40), params=params_strategy,
       position=st.integers(min_value=0, max_value=2**40), noise=st.integers(0, 2**31))
def test_sample_token_is_a_pure_function(values: list[float], params: SamplingParams,
                                         position: int, noise: int) -> None:
    logits = torch.tensor(values, dtype=torch.float64)
    first = sample_token(logits, params, position)
    torch.manual_seed(noise)  # perturb any global state between calls
    torch.rand(3)
    sample_token(torch.tensor(values[::-1], dtype=torch.float64), params, position + 1)
    assert sample_token(torch.tensor(values, dtype=torch.float64), params, position) == first
    assert 0 <= first < len(values)
    if params.temperature == 0 or params.top_k == 1:
        assert first == values.index(max(values))
    elif params.top_k:
        # the chosen token ranks within the top k (ties ranked by lower id)
        better = sum(1 for i, v in enumerate(values) if v > values[first] or
                     (v == values[first] and i < first))
        assert better < params.top_k
