"""Sliding-window attention (ModelConfig.sliding_window, the `tiny-window` preset): the paged
path against the reference `causal_attention` with the same window, a plan that never reads the
blocks older than its chunk's window, and the engine token-exact on a prompt longer than W."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest
import torch

import pddnet.model.paged_attention as pa
from pddnet.engine.engine import Engine
from pddnet.engine.runner import Chunk, ModelRunner
from pddnet.kv.pool import KVPool, KVSpec
from pddnet.model.attention import causal_attention
from pddnet.model.config import ModelConfig
from pddnet.model.loader import load_model
from pddnet.model.paged_attention import paged_attention, plan_chunk
from pddnet.model.weights import CheckpointError, config_from_hf, init_random, load_hf, save_hf
from tests.test_paged_attention import _case

TOL = 1e-12


def _windowed(q, kb, vb, table, n, t, block_size, window):
    plan = plan_chunk(table, n, block_size, t, q.shape[1], kb.shape[2], window)
    return paged_attention(q, kb, vb, plan, q_offset=n - t)


def test_preset_and_validation():
    cfg = ModelConfig.preset("tiny-window")
    long = ModelConfig.preset("tiny-long")
    assert cfg.sliding_window == 512 and long.sliding_window is None
    # tiny-long's shape and KV, only the attention window differs
    assert dataclasses.replace(cfg, name="tiny-long", sliding_window=None) == long
    assert cfg.kv_bytes_per_token == 256 and cfg.max_position == 131072
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="sliding_window must be None or an integer >= 1"):
            dataclasses.replace(cfg, sliding_window=bad)
    with pytest.raises(ValueError, match="window must be None or >= 1"):
        plan_chunk([0], 4, 16, 1, 2, 1, window=0)
    x = torch.zeros(2, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="window must be None or >= 1"):
        causal_attention(x, x[:, :1], x[:, :1], 0, window=0)
    # a windowed plan made for 1 query skips keys that the first of 2 queries sees
    kb = torch.zeros(4, 16, 1, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="plan starts at key 32, the query at position 38 sees"):
        paged_attention(x, kb, kb, plan_chunk([0, 1, 2], 40, 16, 1, 2, 1, window=8), 38)


def test_reference_window_sees_exactly_the_last_w_keys():
    # one kv head, one query head; values one-hot by position, scores all equal: each query's
    # output is the mean over exactly the keys it sees
    n, w = 9, 3
    v = torch.eye(n, dtype=torch.float64).unsqueeze(1)  # [n, 1, n]: value p is one-hot at p
    q, k = torch.zeros_like(v), torch.zeros_like(v)
    out = causal_attention(q, k, v, 0, window=w)[:, 0]
    for p in range(n):
        seen = list(range(max(0, p - w + 1), p + 1))
        expected = torch.zeros(n, dtype=torch.float64)
        expected[seen] = 1 / len(seen)
        assert torch.allclose(out[p], expected), p
    # the query's own key only, with W = 1
    assert torch.equal(causal_attention(q, k, v, 0, window=1)[:, 0], torch.eye(n).double())


# paged vs reference with windows: tests/test_paged_attention.py, windowed=True


def test_a_window_past_the_context_is_full_attention_bit_for_bit():
    rng = random.Random(4)
    q, kb, vb, table, keys, values = _case(rng, 300, 40, 4, 2, 2, 16, "mixed")
    full = _windowed(q, kb, vb, table, 300, 40, 4, None)
    assert torch.equal(_windowed(q, kb, vb, table, 300, 40, 4, 300), full)
    assert torch.equal(_windowed(q, kb, vb, table, 300, 40, 4, 10_000), full)
    # and a window inside the context changes the result
    assert (_windowed(q, kb, vb, table, 300, 40, 4, 100) - full).abs().max().item() > 1e-3


def test_chunks_straddling_window_edges_each_equal_the_reference(monkeypatch):
    monkeypatch.setattr(pa, "QUERY_TILE_ROWS", 64)  # several query tiles per chunk
    monkeypatch.setattr(pa, "MIN_TILE_KEYS", 32)
    monkeypatch.setattr(pa, "SCORE_TILE_ELEMENTS", 64 * 32)
    rng = random.Random(9)
    q, kb, vb, table, keys, values = _case(rng, 1000, 1000, 16, 2, 2, 16, "scattered")
    for window in (1, 37, 100, 256, 301):
        # chunk starts and ends on and off block edges, before and past the window
        bounds = ((0, 30), (30, 301), (301, 302), (302, 777), (777, 1000))
        out = torch.cat(
            [
                paged_attention(q[s:e], kb, vb, plan_chunk(table, e, 16, e - s, 4, 2, window), s)
                for s, e in bounds
            ]
        )
        ref = causal_attention(q, keys, values, 0, window=window)
        assert (out - ref).abs().max().item() < TOL, window


def _blocks_read(plan: pa.ChunkPlan) -> list[int]:
    read: list[int] = []
    for tile in plan.tiles:
        if tile.index is None:
            read.extend(range(tile.first_block, tile.first_block + tile.num_blocks))
        else:
            read.extend(tile.index.tolist())
    return read


@pytest.mark.parametrize("kind", ["consecutive", "scattered"])
def test_the_plan_reads_only_the_blocks_of_its_window(kind):
    bs, n, window = 16, 65536, 1024
    table = (
        list(range(4096)) if kind == "consecutive" else random.Random(1).sample(range(9000), 4096)
    )
    for chunk in (1, 7, 2048):  # a decode, an extend, a prefill chunk at 64K context
        plan = plan_chunk(table, n, bs, chunk, 2, 1, window)
        oldest = n - chunk - window + 1  # the first query's oldest visible key
        assert plan.tiles[0].start == oldest // bs * bs and plan.tiles[-1].end == n
        assert all(a.end == b.start for a, b in zip(plan.tiles, plan.tiles[1:], strict=False))
        assert _blocks_read(plan) == table[oldest // bs : n // bs]
        # the cost bound: keys read <= W + chunk (+ the partial first block), not the context
        assert sum(t.end - t.start for t in plan.tiles) < window + chunk + bs
        assert plan.max_block == max(table[oldest // bs : n // bs])
    # without a window the same chunk reads all 4096 blocks
    assert len(_blocks_read(plan_chunk(table, n, bs, 2048, 2, 1))) == 4096


def test_blocks_older_than_the_window_are_never_read():
    # poison every block the chunk's window has left behind: a read would turn the output NaN
    rng = random.Random(6)
    n, t, bs, window = 600, 50, 4, 64
    q, kb, vb, table, keys, values = _case(rng, n, t, bs, 1, 2, 8, "mixed")
    ref = causal_attention(q, keys, values, n - t, window=window)
    skip = (n - t - window + 1) // bs
    for b in set(table[:skip]) - set(table[skip:]):
        kb[b], vb[b] = float("nan"), float("nan")
    out = _windowed(q, kb, vb, table, n, t, bs, window)
    assert torch.isfinite(out).all() and (out - ref).abs().max().item() < TOL


def _windowed_tiny(window: int):
    return init_random(dataclasses.replace(ModelConfig.preset("tiny"), sliding_window=window), 3)


def _full_forward(model, ids: list[int], window: int | None) -> torch.Tensor:
    """Logits of every position of one whole-sequence forward, no cache."""

    def attention(layer, q, k, v):
        return causal_attention(q, k, v, 0, window=window)

    return model(torch.tensor(ids), torch.arange(len(ids)), attention)


def test_runner_batches_decodes_of_different_contexts_on_both_paths():
    model = _windowed_tiny(11)
    spec = KVSpec.from_model_config(model.config, block_size=4)
    rng = random.Random(12)
    seqs = [[rng.randrange(256) for _ in range(n)] for n in (5, 40, 23)]  # < W, > W, > W
    tables = [[9, 3, 4, 5, 60], list(range(10, 21)), [30, 22, 31, 25, 40, 41, 42]]
    refs = [_full_forward(model, ids, 11) for ids in seqs]
    for path in ("paged", "gather"):
        runner = ModelRunner(model, KVPool(spec, num_blocks=64), attention=path)
        # prefill all but the last token of each, then the three last tokens as one decode batch
        runner.run([Chunk(ids[:-1], 0, tb, "none") for ids, tb in zip(seqs, tables, strict=True)])
        decoded = runner.run(
            [Chunk(ids[-1:], len(ids) - 1, tb) for ids, tb in zip(seqs, tables, strict=True)]
        )
        for logits, ref in zip(decoded, refs, strict=True):
            assert (logits - ref[-1]).abs().max().item() < TOL, path


def test_tiny_window_chunked_prefill_equals_a_full_forward_and_differs_from_full_attention():
    model, _ = load_model("tiny-window")
    w = model.config.sliding_window
    rng = random.Random(21)
    ids = [rng.randrange(256) for _ in range(w + 700)]
    ref = _full_forward(model, ids, w)
    runner = ModelRunner(model, KVPool(KVSpec.from_model_config(model.config, 16), 120))
    table = random.Random(22).sample(range(120), 108)
    logits = torch.cat(
        [
            runner.run([Chunk(ids[s:e], s, table, "all")])[0]
            for s, e in ((0, 500), (500, 1100), (1100, 1101), (1101, w + 700))
        ]
    )
    assert (logits - ref).abs().max().item() < 1e-10
    # past W positions the window matters: full attention gives other logits there
    full = _full_forward(model, ids, None)
    assert (full[:w] - ref[:w]).abs().max().item() < TOL
    assert (full[w:] - ref[w:]).abs().max().item() > 1e-6


def test_tiny_window_engine_is_token_exact_across_chunkings_and_a_prefix_hit():
    model, tok = load_model("tiny-window")
    w = model.config.sliding_window
    rng = random.Random(5)
    prompt = [rng.randrange(256) for _ in range(w + 900)]
    blocks = len(prompt) // 16 + 16
    out = Engine(
        model,
        tok,
        num_blocks=blocks,
        block_size=16,
        max_num_batched_tokens=len(prompt),
        enable_prefix_cache=False,
    ).generate(prompt, 8, ignore_eos=True)
    # greedy tokens of prefill + decode == argmax of one full forward over the whole sequence
    ref = _full_forward(model, prompt + out, w)
    assert out == ref[len(prompt) - 1 : -1].argmax(-1).tolist() and len(set(out)) >= 4
    # chunked prefill, 700 tokens a step
    chunked = Engine(model, tok, num_blocks=blocks, block_size=16, max_num_batched_tokens=700)
    assert chunked.generate(prompt, 8, ignore_eos=True) == out
    # the prompt and 4 of its tokens again: a prefix hit, then an extend of what is left
    before = chunked.num_computed_tokens_total
    assert chunked.generate(prompt + out[:4], 4, ignore_eos=True) == out[4:]
    assert chunked.num_computed_tokens_total - before < 16 + 4


def test_hf_folder_of_a_windowed_model_is_a_mistral_and_round_trips(tmp_path):
    model = _windowed_tiny(5)
    save_hf(model, tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert hf["architectures"] == ["MistralForCausalLM"] and hf["model_type"] == "mistral"
    assert hf["sliding_window"] == 5
    loaded = load_hf(tmp_path)
    assert loaded.config == model.config
    ids = random.Random(3).choices(range(256), k=20)
    assert torch.equal(_full_forward(loaded, ids, 5), _full_forward(model, ids, 5))
    # Mistral's null window is full attention; a Llama config's window field is not read
    assert config_from_hf({**hf, "sliding_window": None}, "m").sliding_window is None
    llama = {**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    assert config_from_hf(llama, "m").sliding_window is None
    with pytest.raises(CheckpointError, match="sliding_window must be None or an integer >= 1"):
        config_from_hf({**hf, "sliding_window": 0}, "m")
