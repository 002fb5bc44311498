"""Token sampling whose randomness is a pure function of (request seed, token position).

No instance holds an RNG stream: the uniform draw for the token at absolute index `position`
comes from xxhash64 of (seed, position). Two instances that reach the same position with the
same logits therefore pick the same token, which is what lets a request move between relay and
main decode mid-stream and stay token-exact. The draw is an inverse-CDF lookup over the kept
tokens in a fixed order (probability descending, id ascending), computed in float64, so the
result also does not depend on torch's RNG implementation or version.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

_U64 = 1 << 64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0  # nucleus: keep the smallest top set whose probability reaches top_p
    top_k: int = 0  # 0 -> no limit
    seed: int | None = None  # required when temperature > 0 (the engine fills it in)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        t, p, k, s = self.temperature, self.top_p, self.top_k, self.seed
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = no limit), got {k!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int) or not 0 <= s < _U64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {s!r}")


def uniform_for(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) determined by (seed, position) alone (53 random bits)."""
    digest = xxhash.xxh64_intdigest(struct.pack("<QQ", seed, position))
    return (digest >> 11) * (1.0 / (1 << 53))


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(f"logits must be a non-empty 1-D [vocab] tensor, got shape "
                         f"{tuple(logits.shape)}")
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")


def _greedy(logits: torch.Tensor) -> int:
    # torch.argmax returns the first maximal index: lowest id wins ties.
    return int(torch.argmax(logits))


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token to place at absolute sequence index `position` (>= 0), given its logits."""
    params.validate()
    _check_logits(logits)
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if params.greedy:
        return _greedy(logits)
    if params.seed is None:
        raise ValueError("temperature > 0 needs a seed; the engine resolves seed=None to a "
                         "concrete seed when it admits the request")
    scaled = logits.detach().to(torch.float64) / params.temperature
    # Fixed order: value descending, then id ascending (stable sort), so ties cut the same way.
    order = torch.sort(scaled, descending=True, stable=True).indices
    if 0 < params.top_k < order.numel():
        order = order[: params.top_k]
    probs = torch.softmax(scaled[order], dim=0)
    if params.top_p < 1.0:
        before = torch.cumsum(probs, dim=0) - probs  # mass of strictly better-ranked tokens
        probs = probs[: max(1, int((before < params.top_p).sum()))]
    cdf = torch.cumsum(probs, dim=0)
    u = uniform_for(params.seed, position) * float(cdf[-1])
    index = min(int(torch.searchsorted(cdf, u, right=True)), cdf.numel() - 1)
    return int(order[index])


def sample_batch(logits: torch.Tensor, params: Sequence[SamplingParams],
                 positions: Sequence[int]) -> list[int]:
    """Row i of logits [B, vocab] sampled with params[i] for position positions[i]."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
        raise ValueError(f"logits [B, vocab] ({tuple(logits.shape)}), params ({len(params)}) and "
                         f"positions ({len(positions)}) must agree on B")
    if all(p.greedy for p in params):
        for p in params:
            p.validate()
        if torch.isnan(logits).any():
            raise ValueError("logits contain NaN")
        if any(pos < 0 for pos in positions):
            raise ValueError(f"positions must be >= 0, got {list(positions)}")
        return [int(t) for t in torch.argmax(logits, dim=-1)]
    return [sample_token(row, p, pos) for row, p, pos in zip(logits, params, positions, strict=True)]
