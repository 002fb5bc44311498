"""A request's sampling on the wire and in the engine: SamplingFields (SUBMIT,
KV_ALLOC_REQUEST) to the engine's SamplingParams, passed on unchanged from one message to the
next, and the logprob fields of TOKEN_EVENT and KV_DONE. Every tier builds them here, so every
tier samples alike and the machines can build their messages without a daemon."""

from __future__ import annotations

from typing import Any

from pddnet.engine.sampling import SamplingParams, TokenLogprob
from pddnet.protocol.messages import SAMPLING_FIELD_NAMES, SamplingFields


def sampling_of(fields: SamplingFields) -> SamplingParams:
    """The engine's sampling parameters for a request's wire fields (SUBMIT, KV_ALLOC_REQUEST):
    every tier builds the same ones, so every tier samples alike."""
    return SamplingParams(
        temperature=fields.temperature,
        top_p=fields.top_p,
        top_k=fields.top_k,
        seed=fields.seed,
        min_tokens=fields.min_tokens,
        stop_token_ids=tuple(fields.stop_token_ids),
        presence_penalty=fields.presence_penalty,
        frequency_penalty=fields.frequency_penalty,
        repetition_penalty=fields.repetition_penalty,
        logprobs=fields.logprobs,
    )


def sampling_fields(msg: SamplingFields) -> dict[str, Any]:
    """A message's SamplingFields as keyword arguments, to pass them on unchanged."""
    return {name: getattr(msg, name) for name in SAMPLING_FIELD_NAMES}


def event_logprobs(
    entries: list[TokenLogprob | None] | tuple[TokenLogprob, ...] | None, n: int
) -> dict[str, Any]:
    """TOKEN_EVENT's logprob fields for `n` tokens ({} when none are carried). Every token
    needs its entry and all the same k; otherwise nothing is carried (the router then reports
    the gap)."""
    present = [e for e in entries or () if e is not None]
    if not present or len(present) != n or len({len(e.top_ids) for e in present}) != 1:
        return {}
    return {
        "logprobs": tuple(e.logprob for e in present),
        "top_logprob_ids": tuple(i for e in present for i in e.top_ids),
        "top_logprobs": tuple(x for e in present for x in e.top_logprobs),
    }


def kv_done_logprob(entry: TokenLogprob | None) -> dict[str, Any]:
    """KV_DONE's fields for the first token's logprobs (P samples it)."""
    if entry is None:
        return {}
    return {
        "first_logprob": entry.logprob,
        "first_top_ids": entry.top_ids,
        "first_top_logprobs": entry.top_logprobs,
    }
