"""Sampler: greedy ties, top-k/top-p support, randomness a pure function of (seed, position)."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet.engine.sampling import (
    SamplingParams,
    choice_seed,
    process_logits,
    sample_batch,
    sample_token,
    token_logprob,
    uniform_for,
)


def probs_to_logits(probs: list[float]) -> torch.Tensor:
    return torch.tensor([math.log(p) for p in probs], dtype=torch.float64)


def draws(logits: torch.Tensor, params: SamplingParams, n: int = 400) -> Counter[int]:
    return Counter(sample_token(logits, params, pos) for pos in range(n))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(temperature=-0.1), r"temperature must be a finite number >= 0, got -0.1"),
        (SamplingParams(temperature=float("nan")), r"temperature must be a finite number >= 0"),
        (SamplingParams(temperature=float("inf")), r"temperature must be a finite number >= 0"),
        (SamplingParams(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0"),
        (SamplingParams(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5"),
        (SamplingParams(top_k=-1), r"top_k must be an integer >= 0 \(0 = no limit\), got -1"),
        (SamplingParams(top_k=2.5), r"top_k must be an integer >= 0"),  # type: ignore[arg-type]
        (SamplingParams(seed=-3), r"seed must be None or an integer in \[0, 2\*\*64\), got -3"),
        (SamplingParams(seed=2**64), r"seed must be None or an integer in \[0, 2\*\*64\)"),
    ],
)
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
    assert sample_batch(torch.stack([logits, logits.flip(0)]), [SamplingParams()] * 2, [0, 1]) == [
        1,
        0,
    ]


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
        sample_token(logits.float(), params, p) for p in range(64)
    ]


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
        sample_token(row, p, pos) for row, p, pos in zip(logits, params, positions, strict=True)
    ]


finite = st.floats(min_value=-30, max_value=30, allow_nan=False)
params_strategy = st.builds(
    SamplingParams,
    temperature=st.one_of(st.just(0.0), st.floats(min_value=1e-3, max_value=5.0)),
    top_p=st.floats(min_value=1e-3, max_value=1.0),
    top_k=st.integers(min_value=0, max_value=20),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
)


@settings(max_examples=150, deadline=None)
@given(
    values=st.lists(finite, min_size=1, max_size=40),
    params=params_strategy,
    position=st.integers(min_value=0, max_value=2**40),
    noise=st.integers(0, 2**31),
)
def test_sample_token_is_a_pure_function(
    values: list[float], params: SamplingParams, position: int, noise: int
) -> None:
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
        better = sum(
            1
            for i, v in enumerate(values)
            if v > values[first] or (v == values[first] and i < first)
        )
        assert better < params.top_k


# -- vLLM's logits processing: penalties and min_tokens (issue 24) ------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits() -> None:
    logits = torch.tensor([2.0, -1.0, 3.0, -2.0, 1.0], dtype=torch.float64)
    p = SamplingParams(repetition_penalty=2.0)
    # token 0 in the prompt, token 1 in the output, 3 in both; 2 and 4 unseen
    out = process_logits(logits, p, prompt_ids=[0, 3], output_ids=[1, 3, 3])
    assert out.tolist() == [1.0, -2.0, 3.0, -4.0, 1.0]
    assert logits.tolist() == [2.0, -1.0, 3.0, -2.0, 1.0]  # the input is not changed


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    logits = torch.zeros(4, dtype=torch.float64)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = process_logits(logits, p, prompt_ids=[0, 0, 0], output_ids=[1, 2, 2, 2])
    assert out.tolist() == [0.0, -0.75, -1.75, 0.0]
    # negative values reward repetition (OpenAI's range is [-2, 2])
    assert process_logits(logits, SamplingParams(presence_penalty=-1.0), [], [3]).tolist() == [
        0.0,
        0.0,
        0.0,
        1.0,
    ]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached() -> None:
    logits = torch.tensor([0.0, 5.0, 4.0, 1.0], dtype=torch.float64)
    p = SamplingParams(min_tokens=3, stop_token_ids=(2,))
    masked = process_logits(logits, p, [0], [3, 3], eos_token_id=1)
    assert masked[1] == masked[2] == -math.inf and masked[3] == 1.0
    assert sample_batch(logits[None], [p], [5], [([0], [3, 3])], eos_token_id=1) == [3]
    # the third output exists: nothing is masked any more
    assert sample_batch(logits[None], [p], [6], [([0], [3, 3, 3])], eos_token_id=1) == [1]
    # seeded sampling never draws a masked token either
    hot = SamplingParams(temperature=5.0, seed=3, min_tokens=1, stop_token_ids=(2,))
    draws_ = {sample_batch(logits[None], [hot], [pos], [([0], [])], 1)[0] for pos in range(300)}
    assert draws_ == {0, 3}


def test_penalties_apply_to_greedy_and_need_the_history() -> None:
    logits = torch.tensor([1.0, 0.9, 0.0], dtype=torch.float64)
    p = SamplingParams(frequency_penalty=0.2)
    assert sample_batch(logits[None], [p], [9], [([], [0])]) == [1]
    with pytest.raises(ValueError, match="need each row's token history"):
        sample_batch(logits[None], [p], [9])
    assert sample_batch(logits[None], [SamplingParams()], [9]) == [0]  # unchanged without


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(min_tokens=-1), r"min_tokens must be an integer >= 0"),
        (SamplingParams(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\]"),
        (SamplingParams(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\]"),
        (SamplingParams(repetition_penalty=0.0), r"repetition_penalty must be in \(0, 100\]"),
        (SamplingParams(logprobs=21), r"logprobs must be None or an integer in \[0, 20\]"),
        (SamplingParams(stop_token_ids=(-1,)), r"stop_token_ids must be a sequence"),
    ],
)
def test_extension_validation_errors(params: SamplingParams, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        params.validate()


def test_token_logprob_is_raw_log_softmax_with_ranked_top_k() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 0.5], dtype=torch.float64)
    entry = token_logprob(logits, 3, 3)
    logp = torch.log_softmax(logits, -1)
    assert entry.token_id == 3 and entry.logprob == float(logp[3])
    assert entry.top_ids == (1, 2, 0)  # ties: lower id first
    assert entry.top_logprobs == tuple(float(logp[i]) for i in (1, 2, 0))
    assert token_logprob(logits, 0, 0).top_ids == ()
    floor = token_logprob(torch.tensor([0.0, -1e6], dtype=torch.float64), 1, 1)
    assert floor.logprob == -9999.0  # what vLLM reports for -inf


def test_choice_seeds_follow_vllm_and_the_router_agrees() -> None:
    from pddnet.roles.router import choice_seed as router_choice_seed

    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(2**64 - 1, 1) == 0
    for seed, i in ((0, 0), (123, 5), (2**64 - 2, 3)):
        assert router_choice_seed(seed, i) == choice_seed(seed, i)


def test_engine_min_tokens_and_stop_token_ids_match_a_hand_driven_loop() -> None:
    from pddnet.engine.engine import Engine
    from pddnet.model.loader import load_model

    model, tok = load_model("tiny")
    prompt = [256] + list(b"penalties and min tokens")
    params = SamplingParams(
        temperature=1.2,
        seed=4,
        min_tokens=20,
        stop_token_ids=(101, 32),
        repetition_penalty=1.5,
        presence_penalty=0.5,
    )
    engine = Engine(model, tok, num_blocks=64, block_size=16)
    out = engine.generate(prompt, 60, params)
    assert len(out) >= 20
    assert not {101, 32, tok.eos_token_id} & set(out[:19])
    assert out[-1] in (101, 32, tok.eos_token_id) or len(out) == 60
    # the same tokens from a step-by-step recomputation of every position
    ids = list(prompt)
    for i, t in enumerate(out):
        logits = model(torch.tensor(ids), torch.arange(len(ids)), _full_attention)[-1]
        row = process_logits(logits, params, prompt, ids[len(prompt) :], tok.eos_token_id)
        assert sample_token(row, params, len(ids)) == t, i
        ids.append(t)
    engine.close()


def _full_attention(layer, q, k, v):
    from pddnet.model.attention import causal_attention

    return causal_attention(q, k, v, 0)
