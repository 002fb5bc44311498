"""Tokenizers: byte-level by default, a model folder's tokenizer.json when `tokenizers` is there.

The byte tokenizer needs no files and matches the presets' vocabulary: ids 0..255 are the UTF-8
bytes of the text, then BOS, EOS and PAD.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from pddnet.model.config import (
    BYTE_BOS_ID,
    BYTE_EOS_ID,
    BYTE_PAD_ID,
    BYTE_VOCAB,
    BYTE_VOCAB_SIZE,
)


@runtime_checkable
class Tokenizer(Protocol):
    bos_token_id: int
    eos_token_id: int
    vocab_size: int

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special: bool = True) -> str: ...


class ByteTokenizer:
    """Text <-> UTF-8 bytes; undecodable byte runs (e.g. a cut multibyte char) become U+FFFD."""

    bos_token_id = BYTE_BOS_ID
    eos_token_id = BYTE_EOS_ID
    pad_token_id = BYTE_PAD_ID
    vocab_size = BYTE_VOCAB_SIZE
    _SPECIAL_TEXT = {BYTE_BOS_ID: "<bos>", BYTE_EOS_ID: "<eos>", BYTE_PAD_ID: "<pad>"}

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Sequence[int], skip_special: bool = True) -> str:
        parts: list[str] = []
        run = bytearray()
        for tid in token_ids:
            tid = int(tid)
            if 0 <= tid < BYTE_VOCAB:
                run.append(tid)
                continue
            if tid not in self._SPECIAL_TEXT:
                raise ValueError(
                    f"token id {tid} is outside the byte vocabulary (0..{BYTE_VOCAB_SIZE - 1})"
                )
            if not skip_special:
                parts.append(run.decode("utf-8", errors="replace"))
                run.clear()
                parts.append(self._SPECIAL_TEXT[tid])
        parts.append(run.decode("utf-8", errors="replace"))
        return "".join(parts)


class HFTokenizer:
    """A `tokenizers` tokenizer.json, with BOS added by us (not by its post-processor) so that
    `add_bos` means the same for every tokenizer."""

    def __init__(self, backend: Any, bos_token_id: int, eos_token_id: int) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.vocab_size = int(backend.get_vocab_size(with_added_tokens=True))

    @classmethod
    def from_folder(cls, folder: Path) -> HFTokenizer:
        from tokenizers import Tokenizer as Backend

        path = folder / "tokenizer.json"
        try:
            backend = Backend.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception for bad files
            raise ValueError(f"{path}: not a valid tokenizers file: {exc}") from None
        bos = _special_id(folder, backend, "bos")
        eos = _special_id(folder, backend, "eos")
        if bos is None or eos is None:
            raise ValueError(
                f"{folder}: cannot tell the BOS/EOS token ids (set bos_token_id and "
                f"eos_token_id in config.json, or bos_token/eos_token in "
                f"tokenizer_config.json)"
            )
        return cls(backend, bos, eos)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(self._backend.encode(text, add_special_tokens=False).ids)
        return [self.bos_token_id, *ids] if add_bos else ids

    def decode(self, token_ids: Sequence[int], skip_special: bool = True) -> str:
        return self._backend.decode([int(t) for t in token_ids], skip_special_tokens=skip_special)


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file's top-level object; {} when it is missing, unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _special_id(folder: Path, backend: Any, kind: str) -> int | None:
    """BOS/EOS id: config.json's `<kind>_token_id`, else tokenizer_config.json's token text."""
    value = read_json_object(folder / "config.json").get(f"{kind}_token_id")
    if isinstance(value, list):  # Llama 3 lists several EOS ids; the first is the primary one
        value = value[0] if value else None
    if isinstance(value, int):
        return value
    token = read_json_object(folder / "tokenizer_config.json").get(f"{kind}_token")
    if isinstance(token, dict):  # older files store an AddedToken object
        token = token.get("content")
    if isinstance(token, str):
        return backend.token_to_id(token)
    return None


def load_tokenizer(folder: str | Path | None) -> Tokenizer:
    """The folder's tokenizer.json through `tokenizers` if both exist, else the byte tokenizer."""
    if folder is not None and (Path(folder) / "tokenizer.json").is_file():
        try:
            import tokenizers  # noqa: F401
        except ImportError:
            warnings.warn(
                f"{folder}: tokenizer.json ignored because the `tokenizers` package "
                f"is not installed; using the byte tokenizer",
                stacklevel=2,
            )
        else:
            return HFTokenizer.from_folder(Path(folder))
    return ByteTokenizer()
