"""Tokenizers: the default byte tokenizer, and a folder's tokenizer.json through `tokenizers`."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from pddnet.model import (
    ByteTokenizer,
    HFTokenizer,
    ModelConfig,
    Tokenizer,
    causal_attention,
    init_random,
    load_model,
    load_tokenizer,
    save_hf,
)


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    assert isinstance(tok, Tokenizer)
    text = "Hello, wörld — 你好 🚀"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id == 256
    assert ids[1:] == list(text.encode("utf-8"))
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text
    assert tok.decode([*ids, tok.eos_token_id]) == text


def test_byte_tokenizer_specials_and_errors() -> None:
    tok = ByteTokenizer()
    ids = [tok.bos_token_id, *b"hi", tok.eos_token_id, tok.pad_token_id]
    assert tok.decode(ids, skip_special=False) == "<bos>hi<eos><pad>"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"  # a cut multibyte character
    with pytest.raises(ValueError, match=r"token id 300 is outside the byte vocabulary \(0..258\)"):
        tok.decode([104, 300])


def test_no_tokenizer_json_means_byte_tokenizer(tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def write_word_level(folder: Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "[UNK]": 2, "hello": 3, "world": 4, "pdd": 5}
    backend = Backend(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>", "</s>"])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))


def test_tokenizer_json_is_used_with_ids_from_config(tmp_path: Path) -> None:
    write_word_level(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": [1, 2]}))
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (0, 1, 6)
    assert tok.encode("hello pdd world") == [0, 3, 5, 4]
    assert tok.encode("hello nothing", add_bos=False) == [3, 2]
    assert tok.decode([0, 3, 4, 1]) == "hello world"
    assert "<s>" in tok.decode([0, 3, 4, 1], skip_special=False)


def test_tokenizer_json_with_ids_from_tokenizer_config(tmp_path: Path) -> None:
    write_word_level(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": {"content": "<s>"}, "eos_token": "</s>"})
    )
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)


def test_tokenizer_json_errors(tmp_path: Path) -> None:
    write_word_level(tmp_path)
    with pytest.raises(ValueError, match="cannot tell the BOS/EOS token ids"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(ValueError, match="not a valid tokenizers file"):
        load_tokenizer(tmp_path)


def test_without_tokenizers_package_falls_back_with_warning(tmp_path: Path, monkeypatch) -> None:
    write_word_level(tmp_path)
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # makes `import tokenizers` fail
    with pytest.warns(UserWarning, match="tokenizer.json ignored"):
        assert isinstance(load_tokenizer(tmp_path), ByteTokenizer)


def test_model_folder_with_byte_level_bpe(tmp_path: Path) -> None:
    """A trained byte-level BPE tokenizer.json next to the weights: load_model uses it."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(["prefill relay decode main decode"] * 20, trainer=trainer)
    vocab = backend.get_vocab_size()
    config = dataclasses.replace(
        ModelConfig.preset("tiny"), vocab_size=vocab, bos_token_id=0, eos_token_id=1
    )
    save_hf(init_random(config, seed=0), tmp_path)
    backend.save(str(tmp_path / "tokenizer.json"))
    model, tok = load_model(str(tmp_path))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == vocab
    text = "relay decode, ünïcode"
    ids = tok.encode(text)
    assert ids[0] == 0 and len(ids) < len(text.encode())  # merges learnt from the corpus
    assert tok.decode(ids) == text
    logits = model(
        torch.tensor(ids),
        torch.arange(len(ids)),
        lambda layer, q, k, v: causal_attention(q, k, v, 0),
    )
    assert logits.shape == (len(ids), vocab)
