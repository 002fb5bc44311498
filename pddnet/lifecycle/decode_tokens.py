"""One request's tokens on the decode side, as the wire carries them: where a token ends the
request (REQUEST_DONE.reason), the first token's logprobs in KV_DONE, and the logprobs each
TOKEN_EVENT takes along. Every tier decides these the same way, here."""

from __future__ import annotations

from pddnet.engine.engine import StepOutput
from pddnet.engine.sampling import TokenLogprob
from pddnet.engine.sequence import FinishReason
from pddnet.protocol import KvDone
from pddnet.protocol.messages import SamplingFields

# How a finished engine sequence ends on the wire (REQUEST_DONE.reason).
DONE_REASON = {FinishReason.STOP: "eos", FinishReason.LENGTH: "length"}


def first_token_logprob(done: KvDone) -> TokenLogprob | None:
    """The first token's logprobs as KV_DONE carries them (None: not requested)."""
    if done.first_logprob is None:
        return None
    return TokenLogprob(
        done.first_token_id,
        done.first_logprob,
        tuple(done.first_top_ids),
        tuple(done.first_top_logprobs),
    )


def first_token_ends(token: int, fields: SamplingFields, eos: int | None) -> str | None:
    """REQUEST_DONE reason when P's first token already ends the request, else None."""
    if not fields.ignore_eos and eos is not None and token == eos:
        return "eos"
    if token in fields.stop_token_ids:
        return "stop"
    if fields.max_tokens <= 1:
        return "length"
    return None


def step_end_reasons(out: StepOutput, stop_token_ids: tuple[int, ...]) -> list[str | None] | None:
    """Per new token of a step: the REQUEST_DONE reason it ends the request with, or None.
    None for the whole step when it is the engine reporting our own abort. The engine knows
    EOS and max_tokens; extra stop tokens (SUBMIT.stop_token_ids) are checked here, the same
    way on every tier, and the caller then aborts the engine sequence."""
    if out.finished and out.finish_reason not in DONE_REASON:
        return None
    reasons: list[str | None] = [None] * len(out.new_token_ids)
    for i, tok in enumerate(out.new_token_ids):
        if tok in stop_token_ids:
            reasons[i] = "stop"
            return reasons[: i + 1]
    if out.finished and reasons:
        reasons[-1] = DONE_REASON[out.finish_reason]
    return reasons


def take_logprobs(
    store: dict[int, TokenLogprob], fields: SamplingFields, index: int, n: int
) -> list[TokenLogprob | None] | None:
    """The logprob entries of output indices [index, index + n) for a TOKEN_EVENT, taken out
    of a request's store (index -> entry, filled as the engine samples); None when the request
    does not ask for logprobs."""
    if fields.logprobs is None:
        return None
    return [store.pop(i, None) for i in range(index, index + n)]
