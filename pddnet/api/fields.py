"""The fields both OpenAI endpoints share, validated: sampling (OpenAI's and vLLM's extensions),
max_tokens against the context, n, stop strings, logprobs; `sampling_request` builds the
`CompletionRequest` (sans-IO; a bad field raises a 400 `ApiError` naming it).
"""

from __future__ import annotations

import math
from typing import Any

from pddnet.api.types import CompletionRequest, ModelInfo, bad_request

U64 = 1 << 64
HANDOFF_CHOICES = ("one-shot", "streaming", "dynamic")
MAX_N = 16  # most choices (`n`) per request
MAX_LOGPROBS = 20  # most top logprobs per token (vLLM's default max_logprobs)
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
MAX_REPETITION_PENALTY = 100.0


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def type_name(v: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }.get(type(v), "a number" if is_number(v) else type(v).__name__)


def check_max_tokens(
    max_tokens: Any, key: str, prompt_len: int, model: ModelInfo, limit: int
) -> None:
    if not is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"{key} must be an integer >= 1, got {max_tokens!r}", key)
    if max_tokens > limit:
        raise bad_request(f"{key} {max_tokens} exceeds this server's limit of {limit}", key)
    if prompt_len + max_tokens > model.max_position:
        raise bad_request(
            f"This model's maximum context length is {model.max_position} tokens; "
            f"you requested {prompt_len + max_tokens} ({prompt_len} in "
            f"the prompt, {max_tokens} for the completion)",
            key,
            "context_length_exceeded",
        )


def sampling_request(
    body: dict[str, Any],
    name: str,
    prompt_ids: tuple[int, ...],
    prompt_text: str | None,
    max_tokens: int,
    logprobs: int | None,
    chat: bool,
    model: ModelInfo,
) -> CompletionRequest:
    """The fields both endpoints share."""
    temperature = number_field(body, "temperature", 1.0, 0.0, 2.0)
    top_p = number_field(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad_request("top_p must be in (0, 1], got 0", "top_p")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not is_int(top_k) or top_k < -1:
        raise bad_request(
            f"top_k must be an integer >= 0 (0 or -1 = no limit), got {top_k!r}", "top_k"
        )
    seed = body.get("seed")
    if seed is not None and (not is_int(seed) or not 0 <= seed < U64):
        raise bad_request(f"seed must be an integer in [0, 2**64), got {seed!r}", "seed")
    stream = bool_field(body, "stream")
    return_ids = bool_field(body, "return_token_ids")
    ignore_eos = bool_field(body, "ignore_eos")
    include_usage = continuous = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad_request(
                "stream_options must be an object with include_usage", "stream_options"
            )
        if not stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        include_usage = bool_field(opts, "include_usage", "stream_options.include_usage")
        continuous = bool_field(
            opts, "continuous_usage_stats", "stream_options.continuous_usage_stats"
        )
    stop_ids = body.get("stop_token_ids") or []
    if (
        not isinstance(stop_ids, list)
        or len(stop_ids) > 256
        or not all(is_int(t) and 0 <= t < model.vocab_size for t in stop_ids)
    ):
        raise bad_request(
            f"stop_token_ids must be an array of at most 256 token ids in [0, {model.vocab_size})",
            "stop_token_ids",
        )
    handoff = body.get("handoff_mode")
    if handoff is not None and handoff not in HANDOFF_CHOICES:
        raise bad_request(
            f"handoff_mode must be one of {', '.join(HANDOFF_CHOICES)}, got {handoff!r}",
            "handoff_mode",
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"user must be a string, got {type_name(user)}", "user")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not is_int(n) or not 1 <= n <= MAX_N:
        raise bad_request(f"n must be an integer in [1, {MAX_N}], got {n!r}", "n")
    best_of = body.get("best_of")
    if best_of is not None and best_of != n:
        raise bad_request(
            f"best_of={best_of!r} is not supported by this server (only null or equal to n)",
            "best_of",
            "unsupported_parameter",
        )
    min_tokens = body.get("min_tokens", 0)
    if min_tokens is None:
        min_tokens = 0
    if not is_int(min_tokens) or min_tokens < 0:
        raise bad_request(f"min_tokens must be an integer >= 0, got {min_tokens!r}", "min_tokens")
    if min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}",
            "min_tokens",
        )
    stop = stop_strings(body.get("stop"))
    presence = number_field(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = number_field(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = number_field(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)
    if repetition == 0:
        raise bad_request("repetition_penalty must be > 0 (1 = off), got 0", "repetition_penalty")
    return CompletionRequest(
        model=name,
        prompt_token_ids=prompt_ids,
        prompt_text=prompt_text,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=max(top_k, 0),
        seed=seed,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=return_ids,
        ignore_eos=ignore_eos,
        stop_token_ids=tuple(stop_ids),
        handoff_mode=handoff,
        n=n,
        min_tokens=min_tokens,
        stop=stop,
        include_stop_str_in_output=bool_field(body, "include_stop_str_in_output"),
        logprobs=logprobs,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        continuous_usage=continuous,
        chat=chat,
    )


def stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(
            f"stop must be a string or an array of strings, got {type_name(value)}", "stop"
        )
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(items)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise bad_request(f"stop strings must be 1..{MAX_STOP_LEN} characters", "stop")
    return tuple(items)


def number_field(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if not is_number(value):
        raise bad_request(f"{key} must be a number, got {type_name(value)}", key)
    if not lo <= value <= hi:
        raise bad_request(f"{key} must be in [{lo:g}, {hi:g}], got {value!r}", key)
    return float(value)


def bool_field(
    body: dict[str, Any], key: str, param: str | None = None, default: bool = False
) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{param or key} must be true or false, got {value!r}", param or key)
    return value
