"""Sans-IO handoff state machines: RLD decides the cut, MD digests token ids.

One ``RelayHandoff`` per request on RLD, one ``MainHandoff`` per request on MD. Events go in as
method calls; each returns the actions (actions.py) the daemon must carry out, in order. Neither
touches a socket, an engine or a clock, so the exactly-once property is tested by driving both
machines through a simulated link (tests/test_handoff_fsm.py).

Indices are output-token indices (0 = P's first token). Positions are sequence positions
(``prompt_len + index``); MD reports progress as the number of positions it holds KV for.

Exactly once: every token RLD emits to the router goes into a HANDOFF before (or with) the final
one, and RLD drops whatever its engine produces after the cut; MD emits only indices at or past
the final cut, and nothing before it (its sequence is held until the final HANDOFF).

Streaming, as both sides play it: at TAKEOVER RLD sends what it has in HANDOFFs of at most
`chunk` ids and keeps decoding, forwarding each further `chunk` of tokens; MD extends at most
`chunk` per step and, whenever it has digested every token it holds, reports its position with
TAKEOVER(ready_position). Such a report means MD keeps pace (a round trip behind), and RLD cuts:
the last HANDOFF (final) carries the tokens made during that round trip. Without that rule a
round trip longer than `chunk` decode steps would never let MD look "within one step" of RLD.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from pddnet.lifecycle import actions as act
from pddnet.policy.handoff import HandoffMode, HandoffPolicy


class HandoffError(ValueError):
    """A peer broke the handoff protocol (gap, conflicting tokens, tokens after the cut...)."""


# -- RLD side -------------------------------------------------------------------------------------


class RelayPhase(enum.Enum):
    DECODING = "decoding"  # emitting tokens; MD has not asked yet (or never will)
    STREAMING = "streaming"  # streaming handoff under way: every new token is forwarded
    CUT = "cut"  # final HANDOFF sent: RLD produces nothing more
    FINISHED = "finished"  # RLD finished the request itself, or it was cancelled


class RelayHandoff:
    """RLD's per-request machine. ``hands_off=False`` (same-dc, P->RLD only): never cuts."""

    def __init__(self, prompt_len: int, policy: HandoffPolicy, hands_off: bool = True) -> None:
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        self.prompt_len = prompt_len
        self.policy = policy
        self.hands_off = hands_off
        self.tokens: list[int] = []
        self.phase = RelayPhase.DECODING
        self.mode: HandoffMode | None = None
        self.sent = 0  # tokens already put into HANDOFF messages
        self.chunk = 1
        self.md_position = 0
        self._pending_takeover: tuple[int, int, float] | None = None
        self._boundaries: set[int] = set()  # token counts MD holds after each HANDOFF

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)

    def rld_token(
        self, index: int, token: int, finish_reason: str | None = None
    ) -> list[act.HandoffAction]:
        """RLD's engine produced ``token`` at output ``index`` (index 0: P's first token)."""
        if self.phase in (RelayPhase.CUT, RelayPhase.FINISHED):
            return []  # past the cut: MD owns this index and will compute the same token
        if index != len(self.tokens):
            raise HandoffError(f"relay token index {index}, expected {len(self.tokens)}")
        self.tokens.append(token)
        actions: list[act.HandoffAction] = [act.EmitTokens(index, (token,))]
        if finish_reason is not None:
            streaming = self.phase is RelayPhase.STREAMING
            self.phase = RelayPhase.FINISHED
            actions.append(act.FinishRequest(finish_reason, len(self.tokens)))
            if self.hands_off:
                why = "relay finished the request" + (
                    " during a streaming handoff" if streaming else ""
                )
                actions.append(act.CancelPeer(why))
            return actions
        if self.phase is RelayPhase.STREAMING:
            # Batched: a HANDOFF per `chunk` new tokens (MD digests that much per step anyway),
            # the rest goes with MD's next progress report, so token ids stay a few bytes each.
            if len(self.tokens) - self.sent >= self.chunk:
                actions += self._forward()
        elif self._pending_takeover is not None:
            ready, chunk, load = self._pending_takeover
            self._pending_takeover = None
            actions += self.takeover(ready, chunk, load)
        return actions

    def takeover(
        self, ready_position: int, chunk_tokens: int, rld_load: float
    ) -> list[act.HandoffAction]:
        """MD sent TAKEOVER: the first one asks for the handoff, later ones report progress."""
        if not self.hands_off:
            raise HandoffError("this request has no main-decode tier (same-dc): no takeover")
        if chunk_tokens < 1:
            raise HandoffError(f"TAKEOVER chunk_tokens must be >= 1, got {chunk_tokens}")
        if self.phase is RelayPhase.STREAMING:
            return self.md_progress(ready_position)
        if self.phase is not RelayPhase.DECODING:
            return []  # already cut or finished: a late progress report
        if not self.tokens:  # MD was faster than the shared-memory copy: wait for index 0
            self._pending_takeover = (ready_position, chunk_tokens, rld_load)
            return []
        decision = self.policy.decide(len(self.tokens), rld_load)
        self.mode = decision.mode
        self.chunk = chunk_tokens
        self.md_position = ready_position
        actions: list[act.HandoffAction] = [
            act.HandoffStarted(decision.mode.value, len(self.tokens), decision.reason)
        ]
        if decision.mode is HandoffMode.ONE_SHOT or self._caught_up(len(self.tokens)):
            return actions + self._cut()
        self.phase = RelayPhase.STREAMING
        return actions + self._forward()

    def md_progress(self, ready_position: int) -> list[act.HandoffAction]:
        """MD holds KV for ``ready_position`` positions (streaming handoff)."""
        if self.phase is not RelayPhase.STREAMING:
            return []
        self.md_position = max(self.md_position, ready_position)
        # MD reports when it has digested every token it holds, which always ends at a HANDOFF
        # boundary: it is starved, keeping pace with RLD a round trip behind. That (or being
        # within one step of RLD's newest token) is the moment to cut. The tokens RLD made
        # during the round trip go with the final HANDOFF; MD digests them at most `chunk`
        # per step. Waiting for a report "within one step of RLD" instead would never end when
        # the round trip is longer than `chunk` decode steps.
        digested = self.md_position - self.prompt_len + 1  # tokens MD holds, the last uncomputed
        if digested in self._boundaries or self._caught_up(len(self.tokens)):
            return self._cut()
        return []

    def peer_lost(self, why: str = "main decode lost") -> list[act.HandoffAction]:
        """MD is gone (dead, hung or cut off), or dropped its copy, before the cut: RLD is the
        fallback and decodes the request to its end alone. Until the final HANDOFF every token
        is RLD's (a streaming handoff only forwarded copies), so nothing is lost or produced
        twice."""
        if self.phase in (RelayPhase.CUT, RelayPhase.FINISHED) or not self.hands_off:
            return []
        was_streaming = self.phase is RelayPhase.STREAMING
        self.hands_off = False
        self.phase = RelayPhase.DECODING
        self._pending_takeover = None
        return [
            act.HandoffAbandoned(why + (" during a streaming handoff" if was_streaming else ""))
        ]

    def cancel(self) -> list[act.HandoffAction]:
        """Router cancel, or MD dropped the request: stop decoding."""
        if self.phase in (RelayPhase.CUT, RelayPhase.FINISHED):
            return []
        self.phase = RelayPhase.FINISHED
        return [act.StopSequence()]

    def _caught_up(self, handed: int) -> bool:
        # MD needs KV for every handed token (positions up to prompt_len + handed) before it
        # samples the next one: within one extend step of `chunk`, the cut costs MD one step.
        return self.prompt_len + handed - self.md_position <= self.chunk

    def _forward(self) -> list[act.HandoffAction]:
        """Non-final HANDOFFs for every token not handed over yet, `chunk` tokens each."""
        out: list[act.HandoffAction] = []
        for start in range(self.sent, len(self.tokens), self.chunk):
            piece = tuple(self.tokens[start : start + self.chunk])
            out.append(act.SendHandoff(start, piece, False, HandoffMode.STREAMING.value))
            self._boundaries.add(start + len(piece))
        self.sent = len(self.tokens)
        return out

    def _cut(self) -> list[act.HandoffAction]:
        """Stop, and hand over what MD does not have yet: one-shot in a single final message;
        streaming in `chunk`-sized messages of which the last is final."""
        mode = self.mode if self.mode is not None else HandoffMode.ONE_SHOT
        actions: list[act.HandoffAction] = [act.StopSequence()]
        if mode is HandoffMode.STREAMING:
            starts = list(range(self.sent, len(self.tokens), self.chunk)) or [self.sent]
            for k, start in enumerate(starts):
                piece = tuple(self.tokens[start : start + self.chunk])
                actions.append(act.SendHandoff(start, piece, k == len(starts) - 1, mode.value))
        else:
            actions.append(
                act.SendHandoff(self.sent, tuple(self.tokens[self.sent :]), True, mode.value)
            )
        self.sent = len(self.tokens)
        self.phase = RelayPhase.CUT
        return actions


# -- MD side --------------------------------------------------------------------------------------


class MainPhase(enum.Enum):
    RECEIVING_KV = "receiving_kv"  # the WAN copy is still arriving
    WAITING_CUT = "waiting_cut"  # TAKEOVER sent; held until the final HANDOFF
    DECODING = "decoding"  # emitting tokens from the cut (or from index 0)
    DONE = "done"


class MainHandoff:
    """MD's per-request machine. ``with_relay=False`` (cross-dc, P->MD): MD emits from index 0."""

    def __init__(self, prompt_len: int, chunk_tokens: int, with_relay: bool = True) -> None:
        if prompt_len < 1 or chunk_tokens < 1:
            raise ValueError("prompt_len and chunk_tokens must be >= 1")
        self.prompt_len = prompt_len
        self.chunk_tokens = chunk_tokens
        self.with_relay = with_relay
        self.phase = MainPhase.RECEIVING_KV
        self.known: list[int] = []  # output tokens MD has (given or sampled)
        self.mode: str | None = None
        self.next_index = 0  # first index MD emits (the cut)
        self.position = 0  # positions with KV on MD
        self._reported = 0
        self._first_emitted = False

    def kv_complete(self, first_token: int) -> list[act.HandoffAction]:
        """MD holds the prompt's KV and P's first token (KV_DONE + every chunk)."""
        if self.phase is not MainPhase.RECEIVING_KV:
            raise HandoffError(f"KV completed twice (phase {self.phase.value})")
        self.known = [first_token]
        self.position = self._reported = self.prompt_len
        if not self.with_relay:
            self.phase = MainPhase.DECODING
            self._first_emitted = True
            return [
                act.StartSequence((first_token,), hold=False),
                act.EmitTokens(0, (first_token,)),
                act.FirstMainToken(0),
            ]
        self.phase = MainPhase.WAITING_CUT
        return [
            act.StartSequence((first_token,), hold=True),
            act.SendTakeover(self.prompt_len, self.chunk_tokens),
        ]

    def handoff(
        self, start_index: int, token_ids: Sequence[int], final: bool, mode: str
    ) -> list[act.HandoffAction]:
        """RLD's HANDOFF arrived."""
        if self.phase is not MainPhase.WAITING_CUT:
            if self.phase is MainPhase.DONE:
                return []  # cancelled meanwhile
            raise HandoffError(f"HANDOFF in phase {self.phase.value}")
        if start_index > len(self.known):
            raise HandoffError(
                f"HANDOFF starts at index {start_index} but MD has only "
                f"{len(self.known)} tokens: a gap"
            )
        overlap = list(token_ids[: len(self.known) - start_index])
        if overlap != self.known[start_index : start_index + len(overlap)]:
            raise HandoffError(f"HANDOFF tokens at {start_index} contradict the tokens MD holds")
        new = tuple(token_ids[len(overlap) :])
        actions: list[act.HandoffAction] = []
        if self.mode is None:
            self.mode = mode
            actions.append(
                act.SetChunk(self.chunk_tokens if mode == HandoffMode.STREAMING.value else None)
            )
        if new:
            self.known += new
            actions.append(act.AppendTokens(new))
        if final:
            self.phase = MainPhase.DECODING
            self.next_index = len(self.known)
            actions += [act.ReleaseHold(), act.HandoffEnded(mode, self.next_index)]
        return actions

    def md_step(
        self,
        num_computed: int,
        output_index: int,
        new_tokens: Sequence[int],
        finish_reason: str | None = None,
    ) -> list[act.HandoffAction]:
        """MD's engine ran a step for this request."""
        if self.phase is MainPhase.DONE:
            return []
        self.position = max(self.position, num_computed)
        actions: list[act.HandoffAction] = []
        if self.phase is MainPhase.WAITING_CUT:
            if new_tokens:
                raise HandoffError(
                    "MD sampled before the final HANDOFF (its sequence must be held)"
                )
            # Report only once every token held is digested (the last stays uncomputed while
            # held): RLD reads such a report as "MD keeps pace" and cuts.
            idle = self.position >= self.prompt_len + len(self.known) - 1
            if self.mode == HandoffMode.STREAMING.value and idle and self.position > self._reported:
                self._reported = self.position
                actions.append(act.SendTakeover(self.position, self.chunk_tokens))
            return actions
        if self.phase is not MainPhase.DECODING:
            raise HandoffError(f"MD step in phase {self.phase.value}")
        if new_tokens:
            if output_index != len(self.known):
                raise HandoffError(f"MD sampled index {output_index}, expected {len(self.known)}")
            self.known += list(new_tokens)
            if not self._first_emitted:
                self._first_emitted = True
                actions.append(act.FirstMainToken(output_index))
            actions.insert(0, act.EmitTokens(output_index, tuple(new_tokens)))
        if finish_reason is not None:
            self.phase = MainPhase.DONE
            actions.append(act.FinishRequest(finish_reason, len(self.known)))
        return actions

    def cancel(self) -> list[act.HandoffAction]:
        """Router cancel, or RLD finished the request itself: drop it."""
        if self.phase is MainPhase.DONE:
            return []
        started = self.phase is not MainPhase.RECEIVING_KV
        self.phase = MainPhase.DONE
        return [act.StopSequence()] if started else []


__all__ = [
    "HandoffError",
    "RelayPhase",
    "RelayHandoff",
    "MainPhase",
    "MainHandoff",
]
