"""A choice's text as its tokens arrive, ended at a stop string the way vLLM does it (sans-IO)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class IncrementalDetokenizer:
    """Token ids in, text deltas out, never splitting a multi-byte character: text that ends in
    U+FFFD (an incomplete UTF-8 sequence so far) is held back until the next token completes it
    (the offsets trick vLLM uses). `flush()` releases whatever is left at the end."""

    def __init__(self, decode: Any) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # tokens whose text has been emitted
        self.text = ""

    def feed(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        new_text = self._decode(self._ids[self._prefix :])
        delta = new_text[len(prefix_text) :]
        self._prefix = self._read = len(self._ids)
        self.text += delta
        return delta


class ChoiceText:
    """A choice's text as its tokens arrive, ended by a stop string the way vLLM does it: the
    check runs on the detokenized text after each token once more than `min_tokens` tokens
    exist, over the new characters (and a stop string's length before them); a match cuts the
    text before the stop string (after it with `include_stop_str_in_output`) and the tokens
    after the one that completed it. While streaming, the last len(longest stop string) - 1
    characters are held back so that no part of a stop string is ever sent."""

    def __init__(
        self, decode: Any, stop: Sequence[str] = (), min_tokens: int = 0, include_stop: bool = False
    ) -> None:
        self._detok = IncrementalDetokenizer(decode)
        self.stop = tuple(stop)
        self.min_tokens = min_tokens
        self.include_stop = include_stop
        self.hold = 0 if include_stop or not self.stop else max(len(x) for x in self.stop) - 1
        self.text = ""
        self.num_tokens = 0
        self.stopped: str | None = None  # the stop string that ended the choice
        self.final = False

    def feed(self, token_ids: Sequence[int]) -> int | None:
        """Tokens in order. When a stop string ends the choice: how many of these tokens it
        keeps (the rest are dropped); else None."""
        if self.final:
            return 0
        for i, tok in enumerate(token_ids):
            delta = self._detok.feed([tok])
            self.num_tokens += 1
            if delta:
                self.text += delta
                if self._check(len(delta)):
                    return i + 1
        return None

    def finish(self) -> bool:
        """The choice's tokens are all in: release what the detokenizer held back. True when
        that text completed a stop string (the text is then cut there)."""
        if self.final:
            return False
        delta = self._detok.flush()
        self.text += delta
        found = bool(delta) and self._check(len(delta))
        self.final = True
        return found

    @property
    def emittable(self) -> int:
        """How much of `text` may be sent now."""
        return len(self.text) if self.final else max(0, len(self.text) - self.hold)

    def _check(self, new_chars: int) -> bool:
        if not self.stop or self.num_tokens <= self.min_tokens:
            return False
        for s in self.stop:
            at = self.text.find(s, max(0, len(self.text) - new_chars - len(s) + 1))
            if at != -1:
                self.text = self.text[: at + (len(s) if self.include_stop else 0)]
                self.stopped = s
                self.final = True
                return True
        return False
