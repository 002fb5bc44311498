"""Handoff mode policy: one-shot vs streaming token-id handoff from RLD to MD.

One-shot frees RLD soonest but makes MD digest the whole backlog in one extend step (a visible
stall when the backlog is large). Streaming caps MD's extend at `chunk` tokens per step while RLD
keeps decoding, so the client never sees a long gap, at the cost of RLD occupancy. Dynamic picks
per request: one-shot for a small backlog (the stall is about one decode step anyway, since
decode is memory-bound) or when RLD is loaded past a limit (free it now), streaming otherwise.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class HandoffMode(str, enum.Enum):
    ONE_SHOT = "one-shot"
    STREAMING = "streaming"
    DYNAMIC = "dynamic"

    @classmethod
    def parse(cls, value: str | HandoffMode) -> HandoffMode:
        if isinstance(value, HandoffMode):
            return value
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise ValueError(f"unknown handoff mode {value!r}; expected one of {names}") from None


@dataclass(frozen=True)
class HandoffDecision:
    mode: HandoffMode  # ONE_SHOT or STREAMING, never DYNAMIC
    reason: str
    chunk: int  # max tokens MD extends per step (the whole backlog for one-shot)


@dataclass(frozen=True)
class HandoffPolicy:
    mode: HandoffMode = HandoffMode.DYNAMIC
    threshold_tokens: int = 64
    chunk: int = 16
    rld_load_limit: float = 0.8  # fraction of RLD capacity beyond which RLD is freed at once

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", HandoffMode.parse(self.mode))
        if self.threshold_tokens < 0:
            raise ValueError(f"threshold_tokens must be >= 0, got {self.threshold_tokens}")
        if self.chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {self.chunk}")
        if not 0.0 <= self.rld_load_limit <= 1.0:
            raise ValueError(f"rld_load_limit must be in [0, 1], got {self.rld_load_limit}")

    def decide(self, backlog_tokens: int, rld_load: float) -> HandoffDecision:
        """Choose how to hand over a request whose RLD has generated `backlog_tokens` so far.

        `rld_load` is RLD's current occupancy in [0, 1] (running tokens / capacity).
        """
        if backlog_tokens < 0:
            raise ValueError(f"backlog_tokens must be >= 0, got {backlog_tokens}")
        one_shot = HandoffDecision(HandoffMode.ONE_SHOT, "", max(backlog_tokens, 1))
        if self.mode is HandoffMode.ONE_SHOT:
            return _with_reason(one_shot, "configured one-shot")
        if self.mode is HandoffMode.STREAMING:
            return HandoffDecision(HandoffMode.STREAMING, "configured streaming", self.chunk)
        if backlog_tokens <= self.threshold_tokens:
            return _with_reason(
                one_shot, f"backlog {backlog_tokens} <= threshold {self.threshold_tokens}"
            )
        if rld_load > self.rld_load_limit:
            return _with_reason(
                one_shot, f"RLD load {rld_load:.2f} > limit {self.rld_load_limit:.2f}"
            )
        return HandoffDecision(
            HandoffMode.STREAMING,
            f"backlog {backlog_tokens} > threshold {self.threshold_tokens}",
            self.chunk,
        )


def _with_reason(decision: HandoffDecision, reason: str) -> HandoffDecision:
    return HandoffDecision(decision.mode, reason, decision.chunk)
