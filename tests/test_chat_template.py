"""Chat templates rendered the way transformers renders them (pddnet.model.chat_template): a
checkpoint folder's template from chat_template.jinja / tokenizer_config.json (string or list
form), add_generation_prompt, raise_exception as a clear 400, and the presets' fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pddnet.model.chat_template import (
    FALLBACK_TEMPLATE,
    ChatTemplateError,
    ChatTemplateUnavailable,
    load_chat_template,
)
from pddnet.model.tokenizer import ByteTokenizer

# SmolLM2-135M-Instruct's template (ChatML, a default system turn), as its folder ships it.
CHATML = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Llama-2-chat's template: BOS / EOS from the tokenizer config, alternation enforced.
LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}"
    "{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}"
    "{% endif %}{% endfor %}"
)
# Block tags on lines of their own: trim_blocks / lstrip_blocks leave no stray whitespace.
INDENTED = """{% for message in messages %}
    {% if message['role'] == 'user' %}
U: {{ message['content'] }}
    {% endif %}
{% endfor %}
"""
TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Ünïcode?"},
]


def test_chat_template_jinja_with_system_user_assistant_turns(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text(CHATML)
    t = load_chat_template(tmp_path, ByteTokenizer())
    assert t.origin.endswith("chat_template.jinja") and not t.add_bos and not t.is_fallback
    assert t.render(TURNS) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nÜnïcode?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # without a generation prompt, and the template's own default system turn
    assert t.render(TURNS[1:2], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_tokenizer_config_template_with_special_tokens_and_raise_exception(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": LLAMA2,
                "bos_token": "<s>",
                "eos_token": {"content": "</s>", "lstrip": False},
            }
        )
    )  # an AddedToken object
    t = load_chat_template(tmp_path)
    assert t.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    assert t.render(TURNS) == (
        "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Ünïcode? [/INST]"
    )
    with pytest.raises(ChatTemplateError, match="Conversation roles must alternate"):
        t.render([TURNS[1], TURNS[3]])  # two user turns in a row
    (tmp_path / "chat_template.jinja").write_text(INDENTED)
    assert load_chat_template(tmp_path).render(TURNS) == "U: Hi\nU: Ünïcode?\n"


def test_tokenizer_config_list_form_takes_the_default(tmp_path: Path) -> None:
    cfg = {
        "chat_template": [
            {"name": "tool_use", "template": "TOOLS {{ tools | tojson }}"},
            {"name": "default", "template": CHATML},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(tmp_path)
    assert (
        t.render(TURNS[:1], add_generation_prompt=False)
        == "<|im_start|>system\nBe brief.<|im_end|>\n"
    )
    cfg["chat_template"] = cfg["chat_template"][:1]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateUnavailable, match="none named 'default'"):
        t.render(TURNS)


def test_chat_template_jinja_wins_and_tojson_keeps_unicode(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "other"}))
    (tmp_path / "chat_template.jinja").write_text(
        "{{ messages | tojson }}{% for m in messages %}{% if loop.last %}{% break %}{% endif %}"
        "{% endfor %}"
    )
    t = load_chat_template(tmp_path)
    assert t.render(TURNS[3:]) == '[{"role": "user", "content": "Ünïcode?"}]'


def test_a_template_that_does_not_compile_is_reported(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}")
    t = load_chat_template(tmp_path)
    with pytest.raises(ChatTemplateUnavailable, match="does not compile"):
        t.render(TURNS)


def test_sandbox_refuses_unsafe_templates(tmp_path: Path) -> None:
    (tmp_path / "chat_template.jinja").write_text("{{ messages.append(1) }}")
    with pytest.raises(ChatTemplateError, match="unsafe"):
        load_chat_template(tmp_path).render(TURNS)


def test_presets_fall_back_to_the_documented_plain_template(tmp_path: Path) -> None:
    for folder in (None, tmp_path):  # a preset, or a folder without a template
        t = load_chat_template(folder, ByteTokenizer())
        assert t.is_fallback and t.add_bos and t.source == FALLBACK_TEMPLATE
        assert t.render(TURNS[:2]) == "system: Be brief.\nuser: Hi\nassistant:"
        assert t.render(TURNS[:2], add_generation_prompt=False) == "system: Be brief.\nuser: Hi\n"
    # the text documented in docs/cluster.md is what the fallback renders
    doc = (Path(__file__).resolve().parents[1] / "docs" / "cluster.md").read_text()
    assert "system: You are terse.\nuser: Hello\nassistant:" in doc
    assert (
        load_chat_template(None).render(
            [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello"}]
        )
        == "system: You are terse.\nuser: Hello\nassistant:"
    )
