"""A checkpoint's chat template, rendered the way transformers' `apply_chat_template` does.

Where the template comes from (the first that exists in the model folder):

1. `chat_template.jinja` (how transformers >= 4.43 saves it);
2. `chat_template.json`: {"chat_template": "..."};
3. `tokenizer_config.json`'s "chat_template": a string, or the list form
   [{"name": "default", "template": "..."}, {"name": "tool_use", ...}] (the "default" one).

The renderer is transformers' own setup of Jinja2: an `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps
non-ASCII text, the globals `raise_exception(message)` (a template's way of refusing a
conversation: `ChatTemplateError`, which the router turns into a 400) and `strftime_now`; the
context holds `messages`, `add_generation_prompt`, `bos_token` / `eos_token` and the other
special tokens of `tokenizer_config.json`, plus any caller keyword arguments
(`chat_template_kwargs`). As transformers and vLLM do, the rendered text is tokenized without
adding a BOS: a template that wants one writes `{{ bos_token }}`.

Without a template (the byte-vocabulary presets, or a folder that ships none) the fallback is
`FALLBACK_TEMPLATE`, a plain "role: content" transcript ending in "assistant:" when a
generation prompt is asked for, tokenized *with* BOS (the byte tokenizer cannot spell a special
token in text):

    system: You are terse.
    user: Hello
    assistant:
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from pddnet.model.tokenizer import read_json_object

FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
SPECIAL_TOKEN_KEYS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "pad_token",
    "sep_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """The template refused the conversation (its `raise_exception`) or failed to render it."""


class ChatTemplateUnavailable(RuntimeError):
    """The checkpoint's template cannot be used at all (it does not compile, no default...)."""


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' filter: non-ASCII text stays as it is (Jinja's own tojson escapes it)
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> Any:
    """A jinja2 Template compiled exactly as transformers compiles chat templates."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


@dataclass
class ChatTemplate:
    """A compiled chat template and what renders it. `add_bos`: prepend BOS when tokenizing
    the rendered text (the fallback only)."""

    source: str
    origin: str  # the file it came from, or "fallback"
    special_tokens: dict[str, str] = field(default_factory=dict)
    add_bos: bool = False
    error: str | None = None  # why the checkpoint's template is unusable
    _compiled: Any = None

    def __post_init__(self) -> None:
        if self.error is None:
            try:
                self._compiled = compile_template(self.source)
            except Exception as exc:  # a TemplateSyntaxError, with its line
                self.error = f"{self.origin}: the chat template does not compile: {exc}"

    @property
    def is_fallback(self) -> bool:
        return self.origin == "fallback"

    def render(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        """The prompt text for `messages` (each {"role", "content", ...})."""
        import jinja2

        if self._compiled is None:
            raise ChatTemplateUnavailable(self.error or "no chat template")
        context = {
            **self.special_tokens,
            **kwargs,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        context.setdefault("tools", None)
        context.setdefault("documents", None)
        try:
            return self._compiled.render(**context)
        except jinja2.exceptions.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the messages: {exc}") from None
        except Exception as exc:  # e.g. a template indexing a field the messages lack
            raise ChatTemplateError(
                f"the chat template failed on the messages: {type(exc).__name__}: {exc}"
            ) from None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # an AddedToken object
        value = value.get("content")
    return value if isinstance(value, str) else None


def special_tokens(tokenizer_config: dict[str, Any], tokenizer: Any = None) -> dict[str, str]:
    """bos_token, eos_token, ... as text: tokenizer_config.json's, else the tokenizer's own
    spelling of its BOS / EOS ids."""
    out: dict[str, str] = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(tokenizer_config.get(key))
        if text is not None:
            out[key] = text
    if tokenizer is not None:
        for key, attr in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id")):
            tid = getattr(tokenizer, attr, None)
            if key not in out and tid is not None:
                try:
                    out[key] = tokenizer.decode([tid], skip_special=False)
                except Exception:  # a tokenizer that cannot spell it: leave it out
                    pass
    return out


def _pick(value: Any, where: str) -> str:
    """A chat_template value: a string, or the named list form (its "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise ChatTemplateUnavailable(
            f"{where}: the model has several chat templates ({', '.join(map(str, named))}) "
            f"and none named 'default'"
        )
    raise ChatTemplateUnavailable(
        f"{where}: chat_template must be a string or a list of "
        f"{{name, template}}, got {type(value).__name__}"
    )


def load_chat_template(folder: str | Path | None, tokenizer: Any = None) -> ChatTemplate:
    """The folder's chat template (see the module doc), or the fallback."""
    config: dict[str, Any] = {}
    source: str | None = None
    origin = "fallback"
    error = None
    if folder is not None:
        path = Path(folder)
        config = read_json_object(path / "tokenizer_config.json")
        try:
            if (path / "chat_template.jinja").is_file():
                origin = str(path / "chat_template.jinja")
                source = (path / "chat_template.jinja").read_text()
            elif "chat_template" in read_json_object(path / "chat_template.json"):
                origin = str(path / "chat_template.json")
                source = _pick(
                    read_json_object(path / "chat_template.json")["chat_template"], origin
                )
            elif config.get("chat_template") is not None:
                origin = str(path / "tokenizer_config.json")
                source = _pick(config["chat_template"], origin)
        except ChatTemplateUnavailable as exc:
            error, source = str(exc), ""
        except OSError as exc:
            error, source = f"{origin}: unreadable: {exc}", ""
    tokens = special_tokens(config, tokenizer)
    if source is None:
        return ChatTemplate(FALLBACK_TEMPLATE, "fallback", tokens, add_bos=True)
    return ChatTemplate(source, origin, tokens, add_bos=False, error=error)
