"""Replay by token ids on a decode tier (RLD or MD): the IO around lifecycle's ReplayRequest.

The router lost the daemon that was producing a request and replays it here (SUBMIT with the
tokens the client already has). The engine recomputes prompt + those tokens in one
prefill/extend and decodes on; what to emit and when it ends is ReplayRequest's.
"""

from __future__ import annotations

from pddnet.engine.engine import StepOutput
from pddnet.lifecycle.actions import EmitTokens, FinishRequest, StopSequence
from pddnet.lifecycle.replay_request import ReplayRequest
from pddnet.protocol import Submit

from .common import Daemon
from .ordering import Serial


class Replays:
    """The requests replayed on one decode daemon (RLD or MD), by request id."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self._live: dict[str, tuple[Submit, ReplayRequest]] = {}

    def __contains__(self, rid: object) -> bool:
        return rid in self._live

    def __len__(self) -> int:
        return len(self._live)

    def start(self, sub: Submit, serial: Serial | None = None) -> None:
        """``serial``: the request's own operation queue when this daemon still held it (the
        stop of its part goes first)."""
        d, rid = self.daemon, sub.request_id
        if rid in self._live:
            d.error(rid, "duplicate_request", f"request {rid!r} is already being replayed")
            return
        self._live[rid] = (sub, ReplayRequest(len(sub.prompt_token_ids), sub.stop_token_ids))
        d.counters["replays"] += 1
        d.timeline(rid, "replay_start", len(sub.output_token_ids), d.role)
        (serial or Serial(f"replay {rid}", d._tasks)).submit(lambda: self._start(sub))

    async def _start(self, sub: Submit) -> None:
        d, rid = self.daemon, sub.request_id
        entry = self._live.get(rid)
        if entry is None or entry[0] is not sub:
            return  # cancelled meanwhile
        try:
            await d.add_sequence(sub, output_token_ids=list(sub.output_token_ids))
        except ValueError as exc:
            self._live.pop(rid, None)
            d.error(rid, "replay_refused", f"{d.role} cannot replay the request: {exc}")
            return
        d.wake()

    def step(self, out: StepOutput) -> bool:
        """Engine output for a replayed request: emit, finish. False if `out` is not one."""
        entry = self._live.get(out.request_id)
        if entry is None:
            return False
        d, rid = self.daemon, out.request_id
        actions, logprobs = entry[1].engine_step(out)
        for a in actions:
            if isinstance(a, EmitTokens):
                d.emit_tokens(rid, a.index, a.token_ids, logprobs)
            elif isinstance(a, FinishRequest):
                del self._live[rid]
                d.ended.add(rid)
                d.request_done(rid, a.reason, entry[1].num_prompt_tokens, a.num_output_tokens)
            elif isinstance(a, StopSequence):
                d.spawn(d.compute(d.engine.abort, rid), "replay stop")
        return True

    def drop(self, rid: str) -> bool:
        """Cancel a replayed request (router CANCEL). False if it is not one."""
        if self._live.pop(rid, None) is None:
            return False
        d = self.daemon
        d.ended.add(rid)
        d.spawn(d.compute(d.engine.abort, rid), f"replay cancel {rid}")
        return True

    def failed(self, reason: str) -> None:
        """The engine step failed: fail the replayed requests too."""
        for rid in list(self._live):
            self._live.pop(rid)
            self.daemon.error(rid, "engine_failed", reason)
