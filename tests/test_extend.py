"""Extend == decode: known tokens recomputed in one extend forward give the same KV and the same
next token as decoding them one at a time -- the basis of PDD's token-id handoff."""

from __future__ import annotations

import pytest
import torch

from pddnet.engine.engine import Engine
from pddnet.engine.runner import Chunk, ModelRunner
from pddnet.engine.sampling import SamplingParams
from pddnet.kv.pool import KVPool, KVSpec
from pddnet.kv.transfer import export_kv, import_kv
from pddnet.model.loader import load_model

BS = 4


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


@pytest.fixture(scope="module")
def prompt(tiny):
    _, tok = tiny
    return tok.encode("Relay decode hands over token ids, not KV.", add_bos=True)


def _kv(engine: Engine, request_id: str, n: int) -> torch.Tensor:
    return export_kv(engine.pool, engine.get_sequence(request_id).block_table, 0, n).kv


def _decoded(tiny, prompt, n_plus_1: int, sp: SamplingParams):
    """Decode one token at a time; keep the blocks so the KV can be compared."""
    model, tok = tiny
    engine = Engine(model, tok, num_blocks=64, block_size=BS)
    rid = engine.add_request(prompt, n_plus_1, sp, keep_blocks=True, ignore_eos=True)
    out = []
    while engine.has_work():
        outs = engine.step()
        if engine.get_sequence(rid).num_output_tokens > 1:
            assert outs[0].num_computed_this_step == 1  # really one token per step
        out += outs[0].new_token_ids
    return engine, rid, out


@pytest.mark.parametrize("n", [1, 7, 64])
@pytest.mark.parametrize("prefix_hit", [False, True])
def test_extend_equals_decode(tiny, prompt, n, prefix_hit):
    model, tok = tiny
    sp = SamplingParams(temperature=0.7, seed=2024)
    dec_engine, dec_id, out = _decoded(tiny, prompt, n + 1, sp)
    assert len(out) == n + 1

    engine = Engine(model, tok, num_blocks=64, block_size=BS, max_num_batched_tokens=256)
    if prefix_hit:  # cache the prompt's full blocks under this request
        engine.generate(prompt, 2, sp, ignore_eos=True)
    # MD's situation: prompt KV present (computed here), first token known, then the relay's
    # n-1 further tokens arrive as ids; the last known token is out[n-1], out[n] is next.
    rid = engine.add_request(
        prompt, n + 1, sp, output_token_ids=out[:1], hold=True, keep_blocks=True, ignore_eos=True
    )
    while engine.step():
        pass
    seq = engine.get_sequence(rid)
    assert seq.num_computed_tokens == len(prompt)
    assert seq.num_prefix_hit_tokens == (len(prompt) // BS * BS if prefix_hit else 0)
    assert engine.append_tokens(rid, out[1:n]) is None
    engine.set_hold(rid, False)
    (step,) = engine.step()
    assert step.num_computed_this_step == n  # all n known tokens in ONE extend forward
    assert step.new_token_ids == [out[n]]
    assert step.finished
    total = len(prompt) + n
    diff = (_kv(engine, rid, total) - _kv(dec_engine, dec_id, total)).abs().max()
    assert diff < 1e-9


def test_runner_mixes_prefill_extend_and_decode_in_one_forward(tiny):
    """One call with a prefill chunk, an extend chunk (all logits) and a decode chunk gives the
    same logits and KV as running them separately."""
    model, _ = tiny
    spec = KVSpec.from_model_config(model.config, block_size=BS)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (13, 22, 9)]
    tables = [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9], [10, 11, 12]]
    split = [0, 15, 8]  # tokens already in the cache before the mixed step

    def prepare(pool):
        runner = ModelRunner(model, pool)
        for s, t, k in zip(seqs, tables, split, strict=True):
            if k:
                runner.run([Chunk(s[:k], 0, t, "none")])
        return runner

    together = KVPool(spec, 16)
    mixed = prepare(
        together
    ).run(
        [
            Chunk(seqs[0], 0, tables[0], "last"),  # whole prefill
            Chunk(seqs[1][15:], 15, tables[1], "all"),  # extend of 7 tokens
            Chunk(seqs[2][8:], 8, tables[2], "last"),  # decode of 1 token
        ]
    )
    apart = KVPool(spec, 16)
    runner = prepare(apart)
    one = runner.run([Chunk(seqs[0], 0, tables[0], "last")])[0]
    steps = [
        runner.run([Chunk([tok], 15 + i, tables[1], "last")])[0]
        for i, tok in enumerate(seqs[1][15:])
    ]
    dec = runner.run([Chunk(seqs[2][8:], 8, tables[2], "last")])[0]
    assert mixed[0].shape == (model.config.vocab_size,)
    assert mixed[1].shape == (7, model.config.vocab_size)
    assert (mixed[0] - one).abs().max() < 1e-9
    assert (mixed[1] - torch.stack(steps)).abs().max() < 1e-9
    assert (mixed[2] - dec).abs().max() < 1e-9
    assert (together.data - apart.data).abs().max() < 1e-9


def test_streaming_handoff_never_extends_more_than_chunk_per_step(tiny, prompt):
    model, tok = tiny
    sp = SamplingParams()
    ref = Engine(model, tok, num_blocks=64, block_size=BS).generate(prompt, 40, sp, ignore_eos=True)
    relay_tokens = ref[:30]  # what RLD produced while MD caught up
    chunk = 4
    md = Engine(model, tok, num_blocks=64, block_size=8, max_num_batched_tokens=128)
    rid = md.add_request(
        prompt,
        40,
        sp,
        output_token_ids=relay_tokens[:1],
        hold=True,
        max_chunk_tokens=None,
        ignore_eos=True,
    )
    while md.step():  # prompt prefill (not capped yet)
        pass
    md.set_max_chunk_tokens(rid, chunk)
    sent = 1
    out = list(relay_tokens[:1])
    extend_sizes = []
    while md.has_request(rid):
        if sent < len(relay_tokens):  # the relay outpaces MD: 6 ids per MD step, then the cut
            md.append_tokens(rid, relay_tokens[sent : sent + 6])
            out += relay_tokens[sent : sent + 6]
            sent += 6
            if sent >= len(relay_tokens):
                md.set_hold(rid, False)
        for o in md.step():
            extend_sizes.append(o.num_computed_this_step)
            out += o.new_token_ids
        assert len(extend_sizes) < 200
    assert max(extend_sizes) == chunk
    assert out == ref


def test_relay_then_main_decode_one_shot_handoff_is_token_exact(tiny, prompt):
    """P prefill-only -> RLD (imported KV, decodes k tokens) -> MD (imported KV, gets the k
    token ids, extends, continues): the same tokens as the colocated engine."""
    model, tok = tiny
    sp = SamplingParams(temperature=0.9, top_p=0.9, seed=77)
    ref = Engine(model, tok, num_blocks=64, block_size=BS).generate(prompt, 30, sp, ignore_eos=True)
    p = Engine(model, tok, num_blocks=64, block_size=BS)
    pid = p.add_request(prompt, 1, sp, keep_blocks=True, ignore_eos=True)
    first = []
    while p.has_work():
        first += [t for o in p.step() for t in o.new_token_ids]
    kv = export_kv(p.pool, p.get_sequence(pid).block_table, 0, len(prompt))
    p.release(pid)

    rld = Engine(model, tok, num_blocks=32, block_size=BS)
    res = rld.reserve_kv(prompt, 30)
    import_kv(rld.pool, kv, res.block_ids)
    rid = rld.add_request(prompt, 30, sp, kv=res, output_token_ids=first, ignore_eos=True)
    relay = list(first)
    for _ in range(9):
        relay += [t for o in rld.step() for t in o.new_token_ids]
    rld.abort(rid)  # RLD cut here: it stops and hands over the ids
    assert rld.num_available_blocks == rld.num_blocks

    md = Engine(model, tok, num_blocks=64, block_size=16, max_num_batched_tokens=64)
    mres = md.reserve_kv(prompt, 30)
    import_kv(md.pool, kv, mres.block_ids)
    mid = md.add_request(prompt, 30, sp, kv=mres, output_token_ids=relay[:1], ignore_eos=True)
    md.append_tokens(mid, relay[1:])
    out = list(relay)
    steps = []
    while md.has_request(mid):
        for o in md.step():
            steps.append(o.num_computed_this_step)
            out += o.new_token_ids
    assert steps[0] == len(relay)  # the extend digests every relayed token at once
    assert out == ref
