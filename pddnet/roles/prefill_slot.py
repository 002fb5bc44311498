"""The prefill daemon's side of one request: its machine (pddnet.lifecycle.prefill_request), the
Serials its operations run on (one per target, one for the engine), its KV transfers, and the
operations on its engine sequence -- start the prefill, send KV_DONE, free the blocks."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pddnet.engine.engine import Engine
from pddnet.engine.sampling import TokenLogprob
from pddnet.lifecycle.actions import PrefillAction, SendKvDone
from pddnet.lifecycle.prefill_messages import kv_done
from pddnet.lifecycle.prefill_request import PrefillRequest, TargetState
from pddnet.protocol import Submit

from .ordering import Serial
from .peer import Peer
from .prefill_transfers import RequestKV
from .to_router import now


class PrefillHost(Protocol):
    """What a request's operations need from the prefill daemon."""

    engine: Engine | None
    control: dict[str, Peer]

    async def compute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any: ...
    async def add_sequence(self, req: Any, **options: Any) -> None: ...
    def wake(self) -> None: ...
    def timeline(
        self, rid: str, event: str, detail_int: int | None = None, detail_str: str = ""
    ) -> None: ...
    def run(self, req: PrefillSlot, actions: list[PrefillAction]) -> None: ...


@dataclass
class PrefillSlot:
    """The prefill daemon's side of one request: its machine and the IO the machine does not
    see (the Serials its operations run on, its KV transfers, its engine sequence)."""

    submit: Submit
    machine: PrefillRequest
    serial: dict[str, Serial]  # per target, plus "engine"
    kv: RequestKV
    started: bool = False  # add_request sent to the engine
    first_logprob: TokenLogprob | None = None  # index 0's, when the request asks for them

    async def start_prefill(self, host: PrefillHost) -> None:
        """Add the request to P's engine: prefill only (one token), keeping its blocks."""
        sub = self.submit
        if self.machine.over:
            return
        # Set before the call: the engine may step (and fail) before this coroutine resumes.
        self.started = True
        try:
            await host.add_sequence(sub, max_tokens=1, ignore_eos=True, keep_blocks=True)
        except ValueError as exc:
            self.started = False
            host.run(self, self.machine.fail("bad_request", f"prefill refused: {exc}"))
            return
        n, pipeline = len(sub.prompt_token_ids), self.machine.pipeline.wire
        host.timeline(sub.request_id, "prefill_start", n, pipeline)
        host.wake()

    async def send_kv_done(self, host: PrefillHost, a: SendKvDone) -> None:
        """KV_DONE to ``a.target`` once all of its KV is out (the machine queued it)."""
        m = self.machine
        if m.over or m.state(a.target) is not TargetState.DONE_QUEUED:
            return
        c = self.kv.completion(a.target)  # None: all of it was cached there
        chunks, nbytes = (c.num_chunks, c.num_bytes) if c else (0, 0)
        rid, n = self.submit.request_id, m.num_tokens
        done = kv_done(rid, n, chunks, nbytes, a.first_token, self.first_logprob, now())
        host.control[a.target].post(done)
        host.run(self, m.kv_done_out(a.target, done.num_bytes))

    async def free(self, host: PrefillHost) -> None:
        """Give P's blocks back once no export reads them (or stop the prefill)."""
        await self.kv.idle()  # an export may still read the blocks
        if self.started:
            await host.compute(
                host.engine.abort, self.submit.request_id
            )  # frees kept blocks or stops prefill
