"""The router: OpenAI-compatible HTTP in front of the PDD daemons (datacenter A).

It dials P, RLD and MD on the "events" lane (role "router", one `Peer` each: heartbeats, redial),
sends SUBMIT to P and CANCEL to all, and receives TOKEN_EVENT / TIMELINE / REQUEST_DONE / ERROR /
PIPELINE_* back. This file is the shell: each message goes to its request's machine
(pddnet/lifecycle/router_request.py: owners, replays, assembling, the `pdd` object) and the
machine's actions come out here (a replay's SUBMIT, CANCELs, metrics). The HTTP front is
pddnet/roles/http_api.py; answering one completion (whole or SSE) pddnet/roles/completion.py.

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

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.device.dilation import real_kv_bytes_per_token, wallclock
from pddnet.lifecycle.pdd_object import RouterFacts
from pddnet.lifecycle.router_request import (
    Action,
    CancelAll,
    Replay,
    RouterRequest,
    Stalled,
    TokenGaps,
)
from pddnet.obs.metrics import RouterMetrics
from pddnet.protocol import messages as m
from pddnet.roles.assembler import StreamAssembler
from pddnet.roles.http_api import HttpFront
from pddnet.roles.openai_api import ChoiceText, CompletionRequest
from pddnet.roles.outbox import Outbox
from pddnet.roles.peer import Peer, PeerHost
from pddnet.roles.readiness import DaemonLinks
from pddnet.transport import Connection, ConnectionClosed, dial

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
        self.links = {r: DaemonLinks() for r in PEERS_BY_MODE[config.mode]}  # their LINK_STATE
        self.peers = {r: self._peer(r) for r in self.links}
        self._wakers: dict[str, asyncio.Event] = {}  # request id -> its HTTP request's event
        self._tasks: set[asyncio.Task] = set()
        self._peer_tasks: set[asyncio.Task] = set()
        self._closing = False
        self._stop = asyncio.Event()
        self.http = HttpFront(self)

    # -- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> None:
        for peer in self.peers.values():
            peer.start()
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
        self._closing = True  # ends the redial loops (see Peer._reconnect)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for state in list(self.requests.values()):
            state.assembler.fail("the router is shutting down")
            self._wake(state)
        await self.http.close()
        # all at once: each close may wait up to a second for its peer to take the last bytes
        await asyncio.gather(*(peer.close() for peer in self.peers.values()))

    def connected(self) -> frozenset[str]:
        """The daemons whose events lane is up now."""
        return frozenset(r for r, p in self.peers.items() if p.alive)

    def stats(self) -> dict[str, Any]:
        return {
            "role": "router",
            "instance_id": self.instance_id,
            "mode": self.config.mode.value,
            "model": self.http.model.name,
            "port": self.port,
            "active_requests": len(self.requests),
            **self.counters,
            "tokens_by_producer": dict(self.tokens_by_producer),
            "peers": {
                r: {
                    "connected": p.alive,
                    "address": f"{p.address[0]}:{p.address[1]}",
                    "connects": p.connects,
                    "last_error": None if p.alive else (p.last_loss or None),
                }
                for r, p in self.peers.items()
            },
        }

    def readiness(self) -> dict[str, Any]:
        """Ready when every daemon is connected and reports all its links up; otherwise what
        it waits for, one line per link (pddnet/roles/readiness.py)."""
        waiting: list[str] = []
        up = self.connected()
        for role, peer in self.peers.items():
            if role not in up:
                waiting.append(
                    f"{role}: the router's events lane is not connected"
                    + (f" ({peer.last_loss})" if peer.last_loss else "")
                )
            else:
                waiting += self.links[role].waiting_for(role)
        return {
            "ready": not waiting,
            "waiting_for": waiting,
            "peers": {r: r in up and self.links[r].ready for r in self.peers},
            "links": {r: links.to_json() for r, links in self.links.items()},
        }

    # -- the daemons' events lanes ----------------------------------------------------------------

    def _peer(self, role: str) -> Peer:
        cfg = self.config

        async def dial_once(address: tuple[str, int], lane: str) -> Connection:
            host, port = address
            secret = cfg.secret.encode()
            return await dial(
                host, port, role="router", instance_id=self.instance_id, lane=lane, secret=secret
            )

        host = PeerHost(
            name=self.instance_id,
            dial=dial_once,  # unused: the router's peers dial in the background (Peer.start)
            dial_once=dial_once,
            serve=lambda conn: self._read(role, conn),
            outbox=lambda conn, name: Outbox(conn, f"{self.instance_id} -> {name}"),
            forget_outbox=self._forget_outbox,
            spawn=self._spawn_peer,
            closing=lambda: self._closing,
            link_changed=self._link_changed,
            counters=self.counters,
        )
        wan = cfg.wan
        return Peer(
            host,
            getattr(cfg, role).dial_address(),
            role,
            heartbeat_s=wan.heartbeat_s,
            deadline_s=wan.heartbeat_deadline_s,
            lane="events",
            backoff=(0.05, 1.0),
        )

    async def _read(self, role: str, conn: Connection) -> None:
        """One events lane until it closes: heartbeats answered at once, LINK_STATE kept for
        /health, the rest to the requests' machines."""
        try:
            async for msg in conn:
                if isinstance(msg, m.Ping):
                    with contextlib.suppress(ConnectionClosed):
                        await conn.send(m.Pong(nonce=msg.nonce, time=msg.time))
                elif isinstance(msg, m.Pong):
                    self.peers[role].pong(msg)
                elif isinstance(msg, m.LinkState):
                    self.links[role].apply(msg)
                    if not msg.up:
                        log.info("%s: %s down (%s)", role, msg.link, msg.detail)
                else:
                    await self._on_message(role, msg)
        except Exception as exc:  # a handler's bug: the lane is lost (and redialled), not the loop
            log.exception("events lane to %s failed", role)
            await conn.close(f"{type(exc).__name__}: {exc}")

    async def _on_message(self, role: str, msg: m.Message) -> None:
        rid = getattr(msg, "request_id", None)
        state = self.requests.get(rid) if rid is not None else None
        if state is None:
            if isinstance(msg, m.ErrorMessage):
                log.warning("%s: error %s: %s", role, msg.code, msg.message)
            elif rid is not None:
                self.counters["unknown_request_events"] += 1
            return
        await self.apply(state, state.receive(msg, role, self.clock(), self.connected()))

    def _link_changed(self, role: str) -> None:
        """A daemon's events lane went up or down. Down (dead, hung past the heartbeat deadline,
        cut off): the requests it carried are replayed elsewhere; the others go on (a daemon
        that depended on it reports those itself)."""
        peer = self.peers[role]
        if peer.up.is_set():
            return
        self.links[role].reset()
        now, up = self.clock(), self.connected()
        for state in list(self.requests.values()):
            actions = state.peer_lost(role, peer.last_loss, now, up)
            self._wake(state)
            if actions:
                self._spawn(self.apply(state, actions), f"replay {state.request_id}")

    async def apply(self, state: RouterRequest, actions: list[Action]) -> None:
        """Carry out a machine's actions, then wake whoever waits for the request."""
        for action in actions:
            if isinstance(action, Replay):
                self.counters["replays"] = self.counters.get("replays", 0) + 1
                try:
                    await self.send(action.target, action.submit)
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

    async def send(self, role: str, msg: m.Message) -> None:
        conn = self.peers[role].conn
        if conn is None:
            raise ConnectionError(f"not connected to {role}")
        await conn.send(msg)

    async def cancel(self, state: RouterRequest, reason: str) -> None:
        await self._cancel(state.cancel_all(reason))

    async def _cancel(self, action: CancelAll) -> None:
        for role in self.peers:
            with contextlib.suppress(Exception):
                await self.send(role, m.Cancel(request_id=action.request_id, reason=action.reason))

    def _spawn(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _spawn_peer(self, coro: Awaitable[Any], name: str) -> asyncio.Task:
        """The peers' keepers: closed last (Peer.close), after the HTTP front."""
        task = asyncio.get_running_loop().create_task(coro, name=name)  # type: ignore[arg-type]
        self._peer_tasks.add(task)
        task.add_done_callback(self._peer_tasks.discard)
        return task

    def _forget_outbox(self, box: Outbox | None) -> None:
        if box is not None:
            self._spawn(box.close(), f"close {box.name}")

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
        tokenizer = self.http.tokenizer
        states = []
        for i in range(req.n):
            sub_id = rid if req.n == 1 else f"{rid}-{i}"
            state = RouterRequest(
                sub_id,
                req,
                None if seed is None else choice_seed(seed, i),
                StreamAssembler(
                    req.max_tokens, self.http.model.eos_token_id, req.stop_token_ids, req.ignore_eos
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
        req = state.req
        await self.send(
            "prefill",
            m.Submit(
                request_id=state.request_id,
                prompt_token_ids=req.prompt_token_ids,
                seed=state.seed,
                handoff_mode=req.handoff_mode,
                **req.sampling_fields(),
            ),
        )

    def forget(self, states: list[RouterRequest]) -> None:
        for state in states:
            self.requests.pop(state.request_id, None)
            self._wakers.pop(state.request_id, None)


async def run_router(
    config: ClusterConfig,
    on_started: Callable[[Router], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT (what `pdd serve router` runs)."""
    import signal

    router = Router(config)
    await router.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, router._stop.set)
    if on_started is not None:
        on_started(router)
    try:
        await router.serve_forever()
    finally:
        await router.close()
