"""The long-list path of UIntList (C-speed checks and the ring of checked tuples) accepts and
rejects exactly what the item-by-item loop does, and names the same first bad item."""

from __future__ import annotations

import pytest

from pddnet.api.parse import parse_completion_request
from pddnet.api.types import ApiError, ModelInfo
from pddnet.int_lists import all_ints_within
from pddnet.protocol import messages
from pddnet.protocol.errors import SchemaError
from pddnet.protocol.messages import (
    TOKEN_ID_MAX,
    U32_MAX,
    U64_MAX,
    UIntList,
)

LONG = 5000  # above the ring's threshold: the fast path runs


@pytest.mark.parametrize("hi", [TOKEN_ID_MAX, U32_MAX, U64_MAX, 255])
def test_all_ints_within_agrees_with_a_plain_loop(hi: int) -> None:
    ok = [min(i, hi) for i in range(LONG)] + [hi]
    assert all_ints_within(ok, hi)
    for bad in (hi + 1, -1, True, False, 1.0, "1", None):
        values = ok[:-1] + [bad]
        loop = all(type(v) is int and 0 <= v <= hi for v in values)
        assert all_ints_within(values, hi) is loop is False, bad


@pytest.mark.parametrize("bad", [-1, TOKEN_ID_MAX + 1, True, 2.0, None])
def test_a_long_list_names_its_first_bad_item(bad: object) -> None:
    values = list(range(LONG))
    values[1234] = bad
    with pytest.raises(SchemaError, match=r"ids\[1234\] must be an int in \[0, 2\^31-1\]"):
        UIntList(hi=TOKEN_ID_MAX).check("ids", values)


def test_a_checked_tuple_is_not_walked_again_but_a_tighter_bound_checks_it(monkeypatch) -> None:
    calls: list[int] = []
    real = messages.all_ints_within

    def counting(values, hi):
        calls.append(hi)
        return real(values, hi)

    monkeypatch.setattr(messages, "all_ints_within", counting)  # as messages calls it
    ids = tuple(range(300, 300 + LONG))
    out = UIntList(hi=TOKEN_ID_MAX).check("ids", ids)
    assert out is ids and calls == [TOKEN_ID_MAX]
    # a message built from that field: the same tuple, the same bound -> no second pass
    assert UIntList(hi=TOKEN_ID_MAX, min_len=1).check("ids", ids) is ids
    assert UIntList(hi=U64_MAX).check("ids", ids) is ids
    assert calls == [TOKEN_ID_MAX]
    # a tighter bound than the one it passed is checked again, and fails
    with pytest.raises(SchemaError, match=r"ids\[0\] must be an int in \[0, 255\], got int 300"):
        UIntList(hi=255).check("ids", ids)
    assert calls == [TOKEN_ID_MAX, 255]
    # the length bounds are the spec's own, even for a remembered tuple
    with pytest.raises(SchemaError):
        UIntList(hi=TOKEN_ID_MAX, max_len=LONG - 1).check("ids", ids)


def test_a_list_is_normalised_to_a_new_tuple() -> None:
    ids = list(range(LONG))
    out = UIntList().check("ids", ids)
    assert type(out) is tuple and list(out) == ids


@pytest.mark.parametrize(
    ("bad", "words"),
    [(1000, "prompt token id 1000 is outside the vocabulary [0, 1000)"), ("7", "must be integers")],
)
def test_the_api_names_a_long_prompts_bad_id_in_its_own_words(bad: object, words: str) -> None:
    model = ModelInfo("m", vocab_size=1000, max_position=1 << 20, eos_token_id=2)
    ids = [i % 1000 for i in range(LONG)]
    assert parse_completion_request(
        {"model": "m", "prompt": ids}, model, None, 16
    ).prompt_token_ids == tuple(ids)
    ids[4321] = bad
    with pytest.raises(ApiError) as err:
        parse_completion_request({"model": "m", "prompt": ids}, model, None, 16)
    assert words in str(err.value)


def test_the_engine_takes_a_long_prompt_of_ints_and_still_names_bad_ids() -> None:
    import torch

    from pddnet.engine.engine import Engine
    from pddnet.model.loader import load_model

    model, tok = load_model("tiny")
    vocab = model.config.vocab_size
    with Engine(model, tok, num_blocks=8, block_size=16) as engine:
        ids = [i % vocab for i in range(LONG)]
        assert engine._check_tokens(tuple(ids), "prompt") == ids
        # tensors and numpy-like ints go the slow way, converted to ints
        assert engine._check_tokens(torch.tensor(ids), "prompt") == ids
        for bad in (vocab, -1):
            ids[777] = bad
            with pytest.raises(
                ValueError, match=rf"outside the vocabulary \[0, {vocab}\): \[{bad}\]"
            ):
                engine._check_tokens(ids, "prompt")
