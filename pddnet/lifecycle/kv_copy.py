"""MD's accounting of P's KV copy of one request, sans-IO: the KV_CHUNK frames (tcp path) and
their bytes against KV_DONE's counts, and the arrival span P's goodput estimate is taken from.
The machine (decode_request.py) decides what a fault or a complete copy leads to."""

from __future__ import annotations

from dataclasses import dataclass, field

from pddnet.lifecycle.actions import SendKvReceived
from pddnet.protocol import KvDone


@dataclass
class KvCopy:
    """``hit_tokens``: positions MD holds already (P sends from there to ``num_tokens``)."""

    hit_tokens: int
    num_tokens: int
    chunks: set[int] = field(default_factory=set)
    bytes_in: int = 0
    imports_pending: int = 0
    first_at: float | None = None  # arrival times (the daemon's clock), for P's goodput
    last_at: float = 0.0
    first_bytes: int = 0

    def chunk_arrived(
        self, chunk_index: int, token_start: int, token_end: int, nbytes: int, now_s: float
    ) -> str | None:
        """A KV_CHUNK to import: counted, or what is wrong with it (then nothing is counted)."""
        if chunk_index in self.chunks:
            return "duplicate chunk index"
        if not self.hit_tokens <= token_start < token_end <= self.num_tokens:
            return (
                f"positions [{token_start}, {token_end}) outside the "
                f"uncached range [{self.hit_tokens}, {self.num_tokens})"
            )
        self.chunks.add(chunk_index)
        self.imports_pending += 1
        if self.first_at is None:
            self.first_at, self.first_bytes = now_s, nbytes
        self.last_at = now_s
        return None

    def chunk_imported(self, nbytes: int) -> None:
        self.imports_pending -= 1
        self.bytes_in += nbytes

    def landed(self, num_bytes: int, now_s: float) -> None:
        """One-sided path: every write landed before P sent KV_DONE (acknowledged)."""
        self.first_at = self.last_at = now_s
        self.bytes_in = num_bytes

    def more_than(self, done: KvDone) -> str | None:
        """What arrived beyond KV_DONE's counts (a fault), or None."""
        if len(self.chunks) > done.num_chunks or self.bytes_in > done.num_bytes:
            return (
                f"received {len(self.chunks)} chunks / {self.bytes_in} bytes, more "
                f"than KV_DONE's {done.num_chunks} / {done.num_bytes}"
            )
        return None

    def short_of(self, done: KvDone) -> bool:
        """KV_DONE counts chunks or bytes still on the bulk lanes."""
        return len(self.chunks) < done.num_chunks or self.bytes_in < done.num_bytes

    def received(self) -> SendKvReceived:
        """KV_RECEIVED's figures: all the bytes, and the span after the first chunk's."""
        span = self.last_at - self.first_at if self.first_at is not None else 0.0
        return SendKvReceived(
            self.bytes_in, max(0, self.bytes_in - self.first_bytes), max(0.0, span)
        )
