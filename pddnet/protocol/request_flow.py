"""Sans-IO per-request state on P: allocations, KV ranges to ship, completions, release.

P prefills a request once and ships its KV to one or two targets ("relay": one-sided writes into
RLD's shared memory; "main_decode": KV_CHUNK frames over the WAN). Prefill starts at once; a
target's KV flows as soon as both its allocation and the computed KV exist, from the target's
prefix hit on (positions below ``hit_tokens`` are never sent). KV_DONE to a target follows its
last range and the first token; P's blocks go back when every target holds its KV (the daemon
reports ``target_finished``: RLD once KV_DONE is out, MD on its KV_RECEIVED).

The daemon runs each target's actions in order (a KV_DONE never overtakes a write).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Transfer:
    """Ship KV positions [start, end) to ``target``."""

    target: str
    start: int
    end: int


@dataclass(frozen=True)
class SendKvDone:
    """All of ``target``'s KV is out: KV_DONE with the first token."""

    target: str
    first_token: int


@dataclass(frozen=True)
class AbortTarget:
    """KV_ABORT to ``target``: it frees what it reserved."""

    target: str
    reason: str


@dataclass(frozen=True)
class ReleaseBlocks:
    """Free P's own blocks for the request (or abort its prefill)."""


@dataclass(frozen=True)
class FailRequest:
    """Report the request as failed to the router (ERROR)."""

    code: str
    message: str


FlowAction = Transfer | SendKvDone | AbortTarget | ReleaseBlocks | FailRequest


@dataclass
class _Target:
    hit: int | None = None  # None: allocation not answered yet
    sent: int = 0  # positions [0, sent) are out (or cached there)
    done_queued: bool = False
    finished: bool = False


class PrefillFlow:
    def __init__(self, num_tokens: int, targets: tuple[str, ...]) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if not targets or len(set(targets)) != len(targets):
            raise ValueError(f"targets must be distinct and non-empty, got {targets}")
        self.num_tokens = num_tokens
        self.targets = {t: _Target() for t in targets}
        self.computed = 0
        self.first_token: int | None = None
        self.over = False  # failed, cancelled or released

    def allocated(self, target: str, hit_tokens: int) -> list[FlowAction]:
        t = self._target(target)
        if t.hit is not None:
            raise ValueError(f"{target} answered the allocation twice")
        if not 0 <= hit_tokens < self.num_tokens:
            raise ValueError(f"{target} hit_tokens {hit_tokens} outside [0, {self.num_tokens})")
        t.hit = t.sent = hit_tokens
        if self.over:  # cancelled while the answer was on its way: give the blocks back
            return [AbortTarget(target, "request no longer active")]
        return self._pump()

    def refused(self, target: str, error: str, others_suffice: bool = False) -> list[FlowAction]:
        """``target`` will not take the request. ``others_suffice``: the remaining targets can
        serve it alone (pdd: RLD decodes to the end when MD has no room), so only this target
        is dropped; otherwise the request fails."""
        self._target(target)  # an unknown target is an error
        if self.over:
            return []
        if others_suffice and len(self.targets) > 1:
            return self.drop(target, "")
        self.over = True
        actions: list[FlowAction] = [FailRequest("kv_alloc_refused", f"{target} refused: {error}")]
        actions += [
            AbortTarget(name, f"{target} refused the request")
            for name, t in self.targets.items()
            if name != target and not t.finished
        ]
        return actions + [ReleaseBlocks()]

    def drop(self, target: str, reason: str) -> list[FlowAction]:
        """Leave ``target`` out from now on (its pipeline changed: e.g. the singular filter
        keeps the request on RLD, so MD's copy is not needed). A target that had reserved
        blocks is told to free them; the others go on."""
        t = self._target(target)
        if self.over or t.finished:
            return []
        allocated = t.hit is not None
        if t.hit is None:
            t.hit = 0
        t.done_queued = t.finished = True  # nothing (more) will go there
        actions: list[FlowAction] = [AbortTarget(target, reason)] if allocated and reason else []
        if len(self.targets) == 1:  # dropping the only target leaves nobody to serve it
            self.over = True
            return actions + [
                FailRequest("no_target", f"{target} dropped: {reason}"),
                ReleaseBlocks(),
            ]
        return actions + self._pump() + self._release_if_done()

    def computed_upto(self, num_computed: int) -> list[FlowAction]:
        if num_computed < self.computed or num_computed > self.num_tokens:
            raise ValueError(
                f"prefill progress {num_computed} after {self.computed} (prompt {self.num_tokens})"
            )
        self.computed = num_computed
        return self._pump()

    def first_token_sampled(self, token: int) -> list[FlowAction]:
        if self.computed != self.num_tokens:
            raise ValueError(
                f"first token sampled with {self.computed}/{self.num_tokens} positions computed"
            )
        self.first_token = token
        return self._pump()

    def target_finished(self, target: str) -> list[FlowAction]:
        t = self._target(target)
        if not t.done_queued:
            raise ValueError(f"{target} finished before its KV_DONE was queued")
        t.finished = True
        return self._release_if_done()

    def _release_if_done(self) -> list[FlowAction]:
        if not self.over and all(x.finished for x in self.targets.values()):
            self.over = True
            return [ReleaseBlocks()]
        return []

    def cancel(self, reason: str) -> list[FlowAction]:
        if self.over:
            return []
        self.over = True
        return [AbortTarget(name, reason) for name, t in self.targets.items() if not t.finished] + [
            ReleaseBlocks()
        ]

    def _pump(self) -> list[FlowAction]:
        if self.over:
            return []
        actions: list[FlowAction] = []
        for name, t in self.targets.items():
            if t.hit is None or t.done_queued:
                continue
            if self.computed > t.sent:
                actions.append(Transfer(name, t.sent, self.computed))
                t.sent = self.computed
            if self.first_token is not None and t.sent == self.num_tokens:
                t.done_queued = True
                actions.append(SendKvDone(name, self.first_token))
        return actions

    def _target(self, target: str) -> _Target:
        try:
            return self.targets[target]
        except KeyError:
            raise ValueError(
                f"{target!r} is not a target of this request ({', '.join(self.targets)})"
            ) from None


__all__ = [
    "PrefillFlow",
    "FlowAction",
    "Transfer",
    "SendKvDone",
    "AbortTarget",
    "ReleaseBlocks",
    "FailRequest",
]
