"""A Llama-style decoder in plain torch: RMSNorm, RoPE, grouped-query attention, SwiGLU.

The forward takes the tokens of a whole batch flattened into one dimension [T]: every linear
layer runs once over all T tokens (prefill chunks, extends and decodes alike), and only
attention is per sequence, through the caller's `AttentionFn`, which stores this step's K/V and
attends over whatever it has stored. Module and parameter names follow Hugging Face's
LlamaForCausalLM, so `state_dict()` keys are the checkpoint's tensor names.

Parameters are created empty; `weights.init_random` or `loader.load_hf` fills them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pddnet.model.config import ModelConfig
from pddnet.model.rope import RotaryEmbedding, apply_rotary

# attention(layer_index, q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D]) -> out [T, Hq, D];
# q and k already carry the rotary embedding of their positions.
AttentionFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class _OneWeight(nn.Module):
    """A module whose one parameter is ``weight``, created empty (no default init: weights
    always come from init or a file)."""

    def __init__(self, *shape: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class Linear(_OneWeight):
    """Bias-free linear layer; ``weight`` is [out_features, in_features], as in HF."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype) -> None:
        super().__init__(out_features, in_features, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Embedding(_OneWeight):
    """``Embedding(num, dim, dtype=...)``: ``weight`` is [num, dim]."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(_OneWeight):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Low-precision inputs are normalised in float32 (as HF does); float64 stays float64.
        compute = torch.float64 if x.dtype == torch.float64 else torch.float32
        xc = x.to(compute)
        xc = xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xc.to(x.dtype)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, d, dt = config.hidden_size, config.head_dim, config.torch_dtype
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            d,
        )
        self.q_proj = Linear(h, config.num_heads * d, dt)
        self.k_proj = Linear(h, config.num_kv_heads * d, dt)
        self.v_proj = Linear(h, config.num_kv_heads * d, dt)
        self.o_proj = Linear(config.num_heads * d, h, dt)

    def forward(
        self,
        layer_index: int,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(layer_index, q, k, v)
        if out.shape != q.shape:
            raise ValueError(
                f"attention callback returned shape {tuple(out.shape)}, expected {tuple(q.shape)}"
            )
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h, i, dt = config.hidden_size, config.intermediate_size, config.torch_dtype
        self.gate_proj = Linear(h, i, dt)
        self.up_proj = Linear(h, i, dt)
        self.down_proj = Linear(i, h, dt)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dt = config.torch_dtype
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)
        self.mlp = MLP(config)

    def forward(
        self,
        layer_index: int,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention: AttentionFn,
    ) -> torch.Tensor:
        h = h + self.self_attn(layer_index, self.input_layernorm(h), cos, sin, attention)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaBackbone(nn.Module):
    """HF's `model.` prefix: embeddings, decoder layers, final norm."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        dt = config.torch_dtype
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, dtype=dt)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dt)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaBackbone(config)
        self.rotary = RotaryEmbedding(config)
        # Tied: the head reuses the embedding matrix (no lm_head parameter at all).
        self.lm_head = (
            None
            if config.tie_embeddings
            else Linear(config.hidden_size, config.vocab_size, config.torch_dtype)
        )

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionFn,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [len(logits_indices) or T, vocab]: float64 for a float64 model, else float32.

        input_ids, positions: 1-D int64 [T], the tokens of every sequence in the batch, flattened.
        """
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D and equally long; got "
                f"{tuple(input_ids.shape)} and {tuple(positions.shape)}"
            )
        vocab = self.config.vocab_size
        if input_ids.numel() and not (0 <= int(input_ids.min()) and int(input_ids.max()) < vocab):
            raise ValueError(
                f"token ids must be in [0, {vocab}); got "
                f"{int(input_ids.min())}..{int(input_ids.max())}"
            )
        cos, sin = self.rotary(positions)
        h = self.model.embed_tokens(input_ids)
        for index, layer in enumerate(self.model.layers):
            h = layer(index, h, cos, sin, attention)
        if logits_indices is not None:
            h = h[logits_indices]
        logits = F.linear(self.model.norm(h), self.head_weight)
        return logits if logits.dtype == torch.float64 else logits.float()
