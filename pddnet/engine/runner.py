"""One model forward over a batch of chunks, with K/V stored in the paged pool.

A chunk is (new token ids, start position, block table): a whole prompt, a prefill chunk, an
extend of several known tokens on top of an existing cache, or a single decode token -- all the
same to the runner. Linear layers run once over every chunk's tokens flattened; attention, per
layer, first writes the step's K/V of all chunks into their slots, then lets each chunk's queries
attend over its own sequence's keys ``0..start+len-1`` read from its blocks in place
(pddnet/model/paged_attention.py: tile by tile, online softmax, no copy of the context), or
only the last ``sliding_window`` of them for a model that has one. Reading
the chunk's own K/V back from the pool (instead of using the fresh tensors) is deliberate:
decode, extend and prefill then see bit-identical keys, also when the pool stores a narrower
dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from pddnet.kv.pool import KVPool
from pddnet.model.attention import causal_attention
from pddnet.model.llama import LlamaModel
from pddnet.model.paged_attention import paged_attention, plan_chunk

LogitsMode = Literal["last", "all", "none"]
# "paged" reads each sequence's KV in place; "gather" is the previous path (copy the whole
# context out of the pool, then full-matrix `causal_attention`), kept selectable ONLY so that
# `pdd bench engine` can measure old and new side by side in one run. The engine uses "paged".
AttentionPath = Literal["paged", "gather"]


@dataclass(frozen=True)
class Chunk:
    token_ids: Sequence[int]
    start: int  # absolute position of token_ids[0] in its sequence
    block_table: Sequence[int]  # must cover positions 0..start+len-1
    logits: LogitsMode = "last"

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("a chunk needs at least one token")
        if self.start < 0:
            raise ValueError(f"chunk start must be >= 0, got {self.start}")
        if self.logits not in ("last", "all", "none"):
            raise ValueError(f"logits must be 'last', 'all' or 'none', got {self.logits!r}")

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


class ModelRunner:
    def __init__(self, model: LlamaModel, pool: KVPool, attention: AttentionPath = "paged") -> None:
        if attention not in ("paged", "gather"):
            raise ValueError(f"attention must be 'paged' or 'gather', got {attention!r}")
        cfg, spec = model.config, pool.spec
        if (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim) != (
            spec.num_layers,
            spec.num_kv_heads,
            spec.head_dim,
        ):
            raise ValueError(
                f"KV pool ({spec.num_layers} layers x {spec.num_kv_heads} kv heads x "
                f"{spec.head_dim}) does not fit model {cfg.name} ({cfg.num_layers} x "
                f"{cfg.num_kv_heads} x {cfg.head_dim})"
            )
        self.model = model
        self.pool = pool
        self.attention = attention

    def run(self, chunks: Sequence[Chunk]) -> list[torch.Tensor | None]:
        """Forward all chunks in one call; per chunk its logits: [vocab] for "last",
        [len, vocab] for "all", None for "none"."""
        if not chunks:
            return []
        max_pos = self.model.config.max_position
        ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        bounds: list[tuple[int, int]] = []
        logits_rows: list[int] = []
        for c in chunks:
            if c.end > max_pos:
                raise ValueError(
                    f"chunk reaches position {c.end - 1}, model max_position is {max_pos}"
                )
            s = len(ids)
            ids.extend(c.token_ids)
            bounds.append((s, len(ids)))
            positions.append(torch.arange(c.start, c.end, dtype=torch.long))
            slots.append(self.pool.slot_mapping(c.block_table, c.start, c.end))
            if c.logits == "last":
                logits_rows.append(len(ids) - 1)
            elif c.logits == "all":
                logits_rows.extend(range(s, len(ids)))
        slot_all = torch.cat(slots)
        pool = self.pool
        cfg = self.model.config
        # One plan per chunk and step (slot_mapping above checked its block ids), every layer.
        plans = (
            [
                plan_chunk(
                    c.block_table,
                    c.end,
                    pool.spec.block_size,
                    len(c.token_ids),
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    cfg.sliding_window,
                )
                for c in chunks
            ]
            if self.attention == "paged"
            else []
        )

        def attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            pool.write(layer, slot_all, k, v)
            out = torch.empty_like(q)
            k_blocks, v_blocks = pool.layer_blocks(layer)
            for c, plan, (s, e) in zip(chunks, plans, bounds, strict=True):
                out[s:e] = paged_attention(q[s:e], k_blocks, v_blocks, plan, c.start)
            return out

        def gather_attention(
            layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
        ) -> torch.Tensor:
            pool.write(layer, slot_all, k, v)
            out = torch.empty_like(q)
            for c, (s, e) in zip(chunks, bounds, strict=True):
                keys, values = pool.gather(layer, c.block_table, c.end, dtype=q.dtype)
                out[s:e] = causal_attention(
                    q[s:e], keys, values, q_offset=c.start, window=cfg.sliding_window
                )
            return out

        input_ids = torch.tensor(ids, dtype=torch.long)
        # An empty index list (no chunk wants logits) skips the head entirely.
        logits = self.model(
            input_ids,
            torch.cat(positions),
            attention if self.attention == "paged" else gather_attention,
            torch.tensor(logits_rows, dtype=torch.long),
        )
        out: list[torch.Tensor | None] = []
        row = 0
        for c in chunks:
            if c.logits == "last":
                out.append(logits[row])
                row += 1
            elif c.logits == "all":
                out.append(logits[row : row + len(c.token_ids)])
                row += len(c.token_ids)
            else:
                out.append(None)
        return out
