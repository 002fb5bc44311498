"""One entry point from a model spec to (model, tokenizer): a preset name or an HF folder."""

from __future__ import annotations

from pathlib import Path

from pddnet.model.config import PRESETS, ModelConfig
from pddnet.model.llama import LlamaModel
from pddnet.model.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer
from pddnet.model.weights import CheckpointError, init_random, load_hf, save_hf

__all__ = ["load_model", "init_random", "save_hf", "load_hf", "CheckpointError"]


def load_model(spec: str, dtype: str | None = None, seed: int = 0) -> tuple[LlamaModel, Tokenizer]:
    """A preset name ("tiny" / "small" / "medium": weights seeded by `seed`) or a folder in
    Hugging Face Llama layout (`seed` unused). `dtype` overrides the preset's or file's dtype."""
    if spec in PRESETS:
        return init_random(ModelConfig.preset(spec, dtype), seed), ByteTokenizer()
    path = Path(spec)
    if not path.exists():
        raise ValueError(
            f"unknown model {spec!r}: expected a preset ({', '.join(PRESETS)}) "
            f"or a folder in Hugging Face Llama layout"
        )
    model = load_hf(path, dtype)
    tokenizer = load_tokenizer(path)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise CheckpointError(
            f"{path}: tokenizer has {tokenizer.vocab_size} tokens but the model "
            f"only {model.config.vocab_size}"
        )
    return model, tokenizer
