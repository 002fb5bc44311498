"""P's side of one request, sans-IO: its pipeline, the decode tiers' allocations, the KV ranges
to ship, KV_DONE, cancel, failures and the release of P's blocks.

P prefills a request once and ships its KV to one or two targets ("relay": one-sided writes into
RLD's shared memory; "main_decode": KV_CHUNK frames or one-sided writes over the WAN). Which
targets, and in which order P asks them, is the request's pipeline (pddnet.policy.planner picks
it; the machine takes the plan as an input and never calls the planner):

  P->MD       MD only.
  P->RLD->MD  RLD first; once RLD admits it MD is asked too. RLD refusing makes it P->MD; MD
              refusing, failing or dropping its copy leaves RLD to decode it alone (P->RLD).
  P->RLD      the singular filter: RLD only, MD is never asked (RLD refusing: P->MD).

Prefill starts at once; a target's KV flows as soon as both its allocation and the computed KV
exist, from the target's prefix hit on (positions below the hit are never sent). KV_DONE to a
target follows its last range and the first token; P's blocks go back when every target holds
its KV (RLD once its KV_DONE is out, MD on its KV_RECEIVED) or the request is over.

Inputs are method calls, one per event; each returns the actions to run (actions.py), in
order; the messages they ask for are built in prefill_messages.py. The shell
(pddnet/roles/prefill.py) runs a target's actions in order, so a KV_DONE never overtakes a
write. Times are passed in; nothing here reads a clock, a socket or the engine.

Each target moves through TARGET_TRANSITIONS below; an event a target's state does not allow
raises IllegalTransition. The request as a whole is ACTIVE until it fails, is cancelled or has
shipped everything (then ``over``):

  event                    ACTIVE                                      over
  start()                  ask the first target, start the prefill     illegal
  allocated(t)             t ships from its hit; RLD's admission asks  t's blocks go back
                           MD (P->RLD->MD) or drops it (P->RLD); MD's  (KV_ABORT)
                           hit may turn P->RLD->MD into P->RLD
  allocation_unusable(t)   KV_ABORT to t, then as refused(t)           KV_ABORT to t
  refused(t)               RLD: P->MD; MD under P->RLD->MD: RLD        ignored (late answer)
                           alone; otherwise the request fails
  computed(n)              new ranges to every allocated target        ignored
  first_token(tok)         KV_DONE queued where all the KV is out      ignored
  kv_done_out(t)           RLD: it holds the KV (rld_kv_sent)          illegal (shell checks)
  kv_received()            MD holds the KV (wan_kv_acked)              MD holds the KV
  transfer_failed(t)       MD under P->RLD->MD: RLD alone; else fails  ignored
  peer_lost(t)             as transfer_failed, no KV_ABORT to t        ignored
  cancel(by)               MD's KV_ABORT under P->RLD->MD: RLD alone;  ignored
                           else KV_ABORT to every target, release
  fail(code)               ERROR to the router, KV_ABORT, release      ignored
  engine_failed()          fail, unless the prefill is done            ignored
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pddnet.lifecycle import actions as act
from pddnet.policy.cache_view import Observation
from pddnet.policy.pipeline import Pipeline
from pddnet.policy.planner import Plan

RELAY, MAIN = "relay", "main_decode"
# Who serves a pipeline, in the order P asks them (MD waits for RLD's admission answer).
TARGETS = {
    Pipeline.P_MD: (MAIN,),
    Pipeline.P_RLD_MD: (RELAY, MAIN),
    Pipeline.RLD_ONLY: (RELAY, MAIN),
}


class TargetState(enum.Enum):
    WAITING = "waiting"  # in the pipeline, not asked yet (MD until RLD admits, P->RLD->MD)
    ASKED = "asked"  # KV_ALLOC_REQUEST is out
    SHIPPING = "shipping"  # allocated: its KV goes out as P computes it
    DONE_QUEUED = "done_queued"  # all of its KV and its KV_DONE are queued
    FINISHED = "finished"  # it holds all its KV (RLD: KV_DONE out; MD: KV_RECEIVED)
    DROPPED = "dropped"  # left out: refused, lost, or the pipeline changed without it


W, A, S, Q, F, D = (
    TargetState.WAITING,
    TargetState.ASKED,
    TargetState.SHIPPING,
    TargetState.DONE_QUEUED,
    TargetState.FINISHED,
    TargetState.DROPPED,
)
# (state, event) -> next state. Anything else is an IllegalTransition.
TARGET_TRANSITIONS: dict[tuple[TargetState, str], TargetState] = {
    (W, "ask"): A,
    (A, "allocated"): S,
    (A, "refused"): D,
    (A, "late_answer"): D,  # answered after the request was over: blocks given back
    (D, "late_answer"): D,  # answered after it was dropped (e.g. its peer was lost)
    (S, "queue_kv_done"): Q,
    (Q, "kv_done_out"): Q,  # MD: finished only on its acknowledgement
    (Q, "finished"): F,
    **{(s, "drop"): D for s in (W, A, S, Q)},
}


class IllegalTransition(ValueError):
    """An event the target's state does not allow (a bug in the shell, or a peer's)."""


# -- the machine ----------------------------------------------------------------------------------


@dataclass
class _Target:
    state: TargetState = TargetState.WAITING
    hit: int = 0
    sent: int = 0  # positions [0, sent) are out (or cached there)


class PrefillRequest:
    """P's side of one request. ``targets`` defaults to the pipeline's (TARGETS); the baseline
    modes give theirs (same-dc: RLD only). ``plan`` is the planner's decision (pdd mode)."""

    def __init__(
        self,
        num_tokens: int,
        pipeline: Pipeline,
        targets: tuple[str, ...] | None = None,
        plan: Plan | None = None,
    ) -> None:
        targets = TARGETS[pipeline] if targets is None else targets
        if num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
        if not targets or len(set(targets)) != len(targets):
            raise ValueError(f"targets must be distinct and non-empty, got {targets}")
        self.num_tokens = num_tokens
        self.pipeline = pipeline  # the current one (may change: see the table above)
        self.plan = plan
        self.targets = targets
        self.num_computed = 0
        self.first_token: int | None = None
        self.over = False  # failed, cancelled or released
        self.wan_bytes = 0  # KV bytes written to MD so far
        self._t = {t: _Target() for t in targets}
        self._started = False
        self._wan_committed = False
        self._wan_started: float | None = None  # when MD's allocation answer reached P

    # -- queries ------------------------------------------------------------------------------

    def state(self, target: str) -> TargetState:
        return self._target(target).state

    @property
    def shipped(self) -> bool:
        """Every target holds its KV or was left out, and one of them does hold it."""
        states = [t.state for t in self._t.values()]
        return F in states and all(s in (F, D) for s in states)

    @property
    def prefilled(self) -> bool:
        return self.first_token is not None

    # -- events -------------------------------------------------------------------------------

    def start(self) -> list[act.PrefillAction]:
        if self._started:
            raise IllegalTransition("start: the request was started already")
        self._started = True
        out: list[act.PrefillAction] = [
            act.Count("submitted"),
            act.Count(f"pipeline_{self.pipeline.wire}"),
        ]
        if self.plan is not None:
            out.append(act.ReportPipelineChoice(self.plan))
        return out + self._ask(self.targets[0]) + [act.StartPrefill()]

    def allocated(
        self,
        target: str,
        hit_tokens: int,
        now: float,
        seen: Observation | None = None,
        recheck: Plan | None = None,
    ) -> list[act.PrefillAction]:
        """``target`` reserved room for the request, ``hit_tokens`` of it cached already. For
        MD, ``seen`` is the planner's comparison of its prediction with MD's hit and
        ``recheck`` the new plan the hit calls for (planner.md_answered / recheck)."""
        t = self._target(target)
        if not 0 <= hit_tokens < self.num_tokens:
            raise ValueError(f"{target} hit_tokens {hit_tokens} outside [0, {self.num_tokens})")
        if self.over or t.state is D:  # the answer crossed the end: give the blocks back
            self._move(target, "late_answer")
            return [act.AbortTarget(target, "request no longer active")]
        self._move(target, "allocated")
        t.hit = t.sent = hit_tokens
        out: list[act.PrefillAction] = []
        if target == MAIN:
            # MD's hit fixes what will cross: queued ahead of later requests' KV until MD
            # acknowledges it (released once MD's copy is finished, dropped or over)
            out.append(act.CommitWan(self.num_tokens - hit_tokens))
            self._wan_committed = True
            self._wan_started = now
        out += self._pump()
        if target == RELAY:
            out += self._relay_admitted()
        else:
            out += self._main_answered(hit_tokens, seen, recheck)
        return out + self._settle_wan()

    def allocation_unusable(self, target: str, why: str) -> list[act.PrefillAction]:
        """``target`` reserved blocks P cannot write into: give them back, then it is a
        refusal."""
        reason = f"unusable allocation: {why}"
        return [act.AbortTarget(target, reason)] + self.refused(target, reason)

    def refused(self, target: str, error: str) -> list[act.PrefillAction]:
        t = self._target(target)
        if self.over or t.state is D:  # a late answer: nothing was reserved, nothing to do
            if t.state is A:
                self._move(target, "refused")
            return []
        if target == RELAY and MAIN in self._t and self._t[MAIN].state is W:
            # RLD's admission said no (it is full): the request goes P->MD and waits for its
            # KV there instead of queueing behind RLD.
            self._move(target, "refused")
            out: list[act.PrefillAction] = [
                act.Count("relay_refused"),
                act.Timeline("relay_refused", None, error[:256]),
            ]
            out += self._change_pipeline(Pipeline.P_MD, f"RLD refused: {error}")
            return out + self._ask(MAIN) + self._settle_wan()
        # Without room on MD, RLD (which decodes to the end when no TAKEOVER comes) serves the
        # request alone; without RLD, MD cannot (it waits for a relay's cut).
        self._move(target, "refused")
        if target == MAIN and self.pipeline is Pipeline.P_RLD_MD and len(self._t) > 1:
            out = [
                act.Count("main_decode_refused"),
                act.Timeline("main_decode_refused", None, error[:128]),
            ]
            return out + self._pump() + self._release_if_done() + self._settle_wan()
        out = [act.FailRequest("kv_alloc_refused", f"{target} refused: {error}")]
        return out + self._end(f"{target} refused the request")

    def computed(self, num_computed: int) -> list[act.PrefillAction]:
        if self.over:
            return []
        if num_computed < self.num_computed or num_computed > self.num_tokens:
            raise ValueError(
                f"prefill progress {num_computed} after {self.num_computed} (prompt {self.num_tokens})"
            )
        self.num_computed = num_computed
        return self._pump()

    def first_token_sampled(self, token: int) -> list[act.PrefillAction]:
        if self.over:
            return []
        if self.num_computed != self.num_tokens:
            raise ValueError(
                f"first token sampled with {self.num_computed}/{self.num_tokens} positions computed"
            )
        self.first_token = token
        return [act.Timeline("prefill_end", self.num_computed)] + self._pump()

    def kv_written(self, target: str, num_bytes: int) -> None:
        """A write to ``target`` completed (``wan_bytes`` counts MD's)."""
        self._target(target)
        if target == MAIN:
            self.wan_bytes += num_bytes

    def kv_done_out(self, target: str, num_bytes: int) -> list[act.PrefillAction]:
        """The shell posted ``target``'s KV_DONE (``num_bytes`` of KV went there)."""
        if self.over:
            raise IllegalTransition(f"kv_done_out({target}): the request is over")
        self._move(target, "kv_done_out")
        if target == MAIN:
            # MD's copy is finished when MD says it has it all (KV_RECEIVED): until then the
            # transfer can still be cancelled (the singular filter) and P still holds the KV.
            return [act.Timeline("wan_kv_sent", num_bytes)]
        # The one-sided writes are in RLD's memory already: P's part towards RLD is over and
        # the router now counts RLD as the request's carrier (were RLD to die before its own
        # rld_kv_complete, nobody else would say so).
        self._move(target, "finished")
        return (
            [act.Timeline("rld_kv_sent", num_bytes)] + self._release_if_done() + self._settle_wan()
        )

    def kv_received(self, num_bytes: int, now: float) -> list[act.PrefillAction]:
        """MD acknowledged the request's KV (KV_RECEIVED)."""
        out: list[act.PrefillAction] = []
        if self._wan_started is not None:
            # The goodput sample is P's delivery rate: the KV's bytes over the time from MD's
            # answer to MD's acknowledgement, what the direct-budget test predicts (the line's
            # share this request got, P's pacing and queueing included), whatever the backend.
            # MD's first-to-last arrival span (KV_RECEIVED's span_*) measures one transfer's
            # share of a busy line instead: it swung 0.06-1.8 GB/s on a 4.25 GB/s line in the
            # simulator's full scenario and let PDD's P99 TTFT reach 8.6x the baseline's (1.0x
            # with this sample; docs/simulator.md).
            out.append(act.ObserveWanTransfer(num_bytes, now - self._wan_started))
        if MAIN in self._t and self._t[MAIN].state is Q:
            self._move(MAIN, "finished")
            out += [act.Timeline("wan_kv_acked", num_bytes)] + self._release_if_done()
        return out + self._settle_wan()

    def transfer_failed(self, target: str, why: str) -> list[act.PrefillAction]:
        """A write to ``target`` failed: the receiver is dead, hung, or refused it."""
        if self.over or self._target(target).state in (F, D):
            return []  # a target left out (or done) no longer matters
        if self._relay_can_continue_without(target):
            # RLD has (or gets) its copy and decodes the request to its end.
            return self._change_pipeline(Pipeline.RLD_ONLY, why) + self._drop(MAIN, why)
        # the router replays it by token ids on the other decode tier, or fails it
        return self.fail(f"{target}_lost", why)

    def peer_lost(self, target: str, why: str) -> list[act.PrefillAction]:
        """``target``'s control connection closed."""
        t = self._t.get(target)
        if t is None or t.state in (F, D) or self.over:
            return []
        out: list[act.PrefillAction] = [act.StopWrites(target, why)]
        if self._relay_can_continue_without(target):
            # RLD is the fallback: it decodes the request to its end (it sees MD gone too).
            out += [act.Count("main_lost_relay_continues")]
            return out + self._change_pipeline(Pipeline.RLD_ONLY, why) + self._drop(MAIN, "")
        return out + self.fail(f"{target}_lost", why)

    def cancel(self, reason: str, by: str = "router") -> list[act.PrefillAction]:
        """CANCEL from the router, or KV_ABORT from a decode tier (``by``)."""
        if self.over:
            return []
        if by == MAIN and self._relay_can_continue_without(MAIN):
            # MD dropped its copy (e.g. it lost the relay lane, or a replay replaced its part):
            # RLD still serves the request; MD hears back once P's writes to it have stopped
            # (it may be fencing blocks).
            out = self._change_pipeline(Pipeline.RLD_ONLY, f"main decode dropped it: {reason}")
            out += self._drop(MAIN, "") + [act.AbortTarget(MAIN, f"acknowledged: {reason}")]
            return out
        out = []
        if by == RELAY and MAIN in self._t and self._t[MAIN].state in (S, Q):
            # RLD finished the whole output before MD's copy was complete: stop shipping it.
            out += [
                act.Count("wan_transfers_cancelled"),
                act.Timeline("wan_cancelled", self.wan_bytes, reason[:256]),
            ]
        return out + [act.Count("cancelled")] + self._end(reason)

    def fail(self, code: str, message: str) -> list[act.PrefillAction]:
        if self.over:
            return []
        return [act.FailRequest(code, message)] + self._end(message)

    def engine_failed(self, reason: str) -> list[act.PrefillAction]:
        """P's engine failed: a request still prefilling fails (a prefilled one only keeps
        its blocks, and ships on)."""
        return [] if self.prefilled else self.fail("engine_failed", reason)

    # -- internals ----------------------------------------------------------------------------

    def _ask(self, target: str) -> list[act.PrefillAction]:
        self._move(target, "ask")
        plan = self.plan
        hit = plan.prediction.hit_tokens if plan is not None and target == MAIN else 0
        return [act.AskAllocation(target, self.pipeline, hit)]

    def _relay_admitted(self) -> list[act.PrefillAction]:
        """RLD admitted the request: MD now hears of it (P->RLD->MD), or never (P->RLD)."""
        if MAIN not in self._t or self._t[MAIN].state is not W:
            return []
        if self.pipeline is Pipeline.P_RLD_MD:
            return self._ask(MAIN)
        # the singular filter: the WAN transfer never starts
        return [act.Count("wan_transfers_never_started")] + self._drop(MAIN, "")

    def _main_answered(
        self, hit_tokens: int, seen: Observation | None, recheck: Plan | None
    ) -> list[act.PrefillAction]:
        """MD's hit is authoritative: the planner repaired P's view and rechecked the
        pipeline with it."""
        out: list[act.PrefillAction] = [
            act.Timeline("prefix_hit_tokens", hit_tokens)
        ]  # KV below stays home
        if seen is not None and seen.wrong:
            out += [
                act.Count("md_view_wrong"),
                act.Timeline(
                    "md_view_wrong",
                    seen.predicted_tokens,
                    f"predicted {seen.predicted_tokens}, MD holds {seen.actual_tokens}",
                ),
            ]
        if recheck is not None and self.pipeline is Pipeline.P_RLD_MD:
            self.plan = recheck
            out += self._change_pipeline(recheck.pipeline, recheck.decision.reason)
            out += [act.Count("wan_transfers_cancelled")]
            out += self._drop(MAIN, f"singular traffic: {recheck.decision.reason}")
        return out

    def _relay_can_continue_without(self, target: str) -> bool:
        """Losing MD's copy under P->RLD->MD leaves RLD, which has (or gets) its own copy and
        decodes to the end when no TAKEOVER comes."""
        relay = self._t.get(RELAY)
        return (
            target == MAIN
            and self.pipeline is Pipeline.P_RLD_MD
            and relay is not None
            and relay.state in (S, Q, F)
        )

    def _change_pipeline(self, pipeline: Pipeline, reason: str) -> list[act.PrefillAction]:
        old, self.pipeline = self.pipeline, pipeline
        return [
            act.Count(f"pipeline_{old.wire}_to_{pipeline.wire}"),
            act.ReportPipelineChange(pipeline, reason),
        ]

    def _drop(self, target: str, reason: str) -> list[act.PrefillAction]:
        """Leave ``target`` out from now on. One that had reserved blocks is told to free them
        (when there is a ``reason``); the others go on."""
        t = self._target(target)
        if self.over or t.state in (F, D):
            return []
        reserved = t.state in (S, Q)
        self._move(target, "drop")
        out: list[act.PrefillAction] = (
            [act.AbortTarget(target, reason)] if reserved and reason else []
        )
        if all(x.state is D for x in self._t.values()):  # nobody is left to serve it
            fail = act.FailRequest("no_target", f"{target} dropped: {reason}")
            return out + [fail] + self._end(reason, abort=False)
        return out + self._pump() + self._release_if_done() + self._settle_wan()

    def _end(self, reason: str, abort: bool = True) -> list[act.PrefillAction]:
        """The request is over before it shipped: every target still holding (or about to
        hold) something for it frees it, and so does P."""
        self.over = True
        out: list[act.PrefillAction] = [
            act.AbortTarget(name, reason)
            for name, t in self._t.items()
            if abort and t.state not in (F, D)
        ]
        return out + [act.ReleaseBlocks()] + self._settle_wan()

    def _release_if_done(self) -> list[act.PrefillAction]:
        if not self.over and self.shipped:
            self.over = True
            return [act.ReleaseBlocks()]
        return []

    def _settle_wan(self) -> list[act.PrefillAction]:
        """Once nothing more of the request's KV will cross to MD (MD acknowledged it, MD was
        dropped or refused, the request was cancelled or failed), its bytes leave P's WAN
        backlog."""
        main = self._t.get(MAIN)
        if self._wan_committed and (self.over or main is None or main.state in (F, D)):
            self._wan_committed = False
            return [act.ReleaseWan()]
        return []

    def _pump(self) -> list[act.PrefillAction]:
        if self.over:
            return []
        out: list[act.PrefillAction] = []
        for name, t in self._t.items():
            if t.state is not S:
                continue
            if self.num_computed > t.sent:
                out.append(act.Transfer(name, t.sent, self.num_computed))
                t.sent = self.num_computed
            if self.first_token is not None and t.sent == self.num_tokens:
                self._move(name, "queue_kv_done")
                out.append(act.SendKvDone(name, self.first_token))
        return out

    def _move(self, target: str, event: str) -> None:
        t = self._target(target)
        nxt = TARGET_TRANSITIONS.get((t.state, event))
        if nxt is None:
            raise IllegalTransition(f"{target}: {event} is not allowed when {t.state.value}")
        t.state = nxt

    def _target(self, target: str) -> _Target:
        t = self._t.get(target)
        if t is None:
            raise ValueError(f"{target!r} is not a target of this request ({', '.join(self._t)})")
        return t
