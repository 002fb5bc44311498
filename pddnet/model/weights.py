"""Model weights: seeded random initialisation, and the Hugging Face Llama folder layout.

A folder is `config.json` (LlamaForCausalLM fields) plus `model.safetensors` (or shards named
by `model.safetensors.index.json`) with HF tensor names, so a real small Llama-family checkpoint
loads as is. A model with a sliding window is a MistralForCausalLM (the same tensors, plus
`sliding_window`). Only safetensors are read: pickle-based `.bin` files are refused, never
unpickled.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from pddnet.model.config import DTYPES, ModelConfig
from pddnet.model.llama import LlamaModel

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Random-init scales. A random transformer easily collapses into repeating one token: when
# attention is nearly uniform, a run of one token averages to that token's value, the next
# prediction becomes a fixed function of the last token, and greedy decoding falls into a
# fixed point or a short cycle. Sharper queries/keys (QK_GAIN) make attention depend on
# relative position through RoPE, so the context keeps steering the output; tests check that
# greedy continuations stay varied for every preset. Other weights keep unit-variance
# activations (std 1/sqrt(fan_in)); LOGIT_STD sets how peaked sampling at temperature 1 is.
EMBED_STD = 1.0
QK_GAIN = 3.0
LOGIT_STD = 2.0


class CheckpointError(ValueError):
    """A folder that is not a loadable Llama checkpoint; the message says what is wrong."""


def init_random(config: ModelConfig, seed: int = 0) -> LlamaModel:
    """A model with weights drawn from a generator seeded by `seed` only.

    Weights are drawn in float32 in a fixed order (HF tensor names) and then cast, so the same
    seed gives the same model in every dtype, up to that dtype's rounding.
    """
    model = LlamaModel(config)
    gen = torch.Generator().manual_seed(seed)
    for name, param in _named_weights(model).items():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
            continue
        fan_in = param.shape[1]
        if name.endswith("embed_tokens.weight"):
            std = EMBED_STD
        elif name == "lm_head.weight":
            std = LOGIT_STD / math.sqrt(fan_in)
        elif name.endswith(("q_proj.weight", "k_proj.weight")):
            std = QK_GAIN / math.sqrt(fan_in)
        else:
            std = 1.0 / math.sqrt(fan_in)
        param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * std)
    return model.eval()


def _named_weights(model: LlamaModel) -> dict[str, torch.Tensor]:
    """HF tensor name -> parameter, in checkpoint order (tied head has no `lm_head.weight`)."""
    return dict(model.named_parameters())


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, h)}
    for n in range(config.num_layers):
        p = f"model.layers.{n}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (config.num_heads * d, h),
                p + "self_attn.k_proj.weight": (config.num_kv_heads * d, h),
                p + "self_attn.v_proj.weight": (config.num_kv_heads * d, h),
                p + "self_attn.o_proj.weight": (h, config.num_heads * d),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (i, h),
                p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i),
            }
        )
    shapes["model.norm.weight"] = (h,)
    if not config.tie_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    return shapes


# ---- config.json ----------------------------------------------------------------------------


def config_to_hf(config: ModelConfig) -> dict[str, object]:
    # HF's Llama has no sliding window; Mistral is Llama's tensors and fields plus one
    mistral = config.sliding_window is not None
    window = {"sliding_window": config.sliding_window} if mistral else {}
    return {
        "architectures": ["MistralForCausalLM" if mistral else "LlamaForCausalLM"],
        "model_type": "mistral" if mistral else "llama",
        **window,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rope_theta": config.rope_theta,
        "rope_scaling": dict(config.rope_scaling) or None,
        "rms_norm_eps": config.rms_norm_eps,
        "max_position_embeddings": config.max_position,
        "tie_word_embeddings": config.tie_embeddings,
        "vocab_size": config.vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "torch_dtype": config.dtype,
        "pddnet_name": config.name,
    }


_REQUIRED = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)


def config_from_hf(hf: dict[str, object], name: str, dtype: str | None = None) -> ModelConfig:
    """ModelConfig from a config.json dict; `dtype` overrides the checkpoint's own."""
    where = f"{name}/{CONFIG_FILE}"
    archs = list(hf.get("architectures") or [])  # type: ignore[call-overload]
    mistral = hf.get("model_type") == "mistral" or "MistralForCausalLM" in archs
    if not mistral and hf.get("model_type") != "llama" and "LlamaForCausalLM" not in archs:
        raise CheckpointError(
            f"{where}: architecture {archs or '?'} (model_type {hf.get('model_type')!r}) is not "
            f"supported; pddnet loads LlamaForCausalLM and MistralForCausalLM checkpoints"
        )
    missing = [k for k in _REQUIRED if k not in hf]
    if missing:
        raise CheckpointError(f"{where}: missing required fields {', '.join(missing)}")
    if hf.get("hidden_act", "silu") != "silu":
        raise CheckpointError(f"{where}: hidden_act {hf['hidden_act']!r} is not supported (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        if hf.get(flag):
            raise CheckpointError(f"{where}: {flag}=true is not supported")
    heads = int(hf["num_attention_heads"])  # type: ignore[arg-type]
    hidden = int(hf["hidden_size"])  # type: ignore[arg-type]
    head_dim = hf.get("head_dim") or hidden // heads
    eos = hf.get("eos_token_id", 0)
    if isinstance(eos, list):  # Llama 3 lists several stop ids; the first is the primary EOS
        eos = eos[0] if eos else 0
    file_dtype = str(hf.get("torch_dtype") or hf.get("dtype") or "float32")
    if dtype is None:
        # float16 and other CPU-unfriendly formats load as float32 unless asked otherwise.
        dtype = file_dtype if file_dtype in DTYPES else "float32"
    scaling = hf.get("rope_scaling") or {}
    if not isinstance(scaling, dict):
        raise CheckpointError(f"{where}: rope_scaling must be an object, got {scaling!r}")
    try:
        return ModelConfig(
            name=str(hf.get("pddnet_name") or name),
            vocab_size=int(hf["vocab_size"]),  # type: ignore[arg-type]
            hidden_size=hidden,
            intermediate_size=int(hf["intermediate_size"]),  # type: ignore[arg-type]
            num_layers=int(hf["num_hidden_layers"]),  # type: ignore[arg-type]
            num_heads=heads,
            num_kv_heads=int(hf.get("num_key_value_heads") or heads),  # type: ignore[arg-type]
            head_dim=int(head_dim),  # type: ignore[arg-type]
            rope_theta=float(hf.get("rope_theta", 10000.0)),  # type: ignore[arg-type]
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),  # type: ignore[arg-type]
            max_position=int(hf.get("max_position_embeddings", 4096)),  # type: ignore[arg-type]
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
            dtype=dtype,
            bos_token_id=int(hf.get("bos_token_id") or 0),  # type: ignore[arg-type]
            eos_token_id=int(eos),  # type: ignore[arg-type]
            rope_scaling=tuple(sorted(scaling.items())),
            # only Mistral's is read (a Llama config's would be ignored by HF as well);
            # null means full attention
            sliding_window=hf.get("sliding_window") if mistral else None,  # type: ignore[arg-type]
        )
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: {exc}") from None


# ---- folder save / load -----------------------------------------------------------------------


def save_hf(model: LlamaModel, folder: str | Path) -> None:
    """Write config.json + model.safetensors (HF Llama names) into `folder` (created)."""
    from safetensors.torch import save_file

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {name: t.detach().contiguous() for name, t in _named_weights(model).items()}
    (out / CONFIG_FILE).write_text(json.dumps(config_to_hf(model.config), indent=2) + "\n")
    save_file(tensors, str(out / WEIGHTS_FILE), metadata={"format": "pt"})


def read_hf_config(folder: str | Path) -> dict[str, object]:
    path = Path(folder)
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    config_path = path / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE}; not a Hugging Face model folder")
    try:
        hf = json.loads(config_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{config_path}: unreadable JSON: {exc}") from None
    if not isinstance(hf, dict):
        raise CheckpointError(f"{config_path}: must hold a JSON object")
    return hf


def _weight_files(path: Path) -> list[Path]:
    if (path / WEIGHTS_FILE).is_file():
        return [path / WEIGHTS_FILE]
    if (path / INDEX_FILE).is_file():
        try:
            weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{path / INDEX_FILE}: malformed index: {exc}") from None
        absent = [s for s in shards if not (path / s).is_file()]
        if absent:
            raise CheckpointError(
                f"{path}: shards named by {INDEX_FILE} are missing: {', '.join(absent)}"
            )
        return [path / s for s in shards]
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        raise CheckpointError(
            f"{path}: only safetensors weights are loaded (found pickle-based "
            f".bin/.pt files, which pddnet never unpickles)"
        )
    raise CheckpointError(f"{path}: no {WEIGHTS_FILE} (or {INDEX_FILE})")


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: unreadable safetensors file: {exc}") from None
    return tensors


def _summary(names: list[str], limit: int = 5) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" (and {len(names) - limit} more)" if len(names) > limit else "")


def load_hf(folder: str | Path, dtype: str | None = None) -> LlamaModel:
    """Load a Llama checkpoint folder; `dtype` overrides the checkpoint's torch_dtype."""
    path = Path(folder)
    config = config_from_hf(read_hf_config(path), name=path.name, dtype=dtype)
    tensors = _read_tensors(_weight_files(path))
    # Old exports carry rotary buffers; tied checkpoints may still store a copy of the head.
    tensors = {k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}
    if config.tie_embeddings:
        tensors.pop("lm_head.weight", None)
    shapes = expected_shapes(config)
    missing = [n for n in shapes if n not in tensors]
    if missing:
        raise CheckpointError(f"{path}: missing tensors {_summary(missing)}")
    extra = sorted(n for n in tensors if n not in shapes)
    if extra:
        raise CheckpointError(
            f"{path}: unexpected tensors {_summary(extra)} (not a plain "
            f"Llama checkpoint matching its config.json?)"
        )
    for name, shape in shapes.items():
        got = tuple(tensors[name].shape)
        if got != shape:
            raise CheckpointError(
                f"{path}: tensor {name} has shape {got}, config.json implies {shape}"
            )
        if not tensors[name].is_floating_point():
            raise CheckpointError(
                f"{path}: tensor {name} has dtype {tensors[name].dtype}; "
                f"quantised checkpoints are not supported"
            )
    model = LlamaModel(config)
    for name, param in _named_weights(model).items():
        param.copy_(tensors[name])
    return model.eval()
