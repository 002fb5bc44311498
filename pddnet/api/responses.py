"""OpenAI response shapes (sans-IO): `text_completion` / `chat.completion(.chunk)` objects plus
the pddnet extensions: `token_ids` / `prompt_token_ids` (`return_token_ids`, as vLLM spells it)
and the `pdd` object.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pddnet.api.types import CompletionRequest, ModelInfo

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
