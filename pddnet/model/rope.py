"""Rotary position embeddings in the Hugging Face Llama convention (`rotate_half`).

HF checkpoints are trained with this pairing (dimension i rotates with i + head_dim/2, not
with its neighbour), so using it is what makes their weights load right. Angles are computed
per position in float64 and cast to the model dtype: the result for a position never depends on
which other positions share the batch, so decode, extend and full forwards see the same values.
"""

from __future__ import annotations

import math

import torch

from pddnet.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float64 inverse frequencies, with HF `rope_scaling` applied if any."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    scaling = dict(config.rope_scaling)
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])  # type: ignore[arg-type]
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    raise ValueError(f"rope_scaling type {kind!r} is not supported (default, linear, llama3)")


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict[str, object]) -> torch.Tensor:
    # Llama 3.1+: long wavelengths are slowed by `factor`, short ones kept, the band between
    # interpolated smoothly (same formula as transformers' _compute_llama3_parameters).
    factor = float(scaling["factor"])  # type: ignore[arg-type]
    low = float(scaling["low_freq_factor"])  # type: ignore[arg-type]
    high = float(scaling["high_freq_factor"])  # type: ignore[arg-type]
    old_len = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.dtype = config.torch_dtype
        self.register_buffer("inv_freq", inverse_frequencies(config), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, head_dim] (broadcast over heads)."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        return angles.cos().to(self.dtype), angles.sin().to(self.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] rotated by the angles of its token's position."""
    return x * cos + rotate_half(x) * sin
