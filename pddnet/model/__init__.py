"""pddnet.model: a small Llama-style decoder, its weights and its tokenizer.

Names are re-exported lazily (PEP 562) so that importing `pddnet.model.cli` for argument
parsing does not import torch.
"""

from __future__ import annotations

from pddnet.lazy import lazy_exports

_EXPORTS = {
    "ModelConfig": "config",
    "PRESETS": "config",
    "LlamaModel": "llama",
    "AttentionFn": "llama",
    "causal_attention": "attention",
    "init_random": "weights",
    "save_hf": "weights",
    "load_hf": "weights",
    "CheckpointError": "weights",
    "load_model": "loader",
    "Tokenizer": "tokenizer",
    "ByteTokenizer": "tokenizer",
    "HFTokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
}

__all__, __getattr__ = lazy_exports(__name__, _EXPORTS)
