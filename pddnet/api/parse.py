"""Parsing and validating OpenAI completions and chat completions requests (sans-IO).

`parse_completion_request` / `parse_chat_request` turn a decoded JSON body into a
`CompletionRequest` or raise `ApiError`. Sampling fields beyond OpenAI's are vLLM's: `top_k`,
`min_tokens`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`;
their semantics are in pddnet.engine.sampling (applied on whichever daemon samples), stop strings
in pddnet/lifecycle/choice_text.py (the router). Nothing here touches a socket, a clock or a random
generator: the caller passes them in.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pddnet.api.fields import (
    MAX_LOGPROBS,
    bool_field,
    check_max_tokens,
    is_int,
    sampling_request,
    type_name,
)
from pddnet.api.types import ApiError, CompletionRequest, ModelInfo, bad_request
from pddnet.protocol.errors import SchemaError
from pddnet.protocol.messages import UIntList

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
        with contextlib.suppress(SchemaError):  # the wire's check, C-speed on a long prompt:
            # it remembers the tuple, so the SUBMIT built from it does not walk it again
            return UIntList(hi=model.vocab_size - 1).check("prompt", value), None
        bad = [v for v in value if not is_int(v)]
        if bad:
            raise bad_request(
                f"prompt token ids must be integers, got {type_name(bad[0])}", "prompt"
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
        f"those; got {type_name(value)}",
        "prompt",
    )


def _check_head(body: Any, model: ModelInfo, known: set[str]) -> str:
    """The checks both endpoints start with; returns the model name as asked."""
    if not isinstance(body, dict):
        raise bad_request(f"the request body must be a JSON object, got {type_name(body)}")
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(
            f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0]
        )
    if "model" not in body:
        raise bad_request("you must provide a model parameter", "model")
    name = body["model"]
    if not isinstance(name, str):
        raise bad_request(f"model must be a string, got {type_name(name)}", "model")
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
    check_max_tokens(max_tokens, "max_tokens", len(prompt_ids), model, max_tokens_limit)
    logprobs = body.get("logprobs")
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_LOGPROBS):
        raise bad_request(
            f"logprobs must be an integer in [0, {MAX_LOGPROBS}] (the number of "
            f"top logprobs per token), got {logprobs!r}",
            "logprobs",
        )
    return sampling_request(body, name, prompt_ids, prompt_text, max_tokens, logprobs, False, model)


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
    add_generation_prompt = bool_field(body, "add_generation_prompt", default=True)
    kwargs = body.get("chat_template_kwargs")
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict):
        raise bad_request(
            f"chat_template_kwargs must be an object, got {type_name(kwargs)}",
            "chat_template_kwargs",
        )
    bool_field(body, "parallel_tool_calls")
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
    check_max_tokens(max_tokens, key, len(prompt_ids), model, max_tokens_limit)
    logprobs = bool_field(body, "logprobs")
    top = body.get("top_logprobs")
    if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
        raise bad_request(
            f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {top!r}", "top_logprobs"
        )
    if top and not logprobs:
        raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")
    return sampling_request(
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
            raise bad_request(f"{where} must be an object, got {type_name(msg)}", where)
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
                f"{where}.role must be a non-empty string, got {type_name(role)}", f"{where}.role"
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
                    kind = part.get("type") if isinstance(part, dict) else type_name(part)
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
                f"got {type_name(content)}",
                f"{where}.content",
            )
        entry = {"role": role, "content": content}
        if msg.get("name") is not None:
            if not isinstance(msg["name"], str):
                raise bad_request(f"{where}.name must be a string", f"{where}.name")
            entry["name"] = msg["name"]
        out.append(entry)
    return out
