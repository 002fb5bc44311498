"""OpenAI completions and chat completions API: request parsing/validation and response shapes
(sans-IO).

`parse_completion_request` / `parse_chat_request` turn a decoded JSON body into a
`CompletionRequest` or raise `ApiError`, whose `body()` is OpenAI's error format
({"error": {message, type, param, code}}). The response builders produce OpenAI
`text_completion` / `chat.completion(.chunk)` objects plus the pddnet extensions: `token_ids` /
`prompt_token_ids` (`return_token_ids`, as vLLM spells it) and the `pdd` object. `ChoiceText`
turns a choice's tokens into text and ends it at a stop string (vLLM's semantics). Nothing here
touches a socket, a clock or a random generator: the caller passes them in.

Sampling fields beyond OpenAI's are vLLM's: `top_k`, `min_tokens`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`; their semantics are in
pddnet.engine.sampling (applied on whichever daemon samples), stop strings here (the router).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

U64 = 1 << 64
HANDOFF_CHOICES = ("one-shot", "streaming", "dynamic")
MAX_N = 16  # most choices (`n`) per request
MAX_LOGPROBS = 20  # most top logprobs per token (vLLM's default max_logprobs)
MAX_STOP_STRINGS = 16
MAX_STOP_LEN = 1024
MAX_REPETITION_PENALTY = 100.0
LOGPROB_MIN = -9999.0

# Fields OpenAI takes that pddnet accepts only at their neutral value (a 400 names the field
# otherwise). Empty values (null, [], {}, "") count as neutral too.
_NEUTRAL_COMPLETIONS = {"echo": False, "suffix": None, "logit_bias": None}
_NEUTRAL_CHAT = {
    "echo": False,
    "logit_bias": None,
    "tools": None,
    "tool_choice": "none",
    "functions": None,
    "function_call": "none",
    "response_format": {"type": "text"},
}
# Both endpoints' sampling fields (OpenAI's and vLLM's extensions).
_SAMPLING = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stream",
    "stream_options",
    "return_token_ids",
    "ignore_eos",
    "stop_token_ids",
    "user",
    "handoff_mode",
    "n",
    "best_of",
    "stop",
    "include_stop_str_in_output",
    "logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
}
_KNOWN = {"prompt", *_SAMPLING, *_NEUTRAL_COMPLETIONS}
_KNOWN_CHAT = {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "add_generation_prompt",
    "chat_template_kwargs",
    "parallel_tool_calls",
    *_SAMPLING,
    *_NEUTRAL_CHAT,
}


class ApiError(Exception):
    """An HTTP error in OpenAI's shape."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


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
    n: int = 1
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    # top logprobs per token (None: no logprobs); chat: top_logprobs when logprobs is true
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    continuous_usage: bool = False  # stream_options.continuous_usage_stats
    chat: bool = False  # /v1/chat/completions

    @property
    def needs_seed(self) -> bool:
        return self.temperature > 0 and self.seed is None

    def sampling_fields(self) -> dict[str, Any]:
        """The wire's SamplingFields (SUBMIT) of this request, seed aside."""
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logprobs": self.logprobs,
        }


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(float(v))


def _type_name(v: Any) -> str:
    return {
        dict: "an object",
        list: "an array",
        str: "a string",
        bool: "a boolean",
        type(None): "null",
    }.get(type(v), "a number" if _is_number(v) else type(v).__name__)


def _prompt_ids(value: Any, model: ModelInfo, encode: Any) -> tuple[tuple[int, ...], str | None]:
    """prompt: a string, a list of token ids, or a list holding exactly one of those."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) != 1:
            raise bad_request(
                f"prompt holds {len(value)} prompts; this server takes one prompt per request",
                "prompt",
            )
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
            raise bad_request(
                f"prompt token ids must be integers, got {_type_name(bad[0])}", "prompt"
            )
        out = [v for v in value if not 0 <= v < model.vocab_size]
        if out:
            raise bad_request(
                f"prompt token id {out[0]} is outside the vocabulary [0, {model.vocab_size})",
                "prompt",
            )
        return tuple(value), None
    raise bad_request(
        f"prompt must be a string, an array of token ids, or an array of one of "
        f"those; got {_type_name(value)}",
        "prompt",
    )


def _check_head(body: Any, model: ModelInfo, known: set[str]) -> str:
    """The checks both endpoints start with; returns the model name as asked."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {_type_name(body)}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(
            f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0]
        )
    if "model" not in body:
        raise bad_request("you must provide a model parameter", "model")
    name = body["model"]
    if not isinstance(name, str):
        raise bad_request(f"model must be a string, got {_type_name(name)}", "model")
    if not model.matches(name):
        raise ApiError(
            404,
            f"The model `{name}` does not exist (this server serves `{model.name}`)",
            "invalid_request_error",
            "model",
            "model_not_found",
        )
    return name


def _check_neutral(body: dict[str, Any], neutral: dict[str, Any]) -> None:
    for key, value in neutral.items():
        got = body.get(key, value)
        if got != value and got not in (None, [], {}, ""):
            raise bad_request(
                f"{key}={got!r} is not supported by this server (only {value!r})",
                key,
                "unsupported_parameter",
            )


def parse_completion_request(
    body: Any, model: ModelInfo, encode: Any, max_tokens_limit: int
) -> CompletionRequest:
    """Validate a /v1/completions body. `encode(text) -> token ids` (with BOS)."""
    name = _check_head(body, model, _KNOWN)
    _check_neutral(body, _NEUTRAL_COMPLETIONS)
    if "prompt" not in body:
        raise bad_request("you must provide a prompt", "prompt")
    prompt_ids, prompt_text = _prompt_ids(body["prompt"], model, encode)
    max_tokens = body.get("max_tokens", 16)
    if max_tokens is None:
        max_tokens = 16
    _check_max_tokens(max_tokens, "max_tokens", len(prompt_ids), model, max_tokens_limit)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise bad_request(
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the number of "
            f"top logprobs per token), got {logprobs!r}",
            "logprobs",
        )
    return _sampling_request(
        body, name, prompt_ids, prompt_text, max_tokens, logprobs, False, model
    )


def parse_chat_request(
    body: Any, model: ModelInfo, render: Any, max_tokens_limit: int
) -> CompletionRequest:
    """Validate a /v1/chat/completions body. `render(messages, add_generation_prompt,
    template_kwargs) -> (prompt token ids, prompt text)`, raising ApiError (e.g. a template's
    raise_exception)."""
    name = _check_head(body, model, _KNOWN_CHAT)
    _check_neutral(body, _NEUTRAL_CHAT)
    if "messages" not in body:
        raise bad_request("you must provide messages", "messages")
    messages = _messages(body["messages"])
    add_generation_prompt = _bool(body, "add_generation_prompt", default=True)
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise bad_request(
            f"chat_template_kwargs must be an object, got {_type_name(kwargs)}",
            "chat_template_kwargs",
        )
    _bool(body, "parallel_tool_calls")
    prompt_ids, prompt_text = render(messages, add_generation_prompt, kwargs)
    if not prompt_ids:
        raise bad_request("the messages render to an empty prompt", "messages")
    bad = [t for t in prompt_ids if not 0 <= t < model.vocab_size]
    if bad:
        raise bad_request(
            f"the rendered prompt has token id {bad[0]} outside the vocabulary", "messages"
        )
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    if max_tokens is None:  # as vLLM: what is left of the context, within the server's limit
        max_tokens = max(1, min(max_tokens_limit, model.max_position - len(prompt_ids)))
    _check_max_tokens(max_tokens, key, len(prompt_ids), model, max_tokens_limit)
    logprobs = _bool(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not _is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}", "top_logprobs"
        )
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    return _sampling_request(
        body,
        name,
        tuple(prompt_ids),
        prompt_text,
        max_tokens,
        (top or 0) if logprobs else None,
        True,
        model,
    )


def _messages(value: Any) -> list[dict[str, Any]]:
    """OpenAI messages -> [{role, content: str, name?}] for the template. Content may be a
    string, null, or a list of text parts (joined with newlines, as vLLM does)."""
    if not isinstance(value, list) or not value:
        raise bad_request("messages must be a non-empty array of message objects", "messages")
    out = []
    for i, msg in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise bad_request(f"{where} must be an object, got {_type_name(msg)}", where)
        extra = sorted(set(msg) - {"role", "content", "name"})
        if extra:
            raise bad_request(
                f"{where}.{extra[0]} is not supported by this server (messages "
                f"take role, content and name)",
                f"{where}.{extra[0]}",
                "unsupported_parameter",
            )
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise bad_request(
                f"{where}.role must be a non-empty string, got {_type_name(role)}", f"{where}.role"
            )
        content = msg.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    kind = part.get("type") if isinstance(part, dict) else _type_name(part)
                    raise bad_request(
                        f"{where}.content[{j}]: only text parts are supported (got {kind!r})",
                        f"{where}.content",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad_request(
                f"{where}.content must be a string or an array of text parts, "
                f"got {_type_name(content)}",
                f"{where}.content",
            )
        entry = {"role": role, "content": content}
        if msg.get("name") is not None:
            if not isinstance(msg["name"], str):
                raise bad_request(f"{where}.name must be a string", f"{where}.name")
            entry["name"] = msg["name"]
        out.append(entry)
    return out


def _check_max_tokens(
    max_tokens: Any, key: str, prompt_len: int, model: ModelInfo, limit: int
) -> None:
    if not _is_int(max_tokens) or max_tokens < 1:
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


def _sampling_request(
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
    temperature = _number(body, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p == 0:
        raise bad_request("top_p must be in (0, 1], got 0", "top_p")
    top_k = body.get("top_k", 0)
    if top_k is None:
        top_k = 0
    if not _is_int(top_k) or top_k < -1:
        raise bad_request(
            f"top_k must be an integer >= 0 (0 or -1 = no limit), got {top_k!r}", "top_k"
        )
    seed = body.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < U64):
        raise bad_request(f"seed must be an integer in [0, 2**64), got {seed!r}", "seed")
    stream = _bool(body, "stream")
    return_ids = _bool(body, "return_token_ids")
    ignore_eos = _bool(body, "ignore_eos")
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
        include_usage = _bool(opts, "include_usage", "stream_options.include_usage")
        continuous = _bool(opts, "continuous_usage_stats", "stream_options.continuous_usage_stats")
    stop_ids = body.get("stop_token_ids") or []
    if (
        not isinstance(stop_ids, list)
        or len(stop_ids) > 256
        or not all(_is_int(t) and 0 <= t < model.vocab_size for t in stop_ids)
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
        raise bad_request(f"user must be a string, got {_type_name(user)}", "user")
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not _is_int(n) or not 1 <= n <= MAX_N:
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
    if not _is_int(min_tokens) or min_tokens < 0:
        raise bad_request(f"min_tokens must be an integer >= 0, got {min_tokens!r}", "min_tokens")
    if min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens must be less than or equal to max_tokens={max_tokens}, got {min_tokens}",
            "min_tokens",
        )
    stop = _stop_strings(body.get("stop"))
    presence = _number(body, "presence_penalty", 0.0, -2.0, 2.0)
    frequency = _number(body, "frequency_penalty", 0.0, -2.0, 2.0)
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, MAX_REPETITION_PENALTY)
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
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output"),
        logprobs=logprobs,
        presence_penalty=presence,
        frequency_penalty=frequency,
        repetition_penalty=repetition,
        continuous_usage=continuous,
        chat=chat,
    )


def _stop_strings(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad_request(
            f"stop must be a string or an array of strings, got {_type_name(value)}", "stop"
        )
    if len(items) > MAX_STOP_STRINGS:
        raise bad_request(f"stop holds {len(items)} strings; at most {MAX_STOP_STRINGS}", "stop")
    if any(not s or len(s) > MAX_STOP_LEN for s in items):
        raise bad_request(f"stop strings must be 1..{MAX_STOP_LEN} characters", "stop")
    return tuple(items)


def _number(body: dict[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if not _is_number(value):
        raise bad_request(f"{key} must be a number, got {_type_name(value)}", key)
    if not lo <= value <= hi:
        raise bad_request(f"{key} must be in [{lo:g}, {hi:g}], got {value!r}", key)
    return float(value)


def _bool(body: dict[str, Any], key: str, param: str | None = None, default: bool = False) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
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
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_completion,
        "total_tokens": num_prompt + num_completion,
    }


# A token's logprobs as the router holds them: (logprob, top ids, top logprobs); None: missing.
LogprobEntry = tuple[float, tuple[int, ...], tuple[float, ...]]


@dataclass
class ChoiceResult:
    """One finished choice, for a whole (non-streamed) response."""

    index: int
    text: str
    token_ids: Sequence[int]
    finish_reason: str | None  # the assembler's (eos, stop, length, ...)
    stop_reason: int | str | None = None  # the stop string / stop token id that ended it
    logprobs: dict[str, Any] | None = None  # already in the endpoint's shape
    pdd: dict[str, Any] | None = None


def completion_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[LogprobEntry | None],
    token_text: Any,
    offset: int = 0,
) -> tuple[dict[str, Any], int]:
    """/v1/completions' logprobs object for these tokens (vLLM's shape: tokens,
    token_logprobs, top_logprobs as {token text: logprob} with the sampled token included,
    text_offset), and the text offset after them."""
    tokens, lps, tops, offsets = [], [], [], []
    for tok, entry in zip(token_ids, entries, strict=True):
        text = token_text(tok)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            lps.append(None)
            tops.append(None)
            continue
        lp, top_ids, top_lps = entry
        lps.append(lp)
        top = {token_text(i): v for i, v in zip(top_ids, top_lps, strict=True)}
        top.setdefault(text, lp)
        tops.append(top)
    return (
        {"text_offset": offsets, "token_logprobs": lps, "tokens": tokens, "top_logprobs": tops},
        offset,
    )


def chat_logprobs(
    token_ids: Sequence[int], entries: Sequence[LogprobEntry | None], token_text: Any
) -> dict[str, Any]:
    """/v1/chat/completions' logprobs object: {"content": [{token, logprob, bytes,
    top_logprobs: [{token, logprob, bytes}]}]}."""
    content = []
    for tok, entry in zip(token_ids, entries, strict=True):
        text = token_text(tok)
        item: dict[str, Any] = {
            "token": text,
            "logprob": None,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [],
        }
        if entry is not None:
            lp, top_ids, top_lps = entry
            item["logprob"] = lp
            item["top_logprobs"] = [
                {"token": (t := token_text(i)), "logprob": v, "bytes": list(t.encode("utf-8"))}
                for i, v in zip(top_ids, top_lps, strict=True)
            ]
        content.append(item)
    return {"content": content}


def _choice(req: CompletionRequest, c: ChoiceResult, many: bool) -> dict[str, Any]:
    if req.chat:
        out: dict[str, Any] = {
            "index": c.index,
            "message": {"role": "assistant", "content": c.text},
            "logprobs": c.logprobs,
            "finish_reason": openai_finish_reason(c.finish_reason),
            "stop_reason": c.stop_reason,
        }
    else:
        out = {
            "index": c.index,
            "text": c.text,
            "logprobs": c.logprobs,
            "finish_reason": openai_finish_reason(c.finish_reason),
            "stop_reason": c.stop_reason,
        }
        if req.return_token_ids:
            out["prompt_token_ids"] = list(req.prompt_token_ids)
    if req.return_token_ids:
        out["token_ids"] = list(c.token_ids)
    if many and c.pdd is not None:
        out["pdd"] = c.pdd
    return out


def response_body(
    request_id: str,
    created: int,
    model: str,
    req: CompletionRequest,
    choices: Sequence[ChoiceResult],
    pdd: dict[str, Any],
) -> dict[str, Any]:
    """A whole answer: `text_completion` or `chat.completion`, with usage (prompt once,
    completion tokens of every choice) and the `pdd` object (choice 0's; with n > 1 every
    choice also carries its own)."""
    many = len(choices) > 1
    body: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [_choice(req, c, many) for c in choices],
        "usage": usage(len(req.prompt_token_ids), sum(len(c.token_ids) for c in choices)),
    }
    if req.chat and req.return_token_ids:
        body["prompt_token_ids"] = list(req.prompt_token_ids)
    body["pdd"] = pdd
    return body


def completion_response(
    request_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    req: CompletionRequest,
    token_ids: Sequence[int],
    pdd: dict[str, Any],
) -> dict[str, Any]:
    """One choice's whole answer (see response_body)."""
    return response_body(
        request_id, created, model, req, [ChoiceResult(0, text, token_ids, finish_reason)], pdd
    )


def completion_chunk(
    request_id: str,
    created: int,
    model: str,
    text: str,
    req: CompletionRequest,
    token_ids: Sequence[int] = (),
    finish_reason: str | None = None,
    pdd: dict[str, Any] | None = None,
    first: bool = False,
    *,
    index: int = 0,
    logprobs: dict[str, Any] | None = None,
    stop_reason: int | str | None = None,
    usage_so_far: dict[str, int] | None = None,
) -> dict[str, Any]:
    """One SSE chunk of choice `index`: `text_completion` or, for chat, `chat.completion.chunk`
    (the choice's first chunk carries the role, later ones content deltas)."""
    choice: dict[str, Any] = {"index": index}
    if req.chat:
        delta: dict[str, Any] = (
            {"role": "assistant", "content": text}
            if first
            else ({"content": text} if text or finish_reason is None else {})
        )
        choice["delta"] = delta
    else:
        choice["text"] = text
    choice["logprobs"] = logprobs
    choice["finish_reason"] = openai_finish_reason(finish_reason)
    if finish_reason is not None:
        choice["stop_reason"] = stop_reason
    if req.return_token_ids:
        choice["token_ids"] = list(token_ids)
        if first and not req.chat:
            choice["prompt_token_ids"] = list(req.prompt_token_ids)
    out: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
    if first and req.chat and req.return_token_ids:
        out["prompt_token_ids"] = list(req.prompt_token_ids)
    if usage_so_far is not None:
        out["usage"] = usage_so_far
    if pdd is not None:
        out["pdd"] = pdd
    return out


def usage_chunk(
    request_id: str,
    created: int,
    model: str,
    num_prompt: int,
    num_completion: int,
    chat: bool = False,
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [],
        "usage": usage(num_prompt, num_completion),
    }


def models_response(model: ModelInfo, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model.name,
                "object": "model",
                "created": created,
                "owned_by": "pddnet",
                "max_model_len": model.max_position,
            }
        ],
    }


class IncrementalDetokenizer:
    """Token ids in, text deltas out, never splitting a multi-byte character: text that ends in
    U+FFFD (an incomplete UTF-8 sequence so far) is held back until the next token completes it
    (the offsets trick vLLM uses). `flush()` releases whatever is left at the end."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens whose text has been emitted
        self.text = ""

    def feed(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


class ChoiceText:
    """A choice's text as its tokens arrive, ended by a stop string the way vLLM does it: the
    check runs on the detokenized text after each token once more than `min_tokens` tokens
    exist, over the new characters (and a stop string's length before them); a match cuts the
    text before the stop string (after it with `include_stop_str_in_output`) and the tokens
    after the one that completed it. While streaming, the last len(longest stop string) - 1
    characters are held back so that no part of a stop string is ever sent."""

    def __init__(
        self, decode: Any, stop: Sequence[str] = (), min_tokens: int = 0, include_stop: bool = False
    ) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.hold = 0 if include_stop or not self.stop else max(len(x) for x in self.stop) - 1
        self.text = ""
        self.num_tokens = 0
        self.stopped: str | None = None  # the stop string that ended the choice
        self.final = False

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """Tokens in order. When a stop string ends the choice: how many of these tokens it
        keeps (the rest are dropped); else None."""
        if self.final:
            return 0
        for i, tok in enumerate(token_ids):
            delta = self._detok.feed([tok])
            self.num_tokens += 1
            if delta:
                self.text += delta
                if self._check(len(delta)):
                    return i + 1
        return None

    def finish(self) -> bool:
        """The choice's tokens are all in: release what the detokenizer held back. True when
        that text completed a stop string (the text is then cut there)."""
        if self.final:
            return False
        delta = self._detok.flush()
        self.text += delta
        found = bool(delta) and self._check(len(delta))
        self.final = True
        return found

    @property
    def emittable(self) -> int:
        """How much of `text` may be sent now."""
        return len(self.text) if self.final else max(0, len(self.text) - self.hold)

    def _check(self, new_chars: int) -> bool:
        if not self.stop or self.num_tokens <= self.min_tokens:
            return False
        for s in self.stop:
            at = self.text.find(s, max(0, len(self.text) - new_chars - len(s) + 1))
            if at != -1:
                self.text = self.text[: at + (len(s) if self.include_stop else 0)]
                self.stopped = s
                self.final = True
                return True
        return False
