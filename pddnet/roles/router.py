"""The router: OpenAI-compatible HTTP in front of the PDD daemons (datacenter A).

It dials P, RLD and MD on the "events" lane (pddnet/roles/event_lanes.py: one `Peer` each,
heartbeats, redial), sends SUBMIT to P and CANCEL to all, and receives TOKEN_EVENT / TIMELINE /
REQUEST_DONE / ERROR / PIPELINE_* back. This file is the shell: each message goes to its request's
machine (pddnet/lifecycle/router_request.py: owners, replays, assembling, the `pdd` object) and
the machine's actions come out here (a replay's SUBMIT, CANCELs, metrics). The HTTP front is
pddnet/roles/http_api.py; answering one completion (whole or SSE) pddnet/roles/completion.py;
both see the router only through pddnet/roles/router_face.py's `RouterFace`.

Which daemons a mode needs: pdd -> P, RLD, MD; same-dc -> P and the decode instance in A (a relay
role); cross-dc -> P and MD.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from pddnet.api.types import CompletionRequest
from pddnet.config import ClusterConfig, ClusterMode
from pddnet.device.dilation import real_kv_bytes_per_token, wallclock
from pddnet.lifecycle.actions import CancelAll, Replay, RouterAction, Stalled, TokenGaps
from pddnet.lifecycle.assembler import StreamAssembler
from pddnet.lifecycle.choice_text import ChoiceText
from pddnet.lifecycle.pdd_object import RouterFacts
from pddnet.lifecycle.router_request import RouterRequest
from pddnet.obs.metrics import RouterMetrics
from pddnet.protocol import messages as m
from pddnet.roles.event_lanes import EventLanes
from pddnet.roles.http_api import HttpFront, model_info_and_tokenizer

log = logging.getLogger("pddnet.router")

PEERS_BY_MODE: dict[ClusterMode, tuple[str, ...]] = {
    ClusterMode.PDD: ("prefill", "relay", "main_decode"),
    ClusterMode.SAME_DC: ("prefill", "relay"),
    ClusterMode.CROSS_DC: ("prefill", "main_decode"),
}
DEFAULT_PIPELINE = {
    ClusterMode.PDD: "p_rld_md",
    ClusterMode.SAME_DC: "same_dc",
    ClusterMode.CROSS_DC: "p_md",
}

COUNTERS = (
    "requests",
    "completed",
    "errors",
    "cancelled",
    "rejected_overload",
    "bad_requests",
    "unknown_request_events",
    "tokens",
)


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed of an n > 1 request (pddnet.engine.sampling.choice_seed: the
    router stays torch-free, so the one-line rule is repeated here and tested equal)."""
    return (seed + index) % (1 << 64)


class Router:
    """`Router(config)`: `await start()`, then HTTP on config.router.host:port (`.port`)."""

    def __init__(self, config: ClusterConfig, clock: Callable[[], float] = time.time) -> None:
        config.validate()
        emulation = config.emulation()  # reported times are the modelled world's (/ k)
        self.dilation = emulation.dilation if emulation else 1.0
        self.facts = RouterFacts(
            mode=config.mode.value,
            default_pipeline=DEFAULT_PIPELINE[config.mode],
            dilation=self.dilation,
            wire_scale=(
                emulation.wire_scale(real_kv_bytes_per_token(config.model)) if emulation else 1.0
            ),
            emulation=emulation.describe() if emulation else None,
        )
        self.config = config = wallclock(config)
        self.clock = clock
        self.instance_id = f"router-{uuid.uuid4().hex[:8]}"
        self.requests: dict[str, RouterRequest] = {}
        self.counters: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self.tokens_by_producer: dict[str, int] = {}
        self.metrics = RouterMetrics()
        self.lanes = EventLanes(
            config,
            PEERS_BY_MODE[config.mode],
            self.instance_id,
            self._on_message,
            self._on_lost,
            self._spawn,
            self.counters,
        )
        self.peers = self.lanes.peers
        self._wakers: dict[str, asyncio.Event] = {}  # request id -> its HTTP request's event
        self._tasks: set[asyncio.Task] = set()
        self._stop = asyncio.Event()
        # The served model, without weights: the router's own (admit, stats), and its HTTP front's
        self.model, self.tokenizer = model_info_and_tokenizer(config.model.name)
        self.http = HttpFront(self)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        self.lanes.start()
        await self.http.start()

    @property
    def port(self) -> int | None:
        return self.http.port

    @property
    def url(self) -> str:
        return f"http://{self.config.router.host}:{self.port}"

    async def wait_connected(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(asyncio.gather(*(p.up.wait() for p in self.peers.values())), timeout)

    async def serve_forever(self) -> None:
        await self._stop.wait()

    async def close(self) -> None:
        self._stop.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for state in list(self.requests.values()):
            state.assembler.fail("the router is shutting down")
            self._wake(state)
        await self.http.close()
        await self.lanes.close()

    def stats(self) -> dict[str, Any]:
        return {
            "role": "router",
            "instance_id": self.instance_id,
            "mode": self.config.mode.value,
            "model": self.model.name,
            "port": self.port,
            "active_requests": len(self.requests),
            **self.counters,
            "tokens_by_producer": dict(self.tokens_by_producer),
            "peers": self.lanes.stats(),
        }

    # -- the daemons' events lanes ----------------------------------------------------------------

    async def _on_message(self, role: str, msg: m.Message) -> None:
        rid = getattr(msg, "request_id", None)
        state = self.requests.get(rid) if rid is not None else None
        if state is None:
            if isinstance(msg, m.ErrorMessage):
                log.warning("%s: error %s: %s", role, msg.code, msg.message)
            elif rid is not None:
                self.counters["unknown_request_events"] += 1
            return
        await self.apply(state, state.receive(msg, role, self.clock(), self.lanes.connected()))

    def _on_lost(self, role: str, why: str) -> None:
        """A daemon's events lane is gone (dead, hung past the heartbeat deadline, cut off):
        the requests it carried are replayed elsewhere; the others go on (a daemon that
        depended on it reports those itself)."""
        now, up = self.clock(), self.lanes.connected()
        for state in list(self.requests.values()):
            actions = state.peer_lost(role, why, now, up)
            self._wake(state)
            if actions:
                self._spawn(self.apply(state, actions), f"replay {state.request_id}")

    async def apply(self, state: RouterRequest, actions: list[RouterAction]) -> None:
        """Carry out a machine's actions, then wake whoever waits for the request."""
        for action in actions:
            if isinstance(action, Replay):
                self.counters["replays"] = self.counters.get("replays", 0) + 1
                try:
                    await self.lanes.send(action.target, action.submit)
                except Exception as exc:
                    state.replay_failed(action, str(exc))
            elif isinstance(action, CancelAll):
                self._spawn(self._cancel(action), f"cancel {state.request_id}")
            elif isinstance(action, TokenGaps):
                self.metrics.observe_gaps(action.gaps)
            elif isinstance(action, Stalled):
                self.counters["stalls"] = self.counters.get("stalls", 0) + 1
                self.metrics.stall_replays.inc()
        self._wake(state)

    async def cancel(self, state: RouterRequest, reason: str) -> None:
        await self._cancel(state.cancel_all(reason))

    async def _cancel(self, action: CancelAll) -> None:
        for role in self.peers:
            with contextlib.suppress(Exception):
                await self.lanes.send(
                    role, m.Cancel(request_id=action.request_id, reason=action.reason)
                )

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _wake(self, state: RouterRequest) -> None:
        waker = self._wakers.get(state.request_id)
        if waker is not None:
            waker.set()

    # -- requests ---------------------------------------------------------------------------------

    def admit(
        self, req: CompletionRequest, rid: str, changed: asyncio.Event
    ) -> list[RouterRequest]:
        """One HTTP request's choices as requests (n > 1: one per choice, each its own seed),
        woken through `changed` (one event for the whole HTTP request)."""
        # A concrete seed, fixed here: sampling is then a pure function of (seed, position), so
        # every daemon that samples the request picks the same tokens.
        seed = req.seed
        if seed is None and req.temperature > 0:
            seed = secrets.randbits(63)
        tokenizer = self.tokenizer
        states = []
        for i in range(req.n):
            sub_id = rid if req.n == 1 else f"{rid}-{i}"
            state = RouterRequest(
                sub_id,
                req,
                None if seed is None else choice_seed(seed, i),
                StreamAssembler(
                    req.max_tokens, self.model.eos_token_id, req.stop_token_ids, req.ignore_eos
                ),
                ChoiceText(
                    lambda ids: tokenizer.decode(ids, skip_special=True),
                    req.stop,
                    req.min_tokens,
                    req.include_stop_str_in_output,
                ),
                self.clock(),
                self.facts,
                self.peers,
                index=i,
            )
            self.requests[sub_id] = state
            self._wakers[sub_id] = changed
            states.append(state)
        self.counters["requests"] += 1
        return states

    async def submit(self, state: RouterRequest) -> None:
        """The request to P (raises ConnectionError when P is not connected)."""
        await self.lanes.send("prefill", state.submit(handoff_mode=state.req.handoff_mode))

    def forget(self, states: list[RouterRequest]) -> None:
        for state in states:
            self.requests.pop(state.request_id, None)
            self._wakers.pop(state.request_id, None)
