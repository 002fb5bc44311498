"""A request the router replays on a decode tier by token ids, sans-IO: one engine step in,
the tokens to emit and the end out (the same end rules as every tier, decode_tokens.py)."""

from __future__ import annotations

from pddnet.engine.engine import StepOutput
from pddnet.engine.sampling import TokenLogprob
from pddnet.lifecycle.actions import DecodeAction, EmitTokens, FinishRequest, StopSequence
from pddnet.lifecycle.decode_tokens import step_end_reasons


class ReplayRequest:
    """The router lost the daemon producing this request and replays it here: prompt + the
    tokens the client already has, recomputed by one prefill/extend, then decoding on from
    index len(output_token_ids). Sampling is a pure function of (seed, position), so the
    continuation is token-exact. Actions: EmitTokens, FinishRequest, StopSequence (an extra
    stop token the engine does not know)."""

    def __init__(self, num_prompt_tokens: int, stop_token_ids: tuple[int, ...]) -> None:
        self.num_prompt_tokens = num_prompt_tokens
        self.stop_token_ids = stop_token_ids
        self.ended = False

    def engine_step(
        self, out: StepOutput
    ) -> tuple[list[DecodeAction], tuple[TokenLogprob, ...] | None]:
        """The actions of one engine step, and the emitted tokens' logprobs (if asked)."""
        reasons = step_end_reasons(out, self.stop_token_ids)
        if reasons is None or self.ended:
            return [], None  # our own abort
        new = tuple(out.new_token_ids[: len(reasons)])
        actions: list[DecodeAction] = []
        if new:
            actions.append(EmitTokens(out.output_index, new))
        reason = reasons[-1] if reasons else None
        if reason is not None:
            self.ended = True
            actions.append(FinishRequest(reason, out.output_index + len(new)))
            if not out.finished:  # an extra stop token: the engine does not know it
                actions.append(StopSequence())
        return actions, (out.logprobs[: len(new)] if out.logprobs else None)
