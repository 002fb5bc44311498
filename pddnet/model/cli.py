"""`pdd model export`: write a preset's seeded weights (or a re-typed folder) as an HF folder.

Importing this module imports nothing heavy; torch comes in when the handler runs.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pddnet.model.config import DTYPES

# Tokenizer files travel with the weights when exporting from a folder.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)

# --model wherever a command loads a model (pddnet.model.loader.load_model takes either)
MODEL_METAVAR = "tiny|small|medium|PATH"
MODEL_HELP = "preset (seeded random weights, byte vocabulary) or a folder in HF Llama layout"


def add_model_argument(parser: argparse.ArgumentParser, default: str | None) -> None:
    """The --model option: required where the command has no default model."""
    parser.add_argument(
        "--model", default=default, required=default is None, metavar=MODEL_METAVAR, help=MODEL_HELP
    )


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser("model", help="model utilities (export a preset as an HF folder)")
    model_sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    export = model_sub.add_parser(
        "export",
        help="write a model as a Hugging Face Llama folder",
        description="Write config.json + model.safetensors (HF Llama tensor names) for a preset's "
        "seeded random weights, or re-save a model folder (e.g. in another dtype).",
    )
    add_model_argument(export, default=None)
    export.add_argument("--out", required=True, metavar="DIR", help="folder to write (created)")
    export.add_argument("--seed", type=int, default=0, help="weight seed for presets")
    export.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help="dtype of the written weights (default: the model's own)",
    )
    export.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    import torch

    from pddnet.model.loader import load_model
    from pddnet.model.weights import save_hf

    torch.set_num_threads(1)
    out = Path(args.out)
    source = Path(args.model)
    if source.exists() and out.resolve() == source.resolve():
        raise SystemExit("pdd model export: --out must differ from the --model folder")
    try:
        model, _ = load_model(args.model, dtype=args.dtype, seed=args.seed)
    except ValueError as exc:
        raise SystemExit(f"pdd model export: {exc}") from None
    save_hf(model, out)
    written = ["config.json", "model.safetensors"]
    if source.is_dir():
        for name in _TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, out / name)
                written.append(name)
    cfg = model.config
    print(
        f"exported {cfg.name} ({cfg.num_parameters:,} parameters, {cfg.dtype}, "
        f"{cfg.kv_bytes_per_token} KV bytes/token) to {out}"
    )
    for name in written:
        print(f"  {out / name}  {(out / name).stat().st_size:,} bytes")
    return 0
