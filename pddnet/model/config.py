"""Model configuration and the built-in presets.

All presets use the byte tokenizer's vocabulary (256 bytes, then BOS, EOS, PAD), so a preset
runs without any tokenizer file. `tiny` runs in float64 so tests can compare results exactly,
and so does `tiny-long`, its long-context sibling (128K positions, the smallest compute), and
`tiny-window`, tiny-long with sliding-window attention (its real attention cost bounded by the
window, not the context); `small` and `medium` are sized for benchmarks: their per-token KV
(16 KiB and 32 KiB in float32) makes KV transfers behave like a real model's, scaled down.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported lazily so `pdd --help` stays fast
    import torch

# The byte tokenizer's special ids; kept here so presets and tokenizer agree by construction.
BYTE_VOCAB = 256
BYTE_BOS_ID = 256
BYTE_EOS_ID = 257
BYTE_PAD_ID = 258
BYTE_VOCAB_SIZE = 259

DTYPES = ("float64", "float32", "bfloat16")
_ITEMSIZE = {"float64": 8, "float32": 4, "bfloat16": 2}


@dataclass(frozen=True)
class ModelConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    max_position: int
    tie_embeddings: bool
    dtype: str  # "float64" | "float32" | "bfloat16"
    bos_token_id: int
    eos_token_id: int
    # HF `rope_scaling` as sorted (key, value) pairs (hashable), e.g. Llama 3.x's "llama3" type;
    # empty for plain RoPE.
    rope_scaling: tuple[tuple[str, object], ...] = ()
    # Sliding-window attention (Mistral's, HF's convention): the query at position p sees keys
    # max(0, p - W + 1) .. p, W keys including itself. None: full causal attention. The KV of
    # every position is still stored (the pool, transfers and the prefix cache do not change);
    # only what attention reads does.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        positive = (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "max_position",
        )
        for field in positive:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{field} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        window = self.sliding_window
        if window is not None and (
            not isinstance(window, int) or isinstance(window, bool) or window < 1
        ):
            raise ValueError(f"sliding_window must be None or an integer >= 1, got {window!r}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        for field in ("bos_token_id", "eos_token_id"):
            value = getattr(self, field)
            if not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"{field} {value} is outside the vocabulary (vocab_size {self.vocab_size})"
                )

    @classmethod
    def preset(cls, name: str, dtype: str | None = None) -> ModelConfig:
        try:
            config = PRESETS[name]
        except KeyError:
            raise ValueError(
                f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}"
            ) from None
        return config if dtype is None else config.with_dtype(dtype)

    def with_dtype(self, dtype: str) -> ModelConfig:
        return dataclasses.replace(self, dtype=dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.dtype)

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self.dtype]

    @property
    def kv_bytes_per_token(self) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * h * self.intermediate_size
        per_layer = attn + mlp + 2 * h
        head = 0 if self.tie_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * per_layer + h + head


def _byte_vocab_config(
    name: str,
    shape: tuple[int, int, int, int, int, int],
    max_position: int,
    dtype: str,
    rope_theta: float = 10000.0,
    sliding_window: int | None = None,
) -> ModelConfig:
    """A preset over the byte vocabulary; ``shape``: hidden size, MLP size, layers, query
    heads, kv heads, head_dim."""
    hidden, intermediate, layers, heads, kv_heads, head_dim = shape
    return ModelConfig(
        name=name,
        vocab_size=BYTE_VOCAB_SIZE,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position=max_position,
        rope_theta=rope_theta,
        rms_norm_eps=1e-6,
        tie_embeddings=False,
        bos_token_id=BYTE_BOS_ID,
        eos_token_id=BYTE_EOS_ID,
        dtype=dtype,
        sliding_window=sliding_window,
    )


# shape: (hidden size, MLP size, layers, query heads, kv heads, head_dim)
PRESETS: dict[str, ModelConfig] = {
    # 1 KiB of KV per token; float64 so decode, extend and full forwards agree to ~1e-12.
    "tiny": _byte_vocab_config("tiny", (64, 128, 2, 4, 2, 16), 4096, "float64"),
    # Long context (128K positions, Llama 3's rope_theta) at the least compute a Llama-style
    # model can have: 2 layers, GQA with 2 query heads on 1 kv head, head_dim 8; 256 bytes of
    # KV per token, ~32K parameters. float64, so it is token-exact like `tiny`. At 64K tokens
    # attention is nearly all of its work, so its step time is the paged attention's.
    "tiny-long": _byte_vocab_config(
        "tiny-long", (32, 64, 2, 2, 1, 8), 131072, "float64", rope_theta=500000.0
    ),
    # tiny-long whose attention reads only the last 512 positions (as Mistral's): its real cost
    # per token is bounded by the window, not the context, while the KV of every position is
    # still stored, moved and cached. Emulated devices pace it to a target model's full attention
    # (docs/emulated-devices.md), so long contexts need a small dilation.
    "tiny-window": _byte_vocab_config(
        "tiny-window",
        (32, 64, 2, 2, 1, 8),
        131072,
        "float64",
        rope_theta=500000.0,
        sliding_window=512,
    ),
    # 8 layers x 2 (K,V) x 4 kv heads x 64 x 4 bytes = 16 KiB per token; ~19M parameters.
    "small": _byte_vocab_config("small", (512, 1024, 8, 8, 4, 64), 16384, "float32"),
}
# tiny-window with 8x its KV per token (2 layers x 2 x 4 kv heads x 16 x 8 bytes = 2 KiB), for
# the handoff on the packet shell: an emulated device's wire carries the real model's KV for the
# target's, 28x fewer bytes of qwen2.5-7b's instead of tiny-window's 224x, so a packet stands for
# 28 of the target's rather than 224 and a 20 ms buffer holds ~120 packets rather than 16.
PRESETS["tiny-window-wide"] = dataclasses.replace(
    PRESETS["tiny-window"],
    name="tiny-window-wide",
    hidden_size=64,
    intermediate_size=128,
    num_heads=4,
    num_kv_heads=4,
    head_dim=16,
)
# `small` with twice the layers: 16 x 2 x 4 x 64 x 4 bytes = 32 KiB per token; ~38M parameters.
PRESETS["medium"] = dataclasses.replace(PRESETS["small"], name="medium", num_layers=16)
