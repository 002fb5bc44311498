"""The simulator's handoff against the daemons' handoff machines, on random traces.

The simulator cannot call RelayHandoff / MainHandoff (they take a call per token and keep the
ids; see pddnet/sim/handoff.py), so it follows their rules on counts. Here one request's handoff
runs twice on the same timeline (integer ticks: RLD's tokens every `rld_step`, MD's KV complete
at `kv_at`, every message `delay` ticks on the way, MD's steps `md_step` long, taken as soon as
it has work): once through the machines, with MD's engine as the scheduler plays it (a held
sequence leaves its last token uncomputed; a step takes at most the chunk cap and samples when
it computes the last known token unheld), once through the simulator's rules (sim/handoff.py)
played as SimulatedSystem and DecodeInstance play them. Both record the mode, who ends the
request, the cut position, the HANDOFFs leaving (per burst: the moment, the ids, final), the
TAKEOVERs and the tokens MD computes per step, and must agree; where the simulator's model is
coarser (the module docstring of sim/handoff.py), the tests pin the difference exactly.
"""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from pddnet.lifecycle import actions as act
from pddnet.lifecycle import handoff as fsm
from pddnet.policy.handoff import HandoffMode, HandoffPolicy
from pddnet.sim.handoff import (
    TAKEOVER_CUT,
    TAKEOVER_PARK,
    first_cut,
    md_extend_chunk,
    takeover_step,
)

# same-tick order: RLD's token first (the simulator counts a step ending at t as made by t),
# then MD's step end, then a message's arrival, then MD's next step starts (with every message
# of the moment applied: a burst of HANDOFFs lands in one read)
RLD_TOKEN, MD_STEP, ARRIVAL, MD_START = 0, 1, 2, 3


def tok(index: int) -> int:
    return 1000 + index


@dataclass(frozen=True)
class Trace:
    policy: HandoffPolicy
    rld_load: float
    prompt: int
    output: int  # tokens of the request (RLD finishes it when it gets there first)
    rld_start: int  # tick of P's first token on RLD
    rld_step: int
    kv_at: int  # tick MD's copy completes (its first TAKEOVER leaves)
    delay: int
    md_step: int


@dataclass
class Record:
    mode: str | None = None
    ended_by: str = ""  # "rld" (RLD produced every token) or "md"
    cut: int = -1  # the first index MD emits
    first_md_tick: int = -1
    bursts: list[tuple[int, int, bool]] = field(default_factory=list)  # (tick, ids, final)
    messages: list[int] = field(default_factory=list)  # HANDOFF messages per burst
    takeovers: int = 0
    md_steps: list[int] = field(default_factory=list)  # tokens MD computed per step


class Clock:
    def __init__(self) -> None:
        self.q: list[tuple[int, int, int, Callable[..., object], tuple[Any, ...]]] = []
        self.seq = itertools.count()
        self.now = 0

    def at(self, tick: int, order: int, fn: Callable[..., object], *args: Any) -> None:
        heapq.heappush(self.q, (tick, order, next(self.seq), fn, args))

    def run(self) -> None:
        while self.q:
            self.now, _, _, fn, args = heapq.heappop(self.q)
            fn(*args)


def random_trace(rng: random.Random) -> Trace:
    mode = rng.choice(list(HandoffMode))
    policy = HandoffPolicy(mode, rng.randint(0, 100), rng.randint(1, 24), 0.8)
    return Trace(
        policy,
        rng.choice([0.2, 0.95]),
        rng.randint(4, 64),
        rng.randint(2, 300),
        rng.randint(0, 300),
        rng.randint(2, 12),
        rng.randint(0, 700),
        rng.randint(1, 80),
        rng.randint(2, 15),
    )


# -- the machines ---------------------------------------------------------------------------------


def through_machines(tr: Trace) -> Record:
    rec, clock = Record(), Clock()
    relay = fsm.RelayHandoff(tr.prompt, tr.policy)
    main = fsm.MainHandoff(tr.prompt, tr.policy.chunk)
    md: dict[str, Any] = {"computed": tr.prompt, "held": True, "cap": None, "busy": False}
    rld_stopped = [False]

    def rld_apply(actions: list[Any]) -> None:
        sends = [a for a in actions if isinstance(a, act.SendHandoff)]
        if sends:
            ids = sum(len(a.token_ids) for a in sends)
            rec.bursts.append((clock.now, ids, sends[-1].final))
            rec.messages.append(len(sends))
            if sends[-1].final:
                rec.cut = relay.num_tokens
        for a in actions:
            if isinstance(a, act.SendHandoff):
                rec.mode = a.mode
                clock.at(clock.now + tr.delay, ARRIVAL, md_handoff, a)
            elif isinstance(a, act.FinishRequest):
                rec.ended_by = "rld"
            elif isinstance(a, act.CancelPeer):
                clock.at(clock.now + tr.delay, ARRIVAL, main.cancel)
            elif isinstance(a, act.StopSequence):
                rld_stopped[0] = True

    def rld_token(index: int) -> None:
        if rld_stopped[0]:
            return
        last = index == tr.output - 1
        rld_apply(relay.rld_token(index, tok(index), "length" if last else None))
        if not last:
            clock.at(clock.now + tr.rld_step, RLD_TOKEN, rld_token, index + 1)

    def takeover_at_rld(t: act.SendTakeover) -> None:
        if relay.phase.value in ("decoding", "streaming"):
            rec.takeovers += 1  # one RLD acts on (not one crossing RLD's end or cut)
        rld_apply(relay.takeover(t.ready_position, t.chunk_tokens, tr.rld_load))

    def md_apply(actions: list[Any]) -> None:
        for a in actions:
            if isinstance(a, act.SendTakeover):
                clock.at(clock.now + tr.delay, ARRIVAL, takeover_at_rld, a)
            elif isinstance(a, act.SetChunk):
                md["cap"] = a.max_chunk_tokens
            elif isinstance(a, act.ReleaseHold):
                md["held"] = False
            elif isinstance(a, act.AppendTokens):
                pass  # main.known holds them
        clock.at(clock.now, MD_START, md_maybe_step)

    def pending() -> int:
        target = tr.prompt + len(main.known) - (1 if md["held"] else 0)
        return target - md["computed"]

    def md_maybe_step() -> None:
        if md["busy"] or not main.known or main.phase.value == "done":
            return
        n = pending()
        if n <= 0:
            return
        if md["cap"] is not None:
            n = min(n, md["cap"])
        sample = not md["held"] and md["computed"] + n == tr.prompt + len(main.known)
        md["busy"] = True
        clock.at(clock.now + tr.md_step, MD_STEP, md_step_end, n, sample)

    def md_step_end(n: int, sample: bool) -> None:
        md["busy"] = False
        if main.phase.value == "done":
            return
        md["computed"] += n
        rec.md_steps.append(n)
        index = len(main.known)
        new = [tok(index)] if sample else []
        md_apply(main.md_step(md["computed"], index, new))
        if sample:
            assert main.next_index == rec.cut  # MD emits from RLD's cut
            rec.ended_by, rec.first_md_tick = "md", clock.now
            main.cancel()  # the trace ends at MD's first token

    def md_handoff(a: act.SendHandoff) -> None:
        md_apply(main.handoff(a.start_index, a.token_ids, a.final, a.mode))

    clock.at(tr.rld_start, RLD_TOKEN, rld_token, 0)

    def kv_complete() -> None:
        if main.phase.value != "done":  # (RLD's cancel came first: MD dropped the request)
            md_apply(main.kv_complete(tok(0)))

    clock.at(tr.kv_at, ARRIVAL, kv_complete)
    clock.run()
    return rec


# -- the simulator's rules, played as SimulatedSystem and DecodeInstance play them ----------------


def through_simulator(tr: Trace) -> Record:
    rec, clock = Record(), Clock()
    policy = tr.policy
    rld: dict[str, Any] = {"started": False, "mode": None, "sent": 0, "pending": False}
    rld["done"] = False
    ext: dict[str, Any] = {"left": 0, "chunk": 0, "final": False, "busy": False, "over": False}

    def made(now: int) -> int:  # RLD's tokens by `now` (DecodeInstance.tokens_made + P's first)
        if now < tr.rld_start:
            return 0
        return min(tr.output, 1 + (now - tr.rld_start) // tr.rld_step)

    def send(ids: int, final: bool) -> None:  # one WAN message per HANDOFF burst
        rec.bursts.append((clock.now, ids, final))
        rec.messages.append(1)
        clock.at(clock.now + tr.delay, ARRIVAL, md_handoff, ids, final)

    def rld_start() -> None:  # _rld_start
        rld["started"] = True
        if rld["pending"]:
            rld_takeover()

    def rld_finished() -> None:  # _rld_finished: RLD's member made its last token
        if not rld["done"]:
            rld["done"] = True
            rld_ends()

    def rld_ends() -> None:  # RLD made every token: _finish, and MD's cancel (_cancel_md)
        rec.ended_by = "rld"
        clock.at(clock.now + tr.delay, ARRIVAL, ext.__setitem__, "over", True)

    def takeover_arrives() -> None:
        if not rld["done"]:
            rec.takeovers += 1  # one RLD acts on (not one crossing RLD's end or cut)
        rld_takeover()

    def rld_takeover() -> None:  # _rld_takeover
        if rld["done"]:
            return
        step = takeover_step(rld["started"], rld["mode"])
        if step == TAKEOVER_PARK:
            rld["pending"] = True
            return
        if step == TAKEOVER_CUT:
            rld_cut()
            return
        backlog = made(clock.now)
        mode, cut_now = first_cut(policy, backlog, tr.rld_load)
        rld["mode"] = mode
        rec.mode = mode.value
        if cut_now:
            rld_cut()
        else:
            rld["sent"] = backlog
            send(backlog, False)

    def rld_cut() -> None:  # _rld_cut + _rld_left
        tokens = made(clock.now)
        rld["done"] = True
        if tokens >= tr.output:  # its last token ends now: RLD's whole reply
            rld_ends()
            return
        send(tokens - rld["sent"], True)
        rec.cut = tokens

    def md_handoff(ids: int, final: bool) -> None:  # _md_handoff + DecodeInstance.extend
        if ext["over"]:
            return
        chunk = md_extend_chunk(rld["mode"], ids, policy.chunk)
        if ids <= 0 and final and ext["left"] <= 0:
            ext["final"], ext["ordinary"] = True, True  # an ordinary decode step
        else:
            ext["left"] += ids
            ext["chunk"] = max(1, chunk)
            ext["final"] = final
        md_maybe_step()

    def md_maybe_step() -> None:
        if ext["busy"] or ext["over"]:
            return
        if ext.pop("ordinary", False):
            n, last = 1, True
        elif ext["left"] > 0:
            n = min(ext["chunk"], ext["left"])
            last = n == ext["left"]
        else:
            return
        ext["busy"] = True
        clock.at(clock.now + tr.md_step, MD_STEP, md_step_end, n, last, ext["final"])

    def md_step_end(n: int, last: bool, final: bool) -> None:
        ext["busy"] = False
        if ext["over"]:
            return
        rec.md_steps.append(n)
        if n <= ext["left"]:
            ext["left"] -= n
        if not last:
            md_maybe_step()
        elif final:  # the extend step sampled MD's first token
            rec.ended_by, rec.first_md_tick = "md", clock.now
            ext["over"] = True
        else:  # _md_digested: MD's progress TAKEOVER
            clock.at(clock.now + tr.delay, ARRIVAL, takeover_arrives)
            md_maybe_step()

    def kv_complete() -> None:  # _kv_at_md: the first TAKEOVER
        if ext["over"]:
            return
        clock.at(clock.now + tr.delay, ARRIVAL, takeover_arrives)

    clock.at(tr.rld_start, RLD_TOKEN, rld_start)
    clock.at(tr.rld_start + (tr.output - 1) * tr.rld_step, RLD_TOKEN, rld_finished)
    clock.at(tr.kv_at, ARRIVAL, kv_complete)
    clock.run()
    return rec


# -- the comparison -------------------------------------------------------------------------------

TRACES = 3000


def split(tokens: int, chunk: int) -> list[int]:
    """Steps of at most ``chunk`` tokens that compute ``tokens``."""
    return [min(chunk, tokens - s) for s in range(0, tokens, chunk)]


def pieces(ids: int, chunk: int) -> int:
    """RelayHandoff's HANDOFF messages for a streaming burst of ``ids`` tokens (at least one)."""
    return max(1, -(-ids // chunk))


@pytest.fixture(scope="module")
def runs() -> list[tuple[Trace, Record, Record]]:
    rng = random.Random(25)
    out = []
    for _ in range(TRACES):
        tr = random_trace(rng)
        out.append((tr, through_machines(tr), through_simulator(tr)))
    return out


def streamed(rec: Record) -> bool:
    return any(not final for _, _, final in rec.bursts)


def forwarded(rec: Record) -> bool:
    return sum(not final for _, _, final in rec.bursts) > 1


def test_handoffs_without_streaming_agree_exactly(runs):
    """One-shot cuts, streaming cuts made at once (MD within one step of RLD), TAKEOVERs parked
    until RLD's first token, requests RLD finishes before or at the cut: every transition the
    same, in the same tick."""
    seen = {"one-shot by MD": 0, "streaming at once": 0, "parked": 0, "RLD finished": 0}
    for tr, machines, sim in runs:
        if streamed(machines) or streamed(sim):
            continue
        assert machines == sim, tr
        if machines.mode == "one-shot" and machines.ended_by == "md":
            seen["one-shot by MD"] += 1
        if machines.mode == "streaming":
            assert machines.bursts == [(machines.bursts[0][0], machines.cut, True)]
            assert machines.md_steps == [machines.cut]  # within one extend step
            seen["streaming at once"] += 1
        if tr.kv_at + tr.delay < tr.rld_start:
            seen["parked"] += 1
        if machines.ended_by == "rld":
            seen["RLD finished"] += 1
    assert min(seen.values()) >= 20, seen


def test_streaming_agrees_but_for_the_held_token_and_the_pieces(runs):
    """A streaming handoff RLD did not forward more tokens during: the same mode, backlog,
    TAKEOVERs, and, whenever MD digests the backlog in as many steps either way, the same cut at
    the same tick. MD's steps differ only by the held token (the machine computes it after the
    cut, the simulator before) and RLD's bursts only by their pieces (sim/handoff.py)."""
    compared = 0
    for tr, machines, sim in runs:
        if not streamed(machines) or forwarded(machines):
            continue
        c = tr.policy.chunk
        assert machines.mode == sim.mode == "streaming"
        assert machines.bursts[0] == sim.bursts[0], tr
        backlog = machines.bursts[0][1]
        assert backlog > c  # else the cut is at once
        assert machines.ended_by == sim.ended_by, tr
        assert sim.messages == [1] * len(sim.bursts)
        assert machines.messages == [pieces(ids, c) for _, ids, _ in machines.bursts]
        if machines.ended_by == "rld":
            continue
        assert machines.takeovers == sim.takeovers == 2
        (_, k_machine, _), (_, k_sim, _) = machines.bursts[1], sim.bursts[1]
        assert machines.md_steps == split(backlog - 1, c) + split(k_machine + 1, c), tr
        assert sim.md_steps == split(backlog, c) + (split(k_sim, c) or [1]), tr
        if len(split(backlog - 1, c)) == len(split(backlog, c)):  # MD reports at one tick
            assert machines.bursts == sim.bursts and machines.cut == sim.cut, tr
            extra = len(split(k_machine + 1, c)) - len(split(k_sim, c) or [1])
            assert machines.first_md_tick == sim.first_md_tick + extra * tr.md_step, tr
            compared += 1
    assert compared >= 100, compared


def test_only_the_machine_forwards_while_streaming(runs):
    """RelayHandoff forwards each further `chunk` of tokens while MD digests (one HANDOFF of
    exactly `chunk` ids each); the simulator sends none until the cut. The rest agrees: the
    mode, the backlog and the moment it leaves."""
    seen = 0
    for tr, machines, sim in runs:
        if not forwarded(machines):
            continue
        seen += 1
        assert machines.mode == sim.mode == "streaming"
        assert machines.bursts[0] == sim.bursts[0], tr
        middle = machines.bursts[1:-1] if machines.bursts[-1][2] else machines.bursts[1:]
        assert middle and all(ids == tr.policy.chunk and not final for _, ids, final in middle)
        assert not forwarded(sim) and len(sim.bursts) <= 2
    assert seen >= 100, seen
