"""Token sampling whose randomness is a pure function of (request seed, token position).

No instance holds an RNG stream: the uniform draw for the token at absolute index `position`
comes from xxhash64 of (seed, position). Two instances that reach the same position with the
same logits therefore pick the same token, which is what lets a request move between relay and
main decode mid-stream and stay token-exact. The draw is an inverse-CDF lookup over the kept
tokens in a fixed order (probability descending, id ascending), computed in float64, so the
result also does not depend on torch's RNG implementation or version.

Logits processing (vLLM's semantics, applied before temperature, greedy included), a pure
function of the request's token history -- the prompt and the output token ids so far, which
every instance holding the request has (P: the prompt; RLD: + P's first token; MD: + the ids
RLD handed over; a replay: + the ids the client already has):

1. ``min_tokens``: while fewer than ``min_tokens`` output tokens exist, EOS and every
   ``stop_token_ids`` entry are masked (-inf), so the request cannot end early;
2. ``repetition_penalty`` (HF / CTRL): a token that occurs in the prompt or the output has its
   logit divided by the penalty when positive, multiplied by it when not;
3. ``frequency_penalty``: minus penalty x the token's count in the output;
4. ``presence_penalty``: minus penalty once if the token occurs in the output.

Log-probabilities (``logprobs``) are vLLM's default "raw" ones: log-softmax of the model's own
logits, before any of the processing above, temperature or top-k/top-p.

``n`` > 1 completions of one prompt: choice i samples with ``choice_seed(seed, i)``
= ``(seed + i) mod 2**64`` (what vLLM does), so choice 0 is the n = 1 completion.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xxhash

_U64 = 1 << 64
MAX_LOGPROBS = 20  # most top log-probabilities a token may carry (vLLM's max_logprobs)
LOGPROB_FLOOR = -9999.0  # what vLLM reports for -inf (JSON has no infinities)
PENALTY_RANGE = 2.0  # presence / frequency penalties lie in [-2, 2] (OpenAI)
MAX_REPETITION_PENALTY = 100.0


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice `index` of an ``n`` > 1 request whose seed is `seed` (as vLLM)."""
    return (seed + index) % _U64


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 -> greedy
    top_p: float = 1.0  # nucleus: keep the smallest top set whose probability reaches top_p
    top_k: int = 0  # 0 -> no limit
    seed: int | None = None  # required when temperature > 0 (the engine fills it in)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many outputs exist
    stop_token_ids: tuple[int, ...] = ()  # end the request when sampled (besides EOS)
    presence_penalty: float = 0.0  # on output tokens, once per distinct token
    frequency_penalty: float = 0.0  # on output tokens, per occurrence
    repetition_penalty: float = 1.0  # on prompt + output tokens; 1 = off
    logprobs: int | None = None  # report the sampled token's logprob and this many top ones

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_logits(self) -> bool:
        """Whether the logits depend on the token history (penalties, min_tokens)."""
        return bool(
            self.min_tokens
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
        )

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
        m = self.min_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"min_tokens must be an integer >= 0, got {m!r}")
        ids = self.stop_token_ids
        if not isinstance(ids, (tuple, list)) or not all(
            isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids
        ):
            raise ValueError(f"stop_token_ids must be a sequence of token ids >= 0, got {ids!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if (
                isinstance(v, bool)
                or not isinstance(v, (int, float))
                or not -PENALTY_RANGE <= v <= PENALTY_RANGE
            ):
                raise ValueError(f"{name} must be in [-2, 2], got {v!r}")
        r = self.repetition_penalty
        if (
            isinstance(r, bool)
            or not isinstance(r, (int, float))
            or not 0 < r <= MAX_REPETITION_PENALTY
        ):
            raise ValueError(
                f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {r!r}"
            )
        lp = self.logprobs
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, int) or not 0 <= lp <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {lp!r}"
            )


@dataclass(frozen=True)
class TokenLogprob:
    """A sampled token's raw log-probability and the `k` most likely tokens' (rank order:
    logprob descending, id ascending)."""

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()


def uniform_for(seed: int, position: int) -> float:
    """A uniform draw in [0, 1) determined by (seed, position) alone (53 random bits)."""
    digest = xxhash.xxh64_intdigest(struct.pack("<QQ", seed, position))
    return (digest >> 11) * (1.0 / (1 << 53))


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 1 or logits.numel() == 0:
        raise ValueError(
            f"logits must be a non-empty 1-D [vocab] tensor, got shape {tuple(logits.shape)}"
        )
    if torch.isnan(logits).any():
        raise ValueError("logits contain NaN")


def _greedy(logits: torch.Tensor) -> int:
    # torch.argmax returns the first maximal index: lowest id wins ties.
    return int(torch.argmax(logits))


def process_logits(
    logits: torch.Tensor,
    params: SamplingParams,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """The logits the request samples from (float64; the input when nothing applies): the
    min_tokens mask and the penalties above, from the token history alone."""
    if not params.processes_logits:
        return logits
    out = logits.detach().to(torch.float64).clone()
    vocab = out.numel()
    if len(output_ids) < params.min_tokens:
        stops = [
            t for t in (*params.stop_token_ids, eos_token_id) if t is not None and 0 <= t < vocab
        ]
        if stops:
            out[torch.tensor(stops, dtype=torch.long)] = -math.inf
    if params.repetition_penalty != 1.0:
        seen = torch.zeros(vocab, dtype=torch.bool)
        for ids in (prompt_ids, output_ids):
            if len(ids):
                seen[torch.as_tensor(list(ids), dtype=torch.long)] = True
        r = float(params.repetition_penalty)
        hit = out[seen]
        out[seen] = torch.where(hit > 0, hit / r, hit * r)
    if (params.frequency_penalty or params.presence_penalty) and len(output_ids):
        counts = torch.bincount(
            torch.as_tensor(list(output_ids), dtype=torch.long), minlength=vocab
        )[:vocab].to(torch.float64)
        out -= float(params.frequency_penalty) * counts
        out -= float(params.presence_penalty) * (counts > 0).to(torch.float64)
    return out


def token_logprob(logits: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """Raw log-probabilities of the model's logits: the sampled token's and the top k."""
    logp = torch.log_softmax(logits.detach().to(torch.float64), dim=-1)
    lp = max(float(logp[token_id]), LOGPROB_FLOOR)
    if k <= 0:
        return TokenLogprob(int(token_id), lp)
    order = torch.sort(logp, descending=True, stable=True).indices[:k]
    return TokenLogprob(
        int(token_id),
        lp,
        tuple(int(i) for i in order),
        tuple(max(float(logp[i]), LOGPROB_FLOOR) for i in order),
    )


def sample_token(logits: torch.Tensor, params: SamplingParams, position: int) -> int:
    """The token to place at absolute sequence index `position` (>= 0), given its logits
    (already processed: see `process_logits`)."""
    params.validate()
    _check_logits(logits)
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    if params.greedy:
        return _greedy(logits)
    if params.seed is None:
        raise ValueError(
            "temperature > 0 needs a seed; the engine resolves seed=None to a "
            "concrete seed when it admits the request"
        )
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


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    eos_token_id: int | None = None,
) -> list[int]:
    """Row i of logits [B, vocab] sampled with params[i] for position positions[i].
    `histories[i]` = (prompt ids, output ids so far) of row i: needed when its params
    process the logits (penalties, min_tokens; `eos_token_id` is what min_tokens masks)."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(positions):
        raise ValueError(
            f"logits [B, vocab] ({tuple(logits.shape)}), params ({len(params)}) and "
            f"positions ({len(positions)}) must agree on B"
        )
    if any(p.processes_logits for p in params):
        if histories is None or len(histories) != len(params):
            raise ValueError(
                "penalties and min_tokens need each row's token history "
                "(histories=[(prompt ids, output ids), ...])"
            )
        rows = [
            process_logits(row, p, h[0], h[1], eos_token_id) if p.processes_logits else row
            for row, p, h in zip(logits, params, histories, strict=True)
        ]
        return [
            sample_token(row, p, pos) for row, p, pos in zip(rows, params, positions, strict=True)
        ]
    if all(p.greedy for p in params):
        for p in params:
            p.validate()
        if torch.isnan(logits).any():
            raise ValueError("logits contain NaN")
        if any(pos < 0 for pos in positions):
            raise ValueError(f"positions must be >= 0, got {list(positions)}")
        return [int(t) for t in torch.argmax(logits, dim=-1)]
    return [
        sample_token(row, p, pos) for row, p, pos in zip(logits, params, positions, strict=True)
    ]
