"""OpenAI completions API: request parsing/validation and response shapes (sans-IO).

`parse_completion_request` turns a decoded JSON body into a `CompletionRequest` or raises
`ApiError`, whose `body()` is OpenAI's error format ({"error": {message, type, param, code}}).
The response builders produce OpenAI `text_completion` objects plus the pddnet extensions:
`token_ids` / `prompt_token_ids` per choice (`return_token_ids`, as vLLM spells it) and the `pdd`
object. Nothing here touches a socket, a clock or a random generator: the caller passes them in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

U64 = 1 << 64
HANDOFF_CHOICES = ("one-shot", "streaming", "dynamic")

# Fields OpenAI's /v1/completions takes that pddnet accepts only at their neutral value.
_NEUTRAL = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None,
            "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "stop": None}
_KNOWN = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "stream",
          "stream_options", "return_token_ids", "ignore_eos", "stop_token_ids", "user",
          "handoff_mode", *_NEUTRAL}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class ModelInfo:
    """What the router knows about the served model (no weights needed)."""

    name: str
    vocab_size: int
    max_position: int
    eos_token_id: int
    aliases: tuple[str, ...] = ()

    def matches(self, model: str) -> bool:
        return model == self.name or model in self.aliases


@dataclass(frozen=True)
class CompletionRequest:
    model: str
    prompt_token_ids: tuple[int, ...]
    prompt_text: str | None
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool
    ignore_eos: bool
    stop_token_ids: tuple[int, ...] = ()
    handoff_mode: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def needs_seed(self) -> bool:
        return self.temperature > 0 and self.seed is None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v)))


def _type_name(v: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            type(None): "null"}.get(type(v), "a number" if _is_number(v) else type(v).__name__)


def _prompt_ids(value: Any, model: ModelInfo, encode: Any) -> tuple[tuple[int, ...], str | None]:
    """prompt: a string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) != 1:
            raise bad_request(f"prompt holds {len(value)} prompts; this server takes one prompt "
                              f"per request", "prompt")
        value = value[0]
    if isinstance(value, str):
        ids = tuple(encode(value))
        if not ids:
            raise bad_request("prompt encodes to no tokens", "prompt")
        return ids, value
    if isinstance(value, list):
        if not value:
            raise bad_request("prompt must not be empty", "prompt")
        bad = [v for v in value if not _is_int(v)]
        if bad:
            raise bad_request(f"prompt token ids must be integers, got {_type_name(bad[0])}",
                              "prompt")
        out = [v for v in value if not 0 <= v < model.vocab_size]
        if out:
            raise bad_request(f"prompt token id {out[0]} is outside the vocabulary "
                              f"[0, {model.vocab_size})", "prompt")
        return tuple(value), None
    raise bad_request(f"prompt must be a string, an array of token ids, or an array of one of "
                      f"those; got {_type_name(value)}", "prompt")


def parse_completion_request(body: Any, model: ModelInfo, encode: Any,
                             max_tokens_limit: int) -> CompletionRequest:
    """Validate a /v1/completions body. `encode(text) -> token ids` (with BOS)."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - _KNOWN)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}",
                          unknown[0])
    if "model" not in body:
        raise bad_request("you must provide a model parameter", "model")
    name = body["model"]
    if not isinstance(name, str):
        raise bad_request(f"model must be a string, got {_type_name(name)}", "model")
    if not model.matches(name):
        raise ApiError(404, f"The model `{name}` does not exist (this server serves "
                       f"`{model.name}`)", "invalid_request_error", "model", "model_not_found")
    for key, neutral in _NEUTRAL.items():
        value = body.get(key, neutral)
        if value != neutral and not (key in ("stop", "logit_bias") and not value):
            raise bad_request(f"{key}={value!r} is not supported by this server (only "
                              f"{neutral!r})", key, "unsupported_parameter")
    if "prompt" not in body:
        raise bad_request("you must provide a prompt", "prompt")
    prompt_ids, prompt_text = _prompt_ids(body["prompt"], model, encode)

    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    if not _is_int(max_tokens) or max_tokens < 1:
        raise bad_request(f"max_tokens must be an integer >= 1, got {max_tokens!r}", "max_tokens")
    if max_tokens > max_tokens_limit:
        raise bad_request(f"max_tokens {max_tokens} exceeds this server's limit of "
                          f"{max_tokens_limit}", "max_tokens")
    if len(prompt_ids) + max_tokens > model.max_position:
        raise bad_request(f"This model's maximum context length is {model.max_position} tokens; "
                          f"you requested {len(prompt_ids) + max_tokens} ({len(prompt_ids)} in "
                          f"the prompt, {max_tokens} for the completion)", "max_tokens",
                          "context_length_exceeded")

    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad_request("top_p must be in (0, 1], got 0", "top_p")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise bad_request(f"top_k must be an integer >= 0 (0 or -1 = no limit), got {top_k!r}",
                          "top_k")
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < U64):
        raise bad_request(f"seed must be an integer in [0, 2**64), got {seed!r}", "seed")
    stream = _bool(body, "stream")
    return_ids = _bool(body, "return_token_ids")
    ignore_eos = _bool(body, "ignore_eos")
    include_usage = False
    opts = body.get("stream_options")
    if opts is not None:
        if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
            raise bad_request("stream_options must be an object with include_usage",
                              "stream_options")
        if not stream:
            raise bad_request("stream_options is only allowed when stream is true",
                              "stream_options")
        include_usage = _bool(opts, "include_usage", "stream_options.include_usage")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or len(stop_ids) > 256 or \
            not all(_is_int(t) and 0 <= t < model.vocab_size for t in stop_ids):
        raise bad_request(f"stop_token_ids must be an array of at most 256 token ids in "
                          f"[0, {model.vocab_size})", "stop_token_ids")
    handoff = body.get("handoff_mode")
    if handoff is not None and handoff not in HANDOFF_CHOICES:
        raise bad_request(f"handoff_mode must be one of {', '.join(HANDOFF_CHOICES)}, got "
                          f"{handoff!r}", "handoff_mode")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad_request(f"user must be a string, got {_type_name(user)}", "user")
    return CompletionRequest(
        model=name, prompt_token_ids=prompt_ids, prompt_text=prompt_text, max_tokens=max_tokens,
        temperature=float(temperature), top_p=float(top_p), top_k=max(top_k, 0), seed=seed,
        stream=stream, include_usage=include_usage, return_token_ids=return_ids,
        ignore_eos=ignore_eos, stop_token_ids=tuple(stop_ids), handoff_mode=handoff)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if not _is_number(value):
        raise bad_request(f"{key} must be a number, got {_type_name(value)}", key)
    if not lo <= value <= hi:
        raise bad_request(f"{key} must be in [{lo:g}, {hi:g}], got {value!r}", key)
    return float(value)


def _bool(body: dict[str, Any], key: str, param: str | None = None) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise bad_request(f"{param or key} must be true or false, got {value!r}", param or key)
    return value


# -- responses -------------------------------------------------------------------------------------

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def openai_finish_reason(reason: str | None) -> str | None:
    """Assembler/REQUEST_DONE reason -> OpenAI's finish_reason."""
    if reason is None:
        return None
    return FINISH_REASONS.get(reason, reason)


def usage(num_prompt: int, num_completion: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_completion,
            "total_tokens": num_prompt + num_completion}


def completion_response(request_id: str, created: int, model: str, text: str,
                        finish_reason: str | None, req: CompletionRequest,
                        token_ids: Sequence[int], pdd: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": openai_finish_reason(finish_reason)}
    if req.return_token_ids:
        choice["prompt_token_ids"] = list(req.prompt_token_ids)
        choice["token_ids"] = list(token_ids)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [choice], "usage": usage(len(req.prompt_token_ids), len(token_ids)),
            "pdd": pdd}


def completion_chunk(request_id: str, created: int, model: str, text: str,
                     req: CompletionRequest, token_ids: Sequence[int] = (),
                     finish_reason: str | None = None, pdd: dict[str, Any] | None = None,
                     first: bool = False) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "text": text, "logprobs": None,
                              "finish_reason": openai_finish_reason(finish_reason)}
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
        if first:
            choice["prompt_token_ids"] = list(req.prompt_token_ids)
    out: dict[str, Any] = {"id": request_id, "object": "text_completion", "created": created,
                           "model": model, "choices": [choice]}
    if pdd is not None:
        out["pdd"] = pdd
    return out


def usage_chunk(request_id: str, created: int, model: str, num_prompt: int,
                num_completion: int) -> dict[str, Any]:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [], "usage": usage(num_prompt, num_completion)}


def models_response(model: ModelInfo, created: int) -> dict[str, Any]:
    return {"object": "list", "data": [{"id": model.name, "object": "model", "created": created,
                                        "owned_by": "pddnet",
                                        "max_model_len": model.max_position}]}


class IncrementalDetokenizer:
    """Token ids in, text deltas out, never splitting a multi-byte character: text that ends in
    U+FFFD (an incomplete UTF-8 sequence so far) is held back until the next token completes it
    (the offsets trick vLLM uses). `flush()` releases whatever is left at the end."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0   # start of the window decoded for context
        self._read = 0     # tokens whose text has been emitted
        self.text = ""

    def feed(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix:self._read])
        new_text = self._decode(self._ids[self._prefix:])
        delta = new_text[len(prefix_text):]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta
