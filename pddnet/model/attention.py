"""Reference causal grouped-query attention over one sequence's contiguous keys/values.

The model never owns a KV cache: its caller stores K/V wherever it likes (the engine's paged
pool) and gathers them back for this function. Query head h reads kv head h // group, the same
mapping as HF's `repeat_kv`.
"""

from __future__ import annotations

import math

import torch


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_offset: int,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of queries at positions q_offset.. over keys/values at positions 0..n-1.

    q [t, Hq, D]; k, v [n, Hkv, D] with n >= q_offset + t; query i sees keys 0..q_offset+i, or
    with a sliding ``window`` W only the last W of them, max(0, q_offset+i-W+1)..q_offset+i.
    Returns [t, Hq, D] in q's dtype (low-precision inputs are computed in float32).
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [tokens, heads, head_dim]; got shapes "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    t, num_heads, head_dim = q.shape
    n, num_kv_heads, _ = k.shape
    if k.shape != v.shape or k.shape[2] != head_dim:
        raise ValueError(
            f"k {tuple(k.shape)} and v {tuple(v.shape)} must match, with head_dim {head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})"
        )
    if q_offset < 0 or n < q_offset + t:
        raise ValueError(
            f"{n} keys cannot cover queries at positions {q_offset}..{q_offset + t - 1}"
        )
    if window is not None and window < 1:
        raise ValueError(f"window must be None or >= 1, got {window}")
    compute = q.dtype if q.dtype in (torch.float32, torch.float64) else torch.float32
    group = num_heads // num_kv_heads
    # Fold each kv head's query group into the rows of one batched matmul: [Hkv, group*t, D].
    # (Broadcasting K across the group instead makes torch copy K once per query head.)
    qf = (
        q.to(compute)
        .reshape(t, num_kv_heads, group, head_dim)
        .permute(1, 2, 0, 3)
        .reshape(num_kv_heads, group * t, head_dim)
    )
    kf = k.to(compute).permute(1, 2, 0)  # [Hkv, D, n]
    vf = v.to(compute).permute(1, 0, 2)  # [Hkv, n, D]
    scores = torch.bmm(qf, kf).mul_(1.0 / math.sqrt(head_dim))
    # some key is in some query's future, or older than some query's window
    if q_offset + 1 < n or (window is not None and q_offset + t > window):
        keys, positions = torch.arange(n)[None, :], (q_offset + torch.arange(t))[:, None]
        visible = keys <= positions
        if window is not None:
            visible &= keys > positions - window
        scores = scores.view(num_kv_heads, group, t, n).masked_fill_(~visible, float("-inf"))
        scores = scores.view(num_kv_heads, group * t, n)
    out = torch.bmm(torch.softmax(scores, dim=-1), vf)  # [Hkv, group*t, D]
    out = out.view(num_kv_heads, group, t, head_dim).permute(2, 0, 1, 3)
    return out.reshape(t, num_heads, head_dim).to(q.dtype)
