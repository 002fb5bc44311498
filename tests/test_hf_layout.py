"""Hugging Face Llama folder layout: save/load round trips, precise loader errors, export CLI."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pddnet.model import (
    ByteTokenizer,
    CheckpointError,
    LlamaModel,
    ModelConfig,
    causal_attention,
    init_random,
    load_hf,
    load_model,
    save_hf,
)
from pddnet.model.cli import register as register_model

IDS = torch.tensor([256, 72, 101, 108, 108, 111, 44, 32, 80, 68, 68])


def logits_of(model: LlamaModel) -> torch.Tensor:
    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return causal_attention(q, k, v, 0)  # one full-sequence forward: no cache needed

    return model(IDS, torch.arange(len(IDS)), attention)


def tiny_config(**changes: object) -> ModelConfig:
    return dataclasses.replace(ModelConfig.preset("tiny"), **changes)


@pytest.fixture()
def saved(tmp_path: Path) -> Path:
    save_hf(init_random(ModelConfig.preset("tiny"), seed=3), tmp_path / "ckpt")
    return tmp_path / "ckpt"


@pytest.mark.parametrize("tied", [False, True])
def test_round_trip_gives_identical_logits(tmp_path: Path, tied: bool) -> None:
    model = init_random(tiny_config(tie_embeddings=tied), seed=7)
    save_hf(model, tmp_path)
    loaded = load_hf(tmp_path)
    assert loaded.config == model.config
    assert torch.equal(logits_of(loaded), logits_of(model))
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert ("lm_head.weight" in names) is not tied


def test_files_use_hf_names_and_fields(saved: Path) -> None:
    hf = json.loads((saved / "config.json").read_text())
    assert hf["architectures"] == ["LlamaForCausalLM"] and hf["model_type"] == "llama"
    expected = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "vocab_size": 259,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "float64",
    }
    assert {k: hf[k] for k in expected} == expected
    tensors = load_file(str(saved / "model.safetensors"))
    layer = [
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "post_attention_layernorm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    ]
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    names |= {f"model.layers.{n}.{p}.weight" for n in range(2) for p in layer}
    assert set(tensors) == names
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 64)
    assert tensors["model.embed_tokens.weight"].dtype == torch.float64


def test_dtype_override_and_bfloat16_round_trip(saved: Path, tmp_path: Path) -> None:
    f32 = load_hf(saved, dtype="float32")
    assert f32.config.dtype == "float32"
    assert f32.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    ref = logits_of(load_hf(saved))
    assert (logits_of(f32).double() - ref).abs().max().item() < 1e-3
    save_hf(load_hf(saved, dtype="bfloat16"), tmp_path / "bf16")
    bf16 = load_hf(tmp_path / "bf16")
    assert bf16.config.dtype == "bfloat16"
    assert torch.equal(logits_of(bf16), logits_of(load_hf(saved, dtype="bfloat16")))


def test_sharded_checkpoint_loads(saved: Path, tmp_path: Path) -> None:
    tensors = load_file(str(saved / "model.safetensors"))
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    (shard_dir / "config.json").write_text((saved / "config.json").read_text())
    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for shard, part in (
        ("model-00001-of-00002.safetensors", names[:half]),
        ("model-00002-of-00002.safetensors", names[half:]),
    ):
        save_file({n: tensors[n] for n in part}, str(shard_dir / shard))
        weight_map.update(dict.fromkeys(part, shard))
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert torch.equal(logits_of(load_hf(shard_dir)), logits_of(load_hf(saved)))


def test_tolerated_extras_of_real_checkpoints(saved: Path) -> None:
    """Old exports carry rotary buffers; tied checkpoints may store a copy of the head."""
    tensors = load_file(str(saved / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(saved / "model.safetensors"))
    assert torch.equal(logits_of(load_hf(saved)), logits_of(init_random(tiny_config(), 3)))
    hf = json.loads((saved / "config.json").read_text())
    hf["tie_word_embeddings"] = True
    (saved / "config.json").write_text(json.dumps(hf))
    assert load_hf(saved).lm_head is None


def rewrite_config(folder: Path, **changes: object) -> None:
    hf = json.loads((folder / "config.json").read_text())
    hf.update(changes)
    (folder / "config.json").write_text(json.dumps({k: v for k, v in hf.items() if v is not None}))


def rewrite_tensors(folder: Path, edit) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_error_not_a_directory(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a directory"):
        load_hf(tmp_path / "absent")


def test_error_no_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no config.json; not a Hugging Face model folder"):
        load_hf(tmp_path)


def test_error_bad_json(saved: Path) -> None:
    (saved / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="unreadable JSON"):
        load_hf(saved)


@pytest.mark.parametrize(
    "changes, message",
    [
        pytest.param(
            {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"},
            r"architecture \['GPT2LMHeadModel'\] \(model_type 'gpt2'\) is not "
            r"supported; pddnet loads LlamaForCausalLM",
            id="unknown architecture",
        ),
        pytest.param(
            {"hidden_size": None}, "missing required fields hidden_size", id="missing field"
        ),
        pytest.param(
            {"attention_bias": True},
            "attention_bias=true is not supported",
            id="unsupported attention bias",
        ),
        pytest.param(
            {"attention_bias": False, "hidden_act": "gelu"},
            "hidden_act 'gelu' is not supported",
            id="unsupported activation",
        ),
        pytest.param(
            {"num_key_value_heads": 3},
            r"num_heads \(4\) must be a multiple of",
            id="heads not a multiple of kv heads",
        ),
        pytest.param(
            {"intermediate_size": 96},
            r"tensor model.layers.0.mlp.gate_proj.weight has shape \(128, 64\), "
            r"config.json implies \(96, 64\)",
            id="tensor shape against config",
        ),
    ],
)
def test_error_config_json(saved: Path, changes: dict, message: str) -> None:
    """A config.json the loader refuses, with a message naming what is wrong."""
    rewrite_config(saved, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_hf(saved)


def test_error_missing_weights_file(saved: Path) -> None:
    (saved / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model.safetensors \(or model.safetensors"):
        load_hf(saved)
    (saved / "pytorch_model.bin").write_bytes(b"pickle would go here")
    with pytest.raises(CheckpointError, match="only safetensors weights are loaded"):
        load_hf(saved)


def test_error_corrupt_weights_file(saved: Path) -> None:
    (saved / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="unreadable safetensors file"):
        load_hf(saved)


def test_error_missing_tensor(saved: Path) -> None:
    rewrite_tensors(saved, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors model.layers.1.mlp.up_proj.weight"):
        load_hf(saved)


def test_error_extra_tensor(saved: Path) -> None:
    rewrite_tensors(
        saved,
        lambda t: t.update(
            {"model.layers.0.self_attn.q_proj.bias": torch.zeros(64, dtype=torch.float64)}
        ),
    )
    with pytest.raises(
        CheckpointError, match=r"unexpected tensors model.layers.0.self_attn.q_proj.bias"
    ):
        load_hf(saved)


def test_error_integer_weights(saved: Path) -> None:
    rewrite_tensors(
        saved, lambda t: t.update({"model.norm.weight": torch.ones(64, dtype=torch.int8)})
    )
    with pytest.raises(CheckpointError, match="model.norm.weight has dtype torch.int8"):
        load_hf(saved)


def test_load_model_presets_and_folders(saved: Path) -> None:
    model, tokenizer = load_model("tiny", seed=3)
    assert isinstance(tokenizer, ByteTokenizer) and model.config.name == "tiny"
    from_folder, folder_tokenizer = load_model(str(saved))
    assert isinstance(folder_tokenizer, ByteTokenizer)
    assert torch.equal(logits_of(from_folder), logits_of(model))
    assert load_model("small", dtype="bfloat16")[0].config.dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"unknown model 'no-such-model': expected a preset"):
        load_model("no-such-model")


def test_export_command_writes_loadable_folder(tmp_path: Path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="pdd")
    register_model(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(
        [
            "model",
            "export",
            "--model",
            "tiny",
            "--out",
            str(tmp_path / "t"),
            "--seed",
            "4",
            "--dtype",
            "float32",
        ]
    )
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    assert "config.json" in printed and "model.safetensors" in printed and "float32" in printed
    loaded = load_hf(tmp_path / "t")
    expected = init_random(ModelConfig.preset("tiny", "float32"), seed=4)
    assert torch.equal(logits_of(loaded), logits_of(expected))
    # a folder re-exported in another dtype; its tokenizer files travel along
    (tmp_path / "t" / "tokenizer_config.json").write_text("{}")
    args = parser.parse_args(
        [
            "model",
            "export",
            "--model",
            str(tmp_path / "t"),
            "--out",
            str(tmp_path / "t64"),
            "--dtype",
            "float64",
        ]
    )
    assert args.handler(args) == 0
    assert load_hf(tmp_path / "t64").config.dtype == "float64"
    assert (tmp_path / "t64" / "tokenizer_config.json").is_file()
    with pytest.raises(SystemExit, match="unknown model 'nope'"):
        args = parser.parse_args(["model", "export", "--model", "nope", "--out", str(tmp_path)])
        args.handler(args)


def test_cli_registration_does_not_import_torch() -> None:
    code = (
        "import sys, argparse; from pddnet.model.cli import register as register_model; "
        "register_model(argparse.ArgumentParser().add_subparsers()); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run(
        [sys.executable, "-c", code],
        check=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[1],
    )
