"""The colocated reference engine: exactness against a naive loop, batching, prefix reuse, cleanup."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from pddnet.engine.engine import Engine
from pddnet.engine.sampling import SamplingParams, sample_token
from pddnet.engine.sequence import FinishReason
from pddnet.kv.allocator import OutOfBlocks
from pddnet.kv.shm import unique_segment_name
from pddnet.model.attention import causal_attention
from pddnet.model.loader import load_model


@pytest.fixture(scope="module")
def tiny():
    model, tok = load_model("tiny")
    return model, tok


def _prompt(tok, text: str) -> list[int]:
    return tok.encode(text, add_bos=True)


def naive(model, prompt: list[int], n: int, sampling: SamplingParams | None = None) -> list[int]:
    """Full recompute every token: no cache at all, one sequence, attention over everything."""
    sampling = sampling or SamplingParams()
    tokens = list(prompt)

    def attention(layer, q, k, v):
        return causal_attention(q, k, v, q_offset=0)

    for _ in range(n):
        ids = torch.tensor(tokens)
        logits = model(ids, torch.arange(len(tokens)), attention, torch.tensor([len(tokens) - 1]))
        tokens.append(sample_token(logits[0], sampling, len(tokens)))
    return tokens[len(prompt) :]


def _free_all(engine: Engine) -> None:
    assert engine.num_available_blocks == engine.num_blocks
    assert engine.blocks.claimed == 0
    if engine.prefix_cache is not None:
        engine.prefix_cache.clear()
    assert engine.allocator.num_free == engine.num_blocks


def test_same_prompt_twice_gives_identical_non_degenerate_tokens(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=64, block_size=4)
    prompt = _prompt(tok, "The quick brown fox")
    a = engine.generate(prompt, 24, ignore_eos=True)
    b = engine.generate(prompt, 24, ignore_eos=True)
    assert a == b and len(a) == 24
    assert len(set(a)) > 6  # not one token repeated


@pytest.mark.parametrize(
    "block_size, budget, prefix", [(4, 2048, True), (16, 5, False), (3, 7, True)]
)
def test_engine_equals_naive_full_recompute(tiny, block_size, budget, prefix):
    model, tok = tiny
    engine = Engine(
        model,
        tok,
        num_blocks=80,
        block_size=block_size,
        max_num_batched_tokens=budget,
        enable_prefix_cache=prefix,
    )
    for text in ("hi", "Attention is all you need, they said."):
        prompt = _prompt(tok, text)
        assert engine.generate(prompt, 12, ignore_eos=True) == naive(model, prompt, 12)
    _free_all(engine)


def test_seeded_sampling_equals_naive_and_depends_only_on_seed_and_position(tiny):
    model, tok = tiny
    prompt = _prompt(tok, "Once upon a time")
    sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=1234)
    engine = Engine(model, tok, num_blocks=64, block_size=4, max_num_batched_tokens=6)
    out = engine.generate(prompt, 16, sp, ignore_eos=True)
    assert out == naive(model, prompt, 16, sp)
    assert out != engine.generate(
        prompt, 16, SamplingParams(temperature=0.9, seed=99), ignore_eos=True
    )


def test_sampling_state_moved_to_a_fresh_engine_halfway_gives_the_same_tokens(tiny):
    model, tok = tiny
    prompt = _prompt(tok, "Sampling must survive a move")
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    whole = Engine(model, tok, num_blocks=64, block_size=4).generate(
        prompt, 20, sp, ignore_eos=True
    )
    first = Engine(model, tok, num_blocks=64, block_size=4).generate(prompt, 9, sp, ignore_eos=True)
    fresh = Engine(model, tok, num_blocks=64, block_size=16, max_num_batched_tokens=8)
    rest = fresh.generate(prompt + first, 11, sp, ignore_eos=True)
    assert first + rest == whole


def test_unseeded_sampling_gets_a_concrete_seed_at_admission(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=64, block_size=4)
    prompt = _prompt(tok, "seedless")
    rid = engine.add_request(prompt, 10, SamplingParams(temperature=0.8), ignore_eos=True)
    seed = engine.get_sequence(rid).sampling.seed
    assert isinstance(seed, int)
    out = []
    while engine.has_request(rid):
        for o in engine.step():
            out += o.new_token_ids
    assert out == engine.generate(
        prompt, 10, SamplingParams(temperature=0.8, seed=seed), ignore_eos=True
    )


def test_continuous_batching_equals_each_request_alone(tiny):
    model, tok = tiny
    texts = ["a", "Hello there, general", "x" * 37, "The rain in Spain", "0123456789" * 5]
    lengths = [5, 13, 3, 20, 9]
    samplings = [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=5),
        SamplingParams(),
        SamplingParams(temperature=1.2, top_k=10, seed=11),
        SamplingParams(),
    ]
    requests = list(zip(texts, lengths, samplings, strict=True))
    alone = [
        Engine(model, tok, num_blocks=64, block_size=4).generate(
            _prompt(tok, t), n, sp, ignore_eos=True
        )
        for t, n, sp in requests
    ]

    engine = Engine(
        model, tok, num_blocks=96, block_size=4, max_num_batched_tokens=16, max_num_seqs=3
    )
    got: dict[str, list[int]] = {}
    ids = []
    for t, n, sp in requests[:3]:
        ids.append(engine.add_request(_prompt(tok, t), n, sp, ignore_eos=True))
    steps = 0
    max_batch = 0
    while engine.has_work():
        outs = engine.step()
        max_batch = max(max_batch, len(outs))
        assert engine.last_step.num_tokens <= 16
        for o in outs:
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
        steps += 1
        if steps == 3:  # late arrivals join a running batch
            for t, n, sp in requests[3:]:
                ids.append(engine.add_request(_prompt(tok, t), n, sp, ignore_eos=True))
        assert steps < 500
    assert [got[i] for i in ids] == alone
    assert max_batch == 3  # really batched, and max_num_seqs respected
    _free_all(engine)


def test_prefix_cache_second_request_computes_only_the_new_part(tiny):
    model, tok = tiny
    shared = _prompt(tok, "You are a helpful assistant. Answer briefly and precisely. ")
    p1 = shared + tok.encode("What is 2+2?", add_bos=False)
    p2 = shared + tok.encode("Name a colour.", add_bos=False)
    bs = 4
    engine = Engine(model, tok, num_blocks=128, block_size=bs)
    engine.generate(p1, 6, ignore_eos=True)
    before = engine.num_computed_tokens_total
    rid = engine.add_request(p2, 6, ignore_eos=True)
    seq = engine.get_sequence(rid)
    out = []
    while engine.has_request(rid):
        for o in engine.step():
            out += o.new_token_ids
    computed = engine.num_computed_tokens_total - before
    hit = len(shared) // bs * bs
    assert seq.num_prefix_hit_tokens == hit > 40
    assert computed == len(p2) - hit + 5  # the new part, then 5 decode steps
    cold = Engine(model, tok, num_blocks=128, block_size=bs, enable_prefix_cache=False)
    assert out == cold.generate(p2, 6, ignore_eos=True)
    cache = engine.prefix_cache
    assert cache.tokens_asked == len(p1) + len(p2)
    assert cache.tokens_hit == hit
    # identical prompt: everything but the block holding the last token is reused
    rid = engine.add_request(p2, 2, ignore_eos=True)
    assert engine.step()[0].num_computed_this_step == len(p2) - (len(p2) - 1) // bs * bs
    engine.abort(rid)
    _free_all(engine)


def test_eviction_under_pressure_keeps_referenced_blocks_and_results_exact(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=24, block_size=4, max_num_batched_tokens=32)
    holder_prompt = _prompt(tok, "holder")  # 7 tokens + 60 to generate: 17 blocks of claim
    prompts = [_prompt(tok, f"p{i} padding!!!") for i in range(6)]  # 15 tokens: 5 blocks each
    expect = [naive(model, p, 4) for p in prompts]
    # a long-running request holds its (cached) blocks while others churn through the pool
    holder = engine.add_request(holder_prompt, 60, ignore_eos=True)
    for _ in range(3):
        engine.step()
    seq = engine.get_sequence(holder)
    held = list(seq.block_table)
    assert any(engine.prefix_cache.is_cached(b) for b in held)
    for p, e in zip(prompts, expect, strict=True):
        assert engine.generate(p, 4, ignore_eos=True) == e
        assert not seq.is_finished
        assert engine.blocks.claimed <= engine.num_available_blocks
        assert all(engine.allocator.refcount(b) >= 1 for b in held)
        assert seq.block_table[: len(held)] == held
    assert engine.prefix_cache.num_evicted > 0
    while engine.has_request(holder):
        engine.step()
    assert seq.output_token_ids == naive(model, holder_prompt, 60)
    _free_all(engine)


def test_pool_is_never_over_allocated_and_requests_wait_for_room(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=12, block_size=4, max_num_batched_tokens=64)
    prompts = [_prompt(tok, f"request {i}: hello") for i in range(5)]  # 17 tokens each
    ids = [engine.add_request(p, 8, ignore_eos=True) for p in prompts]  # 6 blocks of claim each
    results: dict[str, list[int]] = {}
    max_running = 0
    while engine.has_work():
        for o in engine.step():
            results.setdefault(o.request_id, []).extend(o.new_token_ids)
        max_running = max(max_running, len(engine.scheduler.running))
        assert (
            engine.allocator.num_free >= 0 and engine.blocks.claimed <= engine.num_available_blocks
        )
    assert max_running == 2  # 12 blocks fit two whole-life claims, never three
    assert [results[i] for i in ids] == [naive(model, p, 8) for p in prompts]
    with pytest.raises(ValueError, match="needs up to 13 KV blocks"):
        engine.add_request(prompts[0], 36)
    _free_all(engine)


def test_abort_frees_everything(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=64, block_size=4, max_num_batched_tokens=8)
    ids = [engine.add_request(_prompt(tok, "abort me " * (i + 1)), 30) for i in range(4)]
    for _ in range(6):
        engine.step()
    assert engine.num_available_blocks < engine.num_blocks
    assert all(engine.abort(i) for i in ids)
    assert not engine.abort(ids[0])
    assert not engine.has_work() and engine.num_unfinished == 0
    _free_all(engine)


def test_eos_stops_unless_ignored(tiny):
    model, tok = tiny
    prompt = _prompt(tok, "stop here")
    ref = naive(model, prompt, 12)
    eos = ref[5]  # pretend the 6th greedy token is EOS
    engine = Engine(model, SimpleNamespace(eos_token_id=eos), num_blocks=64, block_size=4)
    first = ref.index(eos)
    rid = engine.add_request(prompt, 12)
    outs = []
    while engine.has_request(rid):
        outs += engine.step()
    assert [t for o in outs for t in o.new_token_ids] == ref[: first + 1]
    assert outs[-1].finished and outs[-1].finish_reason is FinishReason.STOP
    assert engine.generate(prompt, 12, ignore_eos=True) == ref
    _free_all(engine)


def test_stream_yields_tokens_and_closing_early_aborts(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=64, block_size=4)
    prompt = _prompt(tok, "stream")
    it = engine.stream(prompt, 10, ignore_eos=True)
    head = [next(it) for _ in range(3)]
    assert engine.num_unfinished == 1
    it.close()
    assert engine.num_unfinished == 0
    _free_all(engine)
    assert head + list(engine.stream(prompt, 10, ignore_eos=True))[3:] == naive(model, prompt, 10)


def test_bad_requests_get_clear_errors(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="must not be empty"):
        engine.add_request([], 4)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 100000], 4)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request([1, 2], 0)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1, 2], 4, SamplingParams(temperature=-1))
    with pytest.raises(ValueError, match="max_position"):
        engine.add_request([1, 2], model.config.max_position)
    engine.add_request([1, 2], 4, request_id="r")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], 4, request_id="r")
    with pytest.raises(KeyError, match="unknown request"):
        engine.append_tokens("nope", [1])


def test_prefill_only_keeps_blocks_for_export_and_a_decoder_continues_exactly(tiny):
    """The P -> D flow in miniature: prefill-only on one engine, KV imported into another
    engine with another block size, which decodes on from the first token."""
    from pddnet.kv.transfer import export_kv, import_kv

    model, tok = tiny
    prompt = _prompt(tok, "Disaggregated prefill and decode, across datacenters.")
    sp = SamplingParams(temperature=0.8, seed=42)
    ref = Engine(model, tok, num_blocks=64, block_size=4).generate(prompt, 12, sp, ignore_eos=True)
    p = Engine(model, tok, num_blocks=64, block_size=4, max_num_batched_tokens=16)
    rid = p.add_request(prompt, 1, sp, keep_blocks=True, ignore_eos=True)
    first = []
    while p.has_work():
        first += [t for o in p.step() for t in o.new_token_ids]
    seq = p.get_sequence(rid)
    assert first == ref[:1] and seq.is_finished and seq.num_computed_tokens == len(prompt)
    exported = export_kv(p.pool, seq.block_table, 0, len(prompt))
    p.release(rid)
    _free_all(p)

    d = Engine(model, tok, num_blocks=32, block_size=8)
    res = d.reserve_kv(prompt, max_tokens=12)
    assert res.missing_range == (0, len(prompt))
    import_kv(d.pool, exported, res.block_ids)
    rid = d.add_request(prompt, 12, sp, kv=res, output_token_ids=first, ignore_eos=True)
    assert d.get_sequence(rid).num_computed_tokens == len(prompt)
    out = list(first)
    while d.has_request(rid):
        out += [t for o in d.step() for t in o.new_token_ids]
    assert out == ref
    with pytest.raises(ValueError, match="unknown or already used"):
        d.add_request(prompt, 12, sp, kv=res, output_token_ids=first)
    _free_all(d)


def test_reservations_respect_claims_and_can_be_freed(tiny):
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=10, block_size=4)
    res = engine.reserve_kv(list(range(1, 17)), max_tokens=9)  # 24 tokens of KV: 6 blocks
    assert len(res.block_ids) == 4 and res.claim == 2
    with pytest.raises(OutOfBlocks):
        engine.reserve_kv(list(range(1, 17)), max_tokens=9)
    engine.free_reservation(res)
    _free_all(engine)


def test_engine_pool_in_shared_memory_is_unlinked_on_close(tiny):
    model, tok = tiny
    name = unique_segment_name("test-engine")
    with Engine(model, tok, num_blocks=16, block_size=4, kv_shm_name=name) as engine:
        assert os.path.exists(f"/dev/shm/{name}")
        prompt = _prompt(tok, "shared")
        assert engine.generate(prompt, 5, ignore_eos=True) == naive(model, prompt, 5)
    assert not os.path.exists(f"/dev/shm/{name}")


def test_reserve_kv_reuses_the_cached_prefix_so_only_the_rest_is_imported(tiny):
    """MD's side of a high-hit request: the shared prefix is already cached, only the missing
    range of KV is imported, and decoding on top is token-exact."""
    from pddnet.kv.transfer import export_kv, import_kv

    model, tok = tiny
    shared = _prompt(tok, "System: you are terse. User: ")
    prompt = shared + tok.encode("what is PDD?", add_bos=False)
    sp = SamplingParams(temperature=0.6, seed=3)
    ref = Engine(model, tok, num_blocks=64, block_size=4).generate(prompt, 10, sp, ignore_eos=True)
    p = Engine(model, tok, num_blocks=64, block_size=4)
    pid = p.add_request(prompt, 1, sp, keep_blocks=True, ignore_eos=True)
    while p.has_work():
        p.step()
    pseq = p.get_sequence(pid)

    md = Engine(model, tok, num_blocks=64, block_size=8)
    md.generate(shared + [1, 2, 3], 2, ignore_eos=True)  # an earlier turn cached the prefix
    pinned = md.pin_prefix(prompt)
    assert pinned is not None and pinned.num_tokens == len(shared) // 8 * 8
    res = md.reserve_kv(prompt, 10)
    start, end = res.missing_range
    assert start == len(shared) // 8 * 8 > 0 and end == len(prompt)
    import_kv(md.pool, export_kv(p.pool, pseq.block_table, start, end), res.block_ids)
    rid = md.add_request(
        prompt, 10, sp, kv=res, output_token_ids=pseq.output_token_ids, ignore_eos=True
    )
    out = list(pseq.output_token_ids)
    while md.has_request(rid):
        out += [t for o in md.step() for t in o.new_token_ids]
    assert out == ref
    md.unpin_prefix(pinned)
    p.release(pid)
    _free_all(md)
    _free_all(p)
