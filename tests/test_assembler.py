"""The router's stream assembler: any interleaving of token events from any producers gives the
client every index once and in order, or an explicit error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pddnet.lifecycle.assembler import StreamAssembler

EOS = 257


def _events(tokens: list[int], cuts: list[int], producers: list[str]) -> list[tuple]:
    """Split `tokens` into consecutive events at `cuts`."""
    bounds = sorted({0, len(tokens), *[c for c in cuts if 0 < c < len(tokens)]})
    return [
        (a, tokens[a:b], producers[i % len(producers)])
        for i, (a, b) in enumerate(zip(bounds, bounds[1:], strict=False))
    ]


def _run(asm: StreamAssembler, events: list[tuple]) -> list[int]:
    out: list[int] = []
    for index, toks, producer in events:
        rel = asm.feed_tokens(index, toks, producer, now=float(index))
        if rel is not None:
            assert rel.start == len(out), "released runs must be contiguous"
            out += rel.token_ids
    return out


token_lists = st.lists(st.integers(0, 255), min_size=1, max_size=40)


@settings(max_examples=300, deadline=None)
@given(tokens=token_lists, cuts=st.lists(st.integers(0, 40), max_size=10), data=st.data())
def test_any_interleaving_gives_in_order_exactly_once(tokens, cuts, data):
    events = _events(tokens, cuts, ["relay", "main_decode"])
    order = data.draw(st.permutations(events))
    asm = StreamAssembler(max_tokens=len(tokens), eos_token_id=EOS)
    out = _run(asm, order)
    assert out == tokens
    assert asm.tokens == tokens
    assert asm.finish_reason == "length"
    assert sum(asm.counts_by_producer().values()) == len(tokens)


@settings(max_examples=300, deadline=None)
@given(tokens=token_lists, cuts=st.lists(st.integers(0, 40), max_size=10), data=st.data())
def test_duplicates_are_dropped_when_lenient_and_errors_when_strict(tokens, cuts, data):
    events = _events(tokens, cuts, ["relay", "main_decode"])
    dup = data.draw(st.lists(st.sampled_from(events), min_size=1, max_size=4))
    order = data.draw(st.permutations(events + dup))
    lenient = StreamAssembler(max_tokens=len(tokens), eos_token_id=EOS, strict=False)
    out = _run(lenient, order)
    assert out == tokens and lenient.finish_reason == "length"

    strict = StreamAssembler(max_tokens=len(tokens) + 1, eos_token_id=EOS)
    out = _run(strict, order)
    # A duplicate is an error unless it came after the stream had already ended.
    assert strict.finish_reason == "error"
    assert "produced twice" in strict.error
    assert out == tokens[: len(out)]  # what was released before the error is still right


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 255), min_size=2, max_size=30), data=st.data())
def test_conflicting_token_is_an_error(tokens, data):
    i = data.draw(st.integers(0, len(tokens) - 1))
    other = (tokens[i] + 1) % 256
    events = [(j, [t], "relay") for j, t in enumerate(tokens)] + [(i, [other], "main_decode")]
    order = data.draw(st.permutations(events))
    asm = StreamAssembler(max_tokens=len(tokens) + 5, eos_token_id=EOS, strict=False)
    out = _run(asm, order)
    assert asm.finish_reason == "error"
    assert f"conflict at token index {i}" in asm.error
    # Whichever of the two arrived first may have been released; nothing else differs.
    assert len(out) <= len(tokens)
    assert all(out[j] == tokens[j] or (j == i and out[j] == other) for j in range(len(out)))


@settings(max_examples=200, deadline=None)
@given(tokens=token_lists, eos_at=st.integers(0, 39), data=st.data())
def test_eos_ends_the_stream_and_later_tokens_are_never_released(tokens, eos_at, data):
    eos_at = min(eos_at, len(tokens) - 1)
    tokens = tokens[:eos_at] + [EOS] + tokens[eos_at + 1 :]
    events = [(j, [t], "relay") for j, t in enumerate(tokens)]
    asm = StreamAssembler(max_tokens=len(tokens) + 3, eos_token_id=EOS)
    out = _run(asm, data.draw(st.permutations(events)))
    assert out == tokens[: eos_at + 1]
    assert asm.finish_reason == "eos"


def test_ignore_eos_and_stop_tokens():
    asm = StreamAssembler(max_tokens=5, eos_token_id=EOS, ignore_eos=True, stop_token_ids=[7])
    assert asm.feed_tokens(0, [1, EOS, 2], "relay").token_ids == [1, EOS, 2]
    assert not asm.finished
    asm.feed_tokens(3, [7, 9], "main_decode")
    assert asm.tokens == [1, EOS, 2, 7] and asm.finish_reason == "stop"
    assert asm.warnings  # index 4 came after the stop token


def test_request_done_waits_for_the_gap_then_ends():
    asm = StreamAssembler(max_tokens=10, eos_token_id=EOS)
    asm.feed_tokens(0, [1, 2], "relay")
    asm.feed_tokens(4, [5], "main_decode")
    asm.feed_done("length", 5, "main_decode")
    assert not asm.finished and asm.next_index == 2
    asm.feed_tokens(2, [3, 4], "relay")
    assert asm.tokens == [1, 2, 3, 4, 5] and asm.finish_reason == "length"
    assert asm.counts_by_producer() == {"relay": 4, "main_decode": 1}


def test_request_done_contradicting_tokens_is_an_error():
    asm = StreamAssembler(max_tokens=10, eos_token_id=EOS)
    asm.feed_tokens(0, [1, 2, 3], "relay")
    asm.feed_done("length", 2, "relay")
    assert asm.finish_reason == "error" and "already released" in asm.error
    asm = StreamAssembler(max_tokens=10, eos_token_id=EOS)
    asm.feed_tokens(5, [1], "main_decode")
    asm.feed_done("eos", 3, "main_decode")
    assert asm.finish_reason == "error" and "index 5 was produced" in asm.error
    asm = StreamAssembler(max_tokens=10, eos_token_id=EOS)
    asm.feed_done("eos", 3, "main_decode")
    asm.feed_tokens(2, [1, 2], "main_decode")
    assert asm.finish_reason == "error" and "after REQUEST_DONE" in asm.error


def test_beyond_max_tokens_cancel_and_error():
    asm = StreamAssembler(max_tokens=3, eos_token_id=EOS)
    asm.feed_tokens(2, [1, 2], "relay")
    assert asm.finish_reason == "error" and "max_tokens is 3" in asm.error
    asm = StreamAssembler(max_tokens=3)
    asm.feed_tokens(0, [1], "relay", now=12.5)
    assert asm.first_token_time == 12.5
    asm.cancel()
    assert asm.finish_reason == "cancel"
    assert asm.feed_tokens(1, [2], "relay") is None and asm.late_events == 1
    asm = StreamAssembler(max_tokens=3)
    asm.feed_done("error", 0, "main_decode")
    assert asm.finish_reason == "error"
    with pytest.raises(ValueError, match="max_tokens"):
        StreamAssembler(max_tokens=0)
    with pytest.raises(ValueError, match="unknown end reason"):
        StreamAssembler(max_tokens=2).feed_done("bored", 1, "relay")


def test_event_is_refused_whole():
    asm = StreamAssembler(max_tokens=10, strict=False)
    asm.feed_tokens(2, [3, 4], "relay")
    asm.feed_tokens(1, [2, 9], "main_decode")  # index 2 conflicts: nothing of it is placed
    assert asm.finish_reason == "error" and asm.tokens == []


def test_stop_at_ends_the_stream_where_the_caller_saw_a_stop_string():
    asm = StreamAssembler(max_tokens=50, eos_token_id=EOS)
    asm.feed_tokens(0, [1, 2, 3, 4], "relay")
    asm.feed_tokens(6, [7], "main_decode")  # pending, never released now
    with pytest.raises(ValueError, match="outside the 4 released tokens"):
        asm.stop_at(5)
    asm.stop_at(3)
    assert asm.finished and asm.finish_reason == "stop" and asm.tokens == [1, 2, 3]
    assert asm.producers == ["relay"] * 3 and asm.num_pending == 0
    assert asm.feed_tokens(4, [5, 6], "relay") is None and asm.late_events == 1
    # the daemons were told to stop: their own counts are no inconsistency
    asm.feed_done("length", 50, "main_decode")
    assert asm.warnings == [] and asm.tokens == [1, 2, 3]
    asm.stop_at(1)  # no-op once finished
    assert asm.tokens == [1, 2, 3]
