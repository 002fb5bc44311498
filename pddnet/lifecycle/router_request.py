"""The router's view of one request, sans-IO: daemons' messages and clock events in, actions out.

One `RouterRequest` per choice of an HTTP request. Inputs: the daemons' messages about it
(`receive`), a lost daemon (`peer_lost`), the stall clock (`stalled`), the request timeout
(`time_out`); each takes the router's clock (`now`) and the connected daemons (`up`). Outputs:
actions for the shell (pddnet/roles/router.py, the actions in actions.py): `Replay`, `CancelAll`,
`TokenGaps`, `Stalled`.
Tokens are assembled by a `StreamAssembler`, the text (stop strings) by a `ChoiceText`, the `pdd`
object's figures by `Served`.

Carriers. The daemon producing the request is its owner (P until a decode tier holds its KV); a
lost owner means a replay by token ids elsewhere (once). Who carries it moves on the milestones
of `CARRIER_MOVES`; from RLD's handoff_start on MD carries it too (RLD may have cut before MD's
news reaches us). After a replay only its target carries the request: what the replaced attempt
still says (an error, a lost carrier) is stale, recorded on the timeline, not acted on. An error
from a decode tier about a request the other tier produces (MD failing its copy before the cut)
is, for that request, that tier's loss: recorded, and a replay only if it carries the request.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any

from pddnet.api.responses import LogprobEntry
from pddnet.api.types import CompletionRequest
from pddnet.lifecycle.actions import CancelAll, Replay, RouterAction, Stalled, TokenGaps
from pddnet.lifecycle.assembler import StreamAssembler
from pddnet.lifecycle.choice_text import ChoiceText
from pddnet.lifecycle.pdd_object import Event, Pdd, RouterFacts, Served, build_pdd
from pddnet.protocol import messages as m

DECODE_TIERS = ("relay", "main_decode")  # where a replay can go, in order of preference
REPORTER = "<reporter>"  # a carrier move to the daemon that reported the milestone


@dataclass(frozen=True)
class CarrierMove:
    """A milestone that moves the request to another carrier."""

    to: str | None  # the new owner (REPORTER: the daemon that reported it; None: unchanged)
    pipeline: str | None = None  # only on this pipeline
    while_owner: str | None = None  # only while this daemon owns it
    md_too: bool = False  # MD carries it too from here on


# Timeline milestone -> carrier move (only while no replay took the request elsewhere).
CARRIER_MOVES: dict[str, CarrierMove] = {
    # P's part is over and P forgets the request: the decode tier it handed the KV to carries it
    # (if that one dies before its own milestone, its loss must still replay the request).
    "rld_kv_sent": CarrierMove("relay", while_owner="prefill"),
    "wan_kv_acked": CarrierMove("main_decode", pipeline="p_md", while_owner="prefill"),
    # the decode tier that holds the KV
    "rld_kv_complete": CarrierMove(REPORTER),
    "md_kv_complete": CarrierMove(REPORTER, pipeline="p_md"),
    # RLD may cut from here on: MD carries it too
    "handoff_start": CarrierMove(None, md_too=True),
    "handoff_end": CarrierMove("main_decode"),
}


class RouterRequest:
    """One request (one choice) as the router sees it. See the module docstring."""

    def __init__(
        self,
        request_id: str,
        req: CompletionRequest,
        seed: int | None,
        assembler: StreamAssembler,
        text: ChoiceText,
        arrival: float,
        facts: RouterFacts,
        peers: Container[str],
        index: int = 0,
    ) -> None:
        self.request_id = request_id
        self.req = req
        self.seed = seed
        self.assembler = assembler
        self.text = text
        self.arrival = arrival
        self.facts = facts
        self.peers = peers  # the daemons this router has (whether connected or not)
        self.index = index  # the choice's index
        self.timeline: list[Event] = []
        self.served = Served()
        self.logprobs: dict[int, LogprobEntry] = {}  # by output index
        self.owner = "prefill"
        self.md_carries = False  # RLD began handing it to MD (it may have cut)
        self.replays = 0
        self.replay_target: str | None = None
        self.dropped: set[str] = set()  # decode tiers that failed their copy (not its producer)
        self.done_seen = False
        self.cancel_sent = False
        self.router_stopped = False  # a stop string ended it (the daemons don't know)
        self.stop_reason: int | str | None = None  # the stop string or stop token that ended it
        self.error_status = 500
        self.error_code: str | None = None
        self.last_change = arrival  # the stall clock restarts at every change
        self.last_release: float | None = None
        self._event("arrival", arrival, "router", len(req.prompt_token_ids))

    # -- what the shell reads ----------------------------------------------------------------------

    @property
    def finished(self) -> bool:
        return self.assembler.finished

    @property
    def failed(self) -> bool:
        return self.assembler.finish_reason == "error"

    def carriers(self) -> set[str]:
        """The daemons whose loss leaves the request with no producer: its owner (or replay
        target), and MD from the start of a handoff on."""
        if self.replay_target is not None:
            return {self.replay_target}
        return {self.owner, "main_decode"} if self.md_carries else {self.owner}

    @property
    def awaits_done_notice(self) -> bool:
        """The stream is complete and a REQUEST_DONE (with the last TIMELINEs) is still to come
        (not after a stop string: the daemons were cancelled, none comes)."""
        return (
            not self.done_seen
            and not self.router_stopped
            and self.assembler.finish_reason in ("eos", "stop", "length")
        )

    def pdd(self) -> Pdd:
        return build_pdd(
            self.facts, self.request_id, self.seed, self.arrival, self.served, self.assembler,
            self.replays, self.timeline,
        )  # fmt: skip

    # -- inputs ------------------------------------------------------------------------------------

    def receive(
        self, msg: m.Message, sender: str, now: float, up: Container[str]
    ) -> list[RouterAction]:
        """A message about this request from the daemon `sender` (its events lane)."""
        out: list[RouterAction] = []
        if isinstance(msg, m.TokenEvent):
            self._on_tokens(msg, now, out)
        elif isinstance(msg, m.RequestDone):
            self.done_seen = True
            self._event("request_done", msg.time, msg.producer, msg.reason)
            self.assembler.feed_done(msg.reason, msg.num_output_tokens, msg.producer)
        elif isinstance(msg, m.ErrorMessage):
            self._event("error", now, sender, f"{msg.code}: {msg.message}")
            if self.replay_target is not None and sender != self.replay_target:
                pass  # about the lost attempt: the replay elsewhere carries the request now
            elif sender in DECODE_TIERS and sender != self.owner and self.owner in DECODE_TIERS:
                self._copy_failed(sender, msg, now, up, out)
            elif not (
                msg.code.endswith("_lost")
                and self._replay(msg.code[:-5], msg.message, now, up, out)
            ):
                self.fail(sender, msg.code, msg.message)
        elif isinstance(msg, m.Timeline):
            self._on_timeline(msg, sender, now, up, out)
        elif isinstance(msg, m.PipelineChoice):
            self._event("pipeline", msg.time, "prefill", msg.pipeline)
            self.served.pipeline = msg.pipeline
            self.served.decision = msg
        elif isinstance(msg, m.PipelineChange):
            self._event("pipeline_change", msg.time, "prefill", msg.pipeline)
            self.served.pipeline = msg.pipeline
            self.served.changes.append(msg)
        self.last_change = now
        return out

    def peer_lost(self, role: str, why: str, now: float, up: Container[str]) -> list[RouterAction]:
        """The events lane to `role` is gone (dead, hung past the heartbeat deadline, cut off):
        replay the request elsewhere if `role` carried it, else fail it."""
        out: list[RouterAction] = []
        if not self.finished and role in self.carriers():
            self._replay_or_fail(role, f"lost the connection to {role}: {why}", now, up, out)
        return out

    def stalled(self, now: float, stall_s: float, up: Container[str]) -> list[RouterAction]:
        """The stall clock: nothing said about the request for `stall_s`. Replayed by token ids
        (once), elsewhere than its silent carrier if possible, else wherever is live."""
        if self.finished or now - self.last_change < stall_s:
            return []
        self.last_change = now
        if self.replays:
            return []
        why = f"no progress for {stall_s:g} s (last carried by {self.owner})"
        out: list[RouterAction] = [Stalled(why)]
        if not self._replay(self.owner, why, now, up, out):
            self._replay("none", why, now, up, out)
        return out

    def replay_failed(self, replay: Replay, error: str) -> None:
        """The shell could not send a `Replay`."""
        self.fail(
            "router",
            f"{replay.lost}_lost",
            f"{replay.why}; replay on {replay.target} failed: {error}",
        )

    def time_out(self, timeout_s: float) -> None:
        if not self.finished:
            self.error_code, self.error_status = "timeout", 504
            self.assembler.fail(f"no completion within {timeout_s:g} s")

    def fail(self, who: str, code: str, message: str) -> None:
        self.error_code = code
        unavailable = "overload" in code or "capacity" in code or code.endswith("_lost")
        self.error_status = 503 if unavailable else 500
        self.assembler.fail(f"{who}: {code}: {message}")

    def submit(self, **extra: Any) -> m.Submit:
        """The request's SUBMIT: its prompt, seed and sampling fields, plus ``extra`` (P's names
        the handoff mode; a replay's carries the output tokens known so far)."""
        return m.Submit(
            request_id=self.request_id,
            prompt_token_ids=self.req.prompt_token_ids,
            seed=self.seed,
            **self.req.sampling_fields(),
            **extra,
        )

    def cancel_all(self, reason: str) -> CancelAll:
        """The router tells every daemon to drop the request (client gone, a choice failed, the
        stream ended without their word)."""
        self.cancel_sent = True
        return CancelAll(self.request_id, reason[:4096])

    def finish(self, now: float) -> None:
        """The stream ended and the shell waited for the daemons' last word: settle the text
        (held-back text may complete a stop string), the stop reason and the warnings."""
        asm = self.assembler
        if asm.finish_reason not in ("error", "cancel") and self.text.finish():
            self.router_stopped, self.stop_reason = True, self.text.stopped
            asm.finish_reason = "stop"
        if (
            asm.finish_reason == "stop"
            and self.stop_reason is None
            and asm.tokens
            and asm.tokens[-1] in self.req.stop_token_ids
        ):
            self.stop_reason = asm.tokens[-1]
        missing = [i for i in range(len(asm.tokens)) if i not in self.logprobs]
        if self.req.logprobs is not None and missing:
            asm.warnings.append(
                f"no logprobs came for {len(missing)} token(s), first index {missing[0]}"
            )
        self._event("done", now, "router", asm.finish_reason)

    # -- transitions -------------------------------------------------------------------------------

    def _event(self, event: str, t: float, producer: str, detail: Any = None) -> None:
        self.timeline.append(Event(event, t, producer, detail))

    def _on_tokens(self, msg: m.TokenEvent, now: float, out: list[RouterAction]) -> None:
        if self.replay_target is None or msg.producer == self.replay_target:
            self.owner = msg.producer
        if msg.logprobs:
            k = len(msg.top_logprob_ids) // len(msg.token_ids)
            for j, lp in enumerate(msg.logprobs):
                self.logprobs.setdefault(
                    msg.index + j,
                    (
                        lp,
                        msg.top_logprob_ids[j * k : (j + 1) * k],
                        msg.top_logprobs[j * k : (j + 1) * k],
                    ),
                )
        asm = self.assembler
        was = len(asm.tokens)
        released = asm.feed_tokens(msg.index, msg.token_ids, msg.producer, now)
        if released is not None:
            if self.last_release is not None:
                # what the client sees: one gap per release, then tokens that came with it
                gaps = [now - self.last_release] + [0.0] * (len(released.token_ids) - 1)
                out.append(TokenGaps(tuple(g / self.facts.dilation for g in gaps)))
            self.last_release = now
            self._text_released(released.start, released.token_ids, now, out)
        if was == 0 and asm.tokens:
            self._event("first_token", now, "router", asm.producers[0])
        if asm.error:
            self.error_code = "stream_inconsistent"

    def _text_released(
        self, start: int, token_ids: list[int], now: float, out: list[RouterAction]
    ) -> None:
        """Tokens released in order: their text. A stop string ends the choice here, at the
        token that completed it; the daemons, which do not know stop strings, are told to stop
        (CANCEL to all, as for a client that went away: each frees what it holds)."""
        keep = self.text.feed(token_ids)
        if keep is None:
            return
        self.assembler.stop_at(start + keep)
        self.router_stopped = True
        self.stop_reason = self.text.stopped
        self._event("stop_string", now, "router", self.text.stopped)
        out.append(self.cancel_all("stop string"))

    def _on_timeline(
        self, msg: m.Timeline, sender: str, now: float, up: Container[str], out: list[RouterAction]
    ) -> None:
        number, label = msg.detail_int, msg.detail_str
        detail: Any = (
            {"value": number, "label": label} if label and number is not None else label or number
        )
        self._event(msg.event, msg.time, msg.producer or sender, detail)
        move = CARRIER_MOVES.get(msg.event)
        if self.replay_target is None and move is not None:
            before = self.carriers()
            self._move(move, msg.producer or sender)
            self._replay_if_a_new_carrier_is_gone(self.carriers() - before, msg.event, now, up, out)
        self.served.record(msg.event, number, label)

    def _move(self, move: CarrierMove, reporter: str) -> None:
        if move.pipeline is not None and self.served.pipeline != move.pipeline:
            return
        if move.while_owner is not None and self.owner != move.while_owner:
            return
        if move.to is not None:
            self.owner = reporter if move.to == REPORTER else move.to
        self.md_carries = self.md_carries or move.md_too

    def _copy_failed(
        self,
        sender: str,
        msg: m.ErrorMessage,
        now: float,
        up: Container[str],
        out: list[RouterAction],
    ) -> None:
        """A decode tier failed its copy of a request the other tier produces (MD before the
        cut, RLD past it): for this request, as if that tier were lost. A carrier's (MD from
        RLD's handoff_start on: RLD may have cut) is replayed elsewhere, or fails the request;
        another's changes nothing (the producer goes on), until it becomes a carrier."""
        self.dropped.add(sender)
        if self.finished or sender not in self.carriers():
            return
        why = f"{sender} failed it: {msg.code}: {msg.message}"
        if not self._replay(sender, why, now, up, out):
            self.fail(sender, msg.code, msg.message)

    def _replay_if_a_new_carrier_is_gone(
        self, new: set[str], event: str, now: float, up: Container[str], out: list[RouterAction]
    ) -> None:
        """The request just gained carriers (`new`): one whose loss (or failure of its copy)
        reached us before this news was not replayed then; replay now, not at the stall
        timer."""
        gone = [r for r in sorted(new) if r in self.peers and (r not in up or r in self.dropped)]
        if gone and not self.finished:
            how = "failed it" if gone[0] in self.dropped else "was lost"
            why = f"{gone[0]} {how} before its {event} reached the router"
            self._replay_or_fail(gone[0], why, now, up, out)

    def _replay_or_fail(
        self, lost: str, why: str, now: float, up: Container[str], out: list[RouterAction]
    ) -> None:
        if not self._replay(lost, why, now, up, out):
            self.fail("router", f"{lost}_lost", why)

    def _replay(
        self, lost: str, why: str, now: float, up: Container[str], out: list[RouterAction]
    ) -> bool:
        """Replay the request by token ids on a live decode tier other than `lost`: prompt +
        the tokens the client already has, recomputed there by one prefill, decoding on from
        the next index. Once per request. False when no tier can take it."""
        asm = self.assembler
        if asm.finished or self.replays >= 1:
            return False
        targets = [r for r in DECODE_TIERS if r in self.peers and r != lost and r in up]
        if not targets:
            return False
        target = targets[0]
        known = tuple(asm.tokens)
        self.replays += 1
        self.replay_target = self.owner = target
        # The attempt replaced may still be alive (a stall, not a loss) and go on producing:
        # the same tokens (sampling is a pure function of seed and position), so an index
        # delivered twice is no longer a broken cut; a *different* token is still a conflict.
        asm.strict = False
        self._event(
            "replay",
            now,
            "router",
            f"{lost} lost ({why[:200]}): replayed on {target} from index {len(known)}",
        )
        out.append(Replay(target, self.submit(output_token_ids=known), lost, why))
        return True
