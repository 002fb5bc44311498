"""OpenAI completions and chat completions API: the types both sides share (sans-IO).

A request is parsed (pddnet/api/parse.py) into a `CompletionRequest`, or an `ApiError`
whose `body()` is OpenAI's error format ({"error": {message, type, param, code}}); responses are
shaped by pddnet/api/responses.py; a choice's text and stop strings are
pddnet/lifecycle/choice_text.py's `ChoiceText`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pddnet.protocol.messages import SAMPLING_FIELD_NAMES


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
        """The wire's SamplingFields (SUBMIT) of this request, by their names, seed aside (the
        router fixes a concrete one)."""
        return {name: getattr(self, name) for name in SAMPLING_FIELD_NAMES if name != "seed"}
