"""RLD admission control: the relay pool is small and must never be flooded.

The source report shows what happens otherwise: keeping low-hit traffic on RLD overloaded it
and collapsed the whole system. So RLD admits a request only while its running tokens, KV
blocks and queue stay under fixed limits; a refused request goes P->MD and waits there instead
of queueing behind RLD. RLD's own instance is authoritative; P keeps a copy fed by RLD's answers.

Requests the singular-traffic filter keeps on RLD for their whole output (long uncached input,
short output) are exactly the low-hit traffic that collapsed the source's system when it piled
up there: they may hold at most ``singular_share`` of each limit, so that RLD always keeps room
for the requests it only relays (which leave at the handoff).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdmissionDecision:
    admitted: bool
    reason: str


@dataclass
class RelayAdmission:
    max_running_tokens: int  # prompt + output tokens of every admitted request, summed
    max_blocks: int  # KV blocks RLD may hold for admitted requests
    max_requests: int = 64  # admitted requests at once (RLD's "queue" never grows past it)
    singular_share: float = 0.5  # of each limit, for requests RLD finishes alone
    _held: dict[str, tuple[int, int]] = field(default_factory=dict, init=False)
    _tokens: int = field(default=0, init=False)
    _blocks: int = field(default=0, init=False)
    _singular: set[str] = field(default_factory=set, init=False)
    _singular_tokens: int = field(default=0, init=False)
    _singular_blocks: int = field(default=0, init=False)
    refused: int = field(default=0, init=False)
    admitted: int = field(default=0, init=False)
    peak_requests: int = field(default=0, init=False)  # high-water marks: what a test checks
    peak_tokens: int = field(default=0, init=False)
    peak_blocks: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        for name in ("max_running_tokens", "max_blocks", "max_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.singular_share <= 1.0:
            raise ValueError(f"singular_share must be in [0, 1], got {self.singular_share}")
        # set here as well as by the field defaults: mypyc's compiled __init__ (the simulator's
        # --compiled) leaves init=False fields unset
        self._held, self._singular = {}, set()
        self._tokens = self._blocks = self._singular_tokens = self._singular_blocks = 0
        self.refused = self.admitted = 0
        self.peak_requests = self.peak_tokens = self.peak_blocks = 0

    @property
    def load(self) -> float:
        """Occupancy in [0, 1]: the tighter of the token and block limits."""
        return min(1.0, max(self._tokens / self.max_running_tokens, self._blocks / self.max_blocks))

    @property
    def num_requests(self) -> int:
        return len(self._held)

    def try_admit(
        self, request_id: str, tokens: int, blocks: int, singular: bool = False
    ) -> AdmissionDecision:
        """Admit a request holding `tokens` (prompt + output) and `blocks`; `singular`: RLD is
        to finish it alone (P->RLD), which only ``singular_share`` of the pool may serve."""
        if request_id in self._held:
            raise ValueError(f"request {request_id!r} is already admitted")
        if tokens < 0 or blocks < 0:
            raise ValueError(f"tokens and blocks must be >= 0, got {tokens}, {blocks}")
        reason = ""
        if len(self._held) >= self.max_requests:
            reason = f"RLD holds {len(self._held)} requests (limit {self.max_requests})"
        elif self._tokens + tokens > self.max_running_tokens:
            reason = f"RLD running tokens {self._tokens}+{tokens} > {self.max_running_tokens}"
        elif self._blocks + blocks > self.max_blocks:
            reason = f"RLD KV blocks {self._blocks}+{blocks} > {self.max_blocks}"
        elif singular:
            share = self.singular_share
            if len(self._singular) + 1 > share * self.max_requests:
                reason = (
                    f"RLD already finishes {len(self._singular)} requests alone "
                    f"(singular share {share:g} of {self.max_requests})"
                )
            elif self._singular_tokens + tokens > share * self.max_running_tokens:
                reason = (
                    f"singular traffic would hold {self._singular_tokens + tokens} tokens "
                    f"> {share:g} x {self.max_running_tokens}"
                )
            elif self._singular_blocks + blocks > share * self.max_blocks:
                reason = (
                    f"singular traffic would hold {self._singular_blocks + blocks} blocks "
                    f"> {share:g} x {self.max_blocks}"
                )
        if reason:
            self.refused += 1
            return AdmissionDecision(False, reason)
        self._held[request_id] = (tokens, blocks)
        self._tokens += tokens
        self._blocks += blocks
        if singular:
            self._singular.add(request_id)
            self._singular_tokens += tokens
            self._singular_blocks += blocks
        self.admitted += 1
        self.peak_requests = max(self.peak_requests, len(self._held))
        self.peak_tokens = max(self.peak_tokens, self._tokens)
        self.peak_blocks = max(self.peak_blocks, self._blocks)
        return AdmissionDecision(True, "admitted")

    def counters(self) -> dict[str, int | float]:
        return {
            "requests": len(self._held),
            "tokens": self._tokens,
            "blocks": self._blocks,
            "load": round(self.load, 6),
            "admitted": self.admitted,
            "refused": self.refused,
            "peak_requests": self.peak_requests,
            "peak_tokens": self.peak_tokens,
            "peak_blocks": self.peak_blocks,
            "singular_requests": len(self._singular),
            "max_requests": self.max_requests,
            "max_running_tokens": self.max_running_tokens,
            "max_blocks": self.max_blocks,
        }

    def release(self, request_id: str) -> bool:
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._tokens -= held[0]
        self._blocks -= held[1]
        if request_id in self._singular:
            self._singular.discard(request_id)
            self._singular_tokens -= held[0]
            self._singular_blocks -= held[1]
        return True
