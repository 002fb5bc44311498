"""One request's state inside an engine: its tokens, how many have KV, and its blocks.

The one invariant everything leans on: ``token_ids = prompt + output`` and the first
``num_computed_tokens`` of them have their K/V in the pool. A sequence that is decoding has
exactly one uncomputed token (the last one), computed in the same forward that samples the next.
Known tokens appended from outside (token-id handoff) are simply more uncomputed tokens: the
engine computes them with an extend forward and samples only once it reaches the end.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from pddnet.engine.sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not admitted yet: holds no claim on the pool
    RUNNING = "running"  # admitted: its whole-life block claim is reserved
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS or one of the request's stop_token_ids sampled (or appended)
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # aborted by the caller

    def __str__(self) -> str:
        return self.value


@dataclass(eq=False)
class Sequence:
    request_id: str
    token_ids: list[int]  # prompt followed by output
    num_prompt_tokens: int
    sampling: SamplingParams
    max_tokens: int
    eos_token_id: int | None
    ignore_eos: bool = False
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    # At most this many tokens of this sequence go into one step (prefill chunk or extend).
    max_chunk_tokens: int | None = None
    # Held: compute known tokens but do not sample (streaming handoff: more tokens will come).
    hold: bool = False
    # Keep the blocks after finishing (prefill-only requests whose KV is exported afterwards).
    keep_blocks: bool = False
    # Chained hashes of the leading full blocks already indexed in the prefix cache.
    block_hashes: list[int] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0
    num_sampled_tokens: int = 0  # sampled here (the rest were given)
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def compute_target(self) -> int:
        """How many tokens should have KV before the next step that samples (or waits)."""
        return self.num_tokens - 1 if self.hold else self.num_tokens

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to compute before this sequence samples (or idles, when held)."""
        return max(0, self.compute_target - self.num_computed_tokens)

    @property
    def max_kv_tokens(self) -> int:
        """Most tokens this sequence will ever store KV for: the final token is never computed."""
        return self.num_prompt_tokens + self.max_tokens - 1

    def max_blocks(self, block_size: int) -> int:
        return math.ceil(self.max_kv_tokens / block_size)

    def remaining_claim(self, block_size: int) -> int:
        """Blocks this sequence may still allocate before it finishes."""
        return max(0, self.max_blocks(block_size) - len(self.block_table))

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def stop_reason_after(self, token_id: int) -> FinishReason | None:
        """Why the sequence stops once ``token_id`` has been appended (None: it goes on)."""
        if not self.ignore_eos and self.eos_token_id is not None and token_id == self.eos_token_id:
            return FinishReason.STOP
        if token_id in self.sampling.stop_token_ids:
            return FinishReason.STOP
        if self.num_output_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None
