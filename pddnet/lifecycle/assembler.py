"""Sans-IO stream assembler: token events by index, from any producer, in -> one in-order,
exactly-once output stream out.

RLD and MD both produce tokens for a request (RLD eagerly, MD after the handoff) and their events
travel on different connections, so they may arrive in any order. The assembler places each token
by its output index, releases the longest gap-free run, and ends the stream on EOS, a stop token,
max_tokens, REQUEST_DONE, cancel or error. A token index delivered twice means the cut between RLD
and MD went wrong (exactly one party produces each index): with `strict` (the default) that is an
error; a *different* token at an index already seen is always an error (a conflict). No sockets,
no clock: times are passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

END_REASONS = ("eos", "stop", "length", "cancel", "error")


class AssemblyError(ValueError):
    """The events for a request are inconsistent (conflict, duplicate, out of range)."""


@dataclass
class Released:
    """Tokens newly released in order: indices [start, start + len(token_ids))."""

    start: int
    token_ids: list[int]
    producers: list[str]


@dataclass
class StreamAssembler:
    max_tokens: int
    eos_token_id: int | None = None
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    strict: bool = True

    tokens: list[int] = field(default_factory=list)  # released, in index order
    producers: list[str] = field(default_factory=list)  # who made each released token
    finish_reason: str | None = None
    error: str | None = None
    duplicates: int = 0
    late_events: int = 0  # events after the stream ended
    first_token_time: float | None = None  # caller's clock when index 0 arrived
    done_reason: str | None = None  # REQUEST_DONE seen (its reason)
    warnings: list[str] = field(default_factory=list)  # inconsistencies after the end
    _pending: dict[int, tuple[int, str]] = field(default_factory=dict)
    _expected_total: int | None = None  # from REQUEST_DONE
    _total_reason: str = "eos"
    stopped_by_caller: bool = False  # see stop_at

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        self._stops = set(self.stop_token_ids)

    # -- state -----------------------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def next_index(self) -> int:
        return len(self.tokens)

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    def counts_by_producer(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.producers:
            out[p] = out.get(p, 0) + 1
        return out

    # -- inputs ----------------------------------------------------------------------------------

    def feed_tokens(
        self, index: int, token_ids: Sequence[int], producer: str, now: float | None = None
    ) -> Released | None:
        """A TOKEN_EVENT: tokens index, index+1, ... from `producer`. Returns what became
        releasable in order (None if nothing did). After the stream ended, events are counted
        as late and ignored. An inconsistency ends the stream with reason 'error'."""
        if self.finished:
            self.late_events += 1
            return None
        try:
            self._place(index, token_ids, producer)
        except AssemblyError as exc:
            self._fail(str(exc))
            return None
        released = self._release(now)
        self._maybe_complete()
        return released

    def feed_done(self, reason: str, num_output_tokens: int, producer: str) -> None:
        """A REQUEST_DONE: the producer says the request ended after `num_output_tokens` tokens.
        The stream ends once every index below that has arrived."""
        if reason not in END_REASONS:
            raise ValueError(f"unknown end reason {reason!r}")
        self.done_reason = reason
        if self.finished:
            # The client's stream is already complete; a disagreement is worth a note only.
            if (
                reason not in ("cancel", "error")
                and self.finish_reason not in ("cancel", "error")
                and num_output_tokens != len(self.tokens)
                and not self.stopped_by_caller
            ):
                self.warnings.append(
                    f"REQUEST_DONE from {producer} says {num_output_tokens} "
                    f"tokens; the stream ended after {len(self.tokens)}"
                )
            return
        if reason in ("cancel", "error"):
            self._end(reason)
            if reason == "error":
                self.error = f"{producer} ended the request with an error"
            return
        if num_output_tokens < len(self.tokens) or num_output_tokens > self.max_tokens:
            self._fail(
                f"REQUEST_DONE from {producer} says {num_output_tokens} tokens but "
                f"{len(self.tokens)} were already released (max_tokens {self.max_tokens})"
            )
            return
        beyond = [i for i in self._pending if i >= num_output_tokens]
        if beyond:
            self._fail(
                f"REQUEST_DONE from {producer} says {num_output_tokens} tokens but index "
                f"{min(beyond)} was produced"
            )
            return
        self._expected_total = num_output_tokens
        self._total_reason = reason
        self._maybe_complete()

    def cancel(self) -> None:
        if not self.finished:
            self._end("cancel")

    def stop_at(self, num_tokens: int) -> None:
        """The caller ended the stream after `num_tokens` released tokens with reason 'stop'
        (a stop string in the text, which only the caller sees): later tokens are dropped,
        and producers still running (they were told to stop) may report other counts."""
        if self.finished:
            return
        if not 0 < num_tokens <= len(self.tokens):
            raise ValueError(
                f"stop_at({num_tokens}) outside the {len(self.tokens)} released tokens"
            )
        del self.tokens[num_tokens:]
        del self.producers[num_tokens:]
        self._pending.clear()
        self.stopped_by_caller = True
        self._end("stop")

    def fail(self, message: str) -> None:
        if not self.finished:
            self._fail(message)

    # -- internals -------------------------------------------------------------------------------

    def _place(self, index: int, token_ids: Sequence[int], producer: str) -> None:
        if index < 0:
            raise AssemblyError(f"negative token index {index} from {producer}")
        if not token_ids:
            raise AssemblyError(f"empty token event at index {index} from {producer}")
        end = index + len(token_ids)
        if end > self.max_tokens:
            raise AssemblyError(
                f"{producer} produced index {end - 1} but max_tokens is {self.max_tokens}"
            )
        if self._expected_total is not None and end > self._expected_total:
            raise AssemblyError(
                f"{producer} produced index {end - 1} after REQUEST_DONE said "
                f"{self._expected_total} tokens"
            )
        # Check the whole event before placing any of it: an event is accepted or refused whole.
        for offset, tok in enumerate(token_ids):
            i = index + offset
            seen = self._seen(i)
            if seen is None:
                continue
            old_tok, old_producer = seen
            if old_tok != tok:
                raise AssemblyError(
                    f"conflict at token index {i}: {old_producer} produced "
                    f"{old_tok}, {producer} produced {tok}"
                )
            if self.strict:
                raise AssemblyError(
                    f"token index {i} produced twice ({old_producer}, then {producer})"
                )
        for offset, tok in enumerate(token_ids):
            i = index + offset
            if self._seen(i) is not None:
                self.duplicates += 1
                continue
            self._pending[i] = (int(tok), producer)

    def _seen(self, i: int) -> tuple[int, str] | None:
        if i < len(self.tokens):
            return self.tokens[i], self.producers[i]
        return self._pending.get(i)

    def _release(self, now: float | None) -> Released | None:
        start = len(self.tokens)
        out_t: list[int] = []
        out_p: list[str] = []
        while not self.finished and len(self.tokens) in self._pending:
            tok, producer = self._pending.pop(len(self.tokens))
            if not self.tokens and now is not None:
                self.first_token_time = now
            self.tokens.append(tok)
            self.producers.append(producer)
            out_t.append(tok)
            out_p.append(producer)
            reason = self._stop_reason(tok)
            if reason is not None:
                self._end(reason)
        if self.finished and self._pending:
            # Produced past the end (a producer ignored EOS / a stop token): never released.
            self.warnings.append(
                f"token index {min(self._pending)} was produced after the "
                f"stream ended ({self.finish_reason})"
            )
            self._pending.clear()
        if not out_t:
            return None
        return Released(start, out_t, out_p)

    def _stop_reason(self, tok: int) -> str | None:
        if not self.ignore_eos and self.eos_token_id is not None and tok == self.eos_token_id:
            return "eos"
        if tok in self._stops:
            return "stop"
        if len(self.tokens) >= self.max_tokens:
            return "length"
        return None

    def _maybe_complete(self) -> None:
        if self.finished or self._expected_total is None:
            return
        if len(self.tokens) == self._expected_total:
            self._end(self._total_reason)

    def _end(self, reason: str) -> None:
        self.finish_reason = reason
        if reason in ("cancel", "error"):
            self._pending.clear()

    def _fail(self, message: str) -> None:
        if self.finished:
            return
        self.error = message
        self._end("error")
