"""The long-context preset through the engine: a prompt over 16K tokens gives the same tokens
whatever the chunking, the block layout (scattered blocks: gathered tiles; consecutive ones:
views of the pool) and when it is continued from a prefix-cache hit."""

from __future__ import annotations

import random

import pytest
import torch

from pddnet.engine.engine import Engine
from pddnet.model.config import ModelConfig
from pddnet.model.loader import load_model
from pddnet.model.paged_attention import plan_chunk
from pddnet.model.rope import RotaryEmbedding

PROMPT_TOKENS = 16_500  # past 16K; each full prefill of it takes ~5 s on one core


@pytest.mark.parametrize("preset", ["tiny-long", "tiny-window"])
def test_long_context_preset_reaches_128k_positions_in_float64(preset):
    config = ModelConfig.preset(preset)
    assert config.max_position >= 131072 and config.dtype == "float64"
    assert config.num_layers >= 2 and config.num_heads > config.num_kv_heads
    # rotary angles of the last position are finite and do not depend on the batch around it
    rope = RotaryEmbedding(config)
    cos, sin = rope(torch.tensor([131071]))
    cos2, sin2 = rope(torch.tensor([0, 5, 131071]))
    assert torch.isfinite(cos).all() and torch.equal(cos[0], cos2[2])
    assert torch.equal(sin[0], sin2[2])


def test_long_prompt_is_token_exact_across_chunkings_layouts_and_a_prefix_hit():
    model, tok = load_model("tiny-long")
    rng = random.Random(2)
    prompt = [rng.randrange(256) for _ in range(PROMPT_TOKENS)]
    blocks = PROMPT_TOKENS // 16 + 16

    # the whole prompt in one forward, its blocks scattered over the pool
    whole = Engine(
        model,
        tok,
        num_blocks=blocks,
        block_size=16,
        max_num_batched_tokens=PROMPT_TOKENS,
        enable_prefix_cache=False,
    )
    ids = whole.allocator.allocate(blocks)
    rng.shuffle(ids)
    whole.allocator.decref(ids)  # the free list, hence the next tables, shuffled
    out_whole = []
    for token in whole.stream(prompt, 8, ignore_eos=True, request_id="long"):
        if not out_whole:
            table = whole.get_sequence("long").block_table
            plan = plan_chunk(table, PROMPT_TOKENS, 16, 1, 2, 1)
            assert all(tile.index is not None for tile in plan.tiles)  # all gathered
        out_whole.append(token)
    assert whole.num_steps == 8  # one prefill step, then decodes

    # chunked prefill, 3000 tokens a step, on a fresh pool: consecutive blocks, read in place
    chunked = Engine(model, tok, num_blocks=blocks, block_size=16, max_num_batched_tokens=3000)
    out = chunked.generate(prompt, 8, ignore_eos=True)
    assert chunked.num_steps == 6 + 7
    assert out == out_whole and len(set(out)) >= 4

    # the prompt and 4 of its tokens again: all but the last partial block is a cache hit
    before = chunked.num_computed_tokens_total
    assert chunked.generate(prompt + out[:4], 4, ignore_eos=True) == out[4:]
    assert chunked.num_computed_tokens_total - before < 16 + 4
