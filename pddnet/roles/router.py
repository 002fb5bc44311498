"""The router: OpenAI-compatible HTTP in front of the PDD daemons (datacenter A).

It dials P, RLD and MD on the "events" lane (role "router"), sends SUBMIT to P and CANCEL to all,
and receives TOKEN_EVENT / TIMELINE / REQUEST_DONE / ERROR back. Each request's tokens go through
a `StreamAssembler` (in order, exactly once, whoever produced them) and out as one OpenAI
completion -- streamed as SSE or whole -- with a `pdd` object describing how it was served.

Which daemons a mode needs: pdd -> P, RLD, MD; same-dc -> P and the decode instance in A (a relay
role); cross-dc -> P and MD.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from pddnet.config import ClusterConfig, ClusterMode
from pddnet.device.dilation import real_kv_bytes_per_token, wallclock
from pddnet.model.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateUnavailable,
    load_chat_template,
)
from pddnet.protocol import messages as m
from pddnet.roles.assembler import StreamAssembler
from pddnet.roles.openai_api import (
    ApiError,
    ChoiceResult,
    ChoiceText,
    CompletionRequest,
    LogprobEntry,
    ModelInfo,
    bad_request,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    models_response,
    parse_chat_request,
    parse_completion_request,
    response_body,
    usage,
    usage_chunk,
)
from pddnet.roles.peer import silent_past_deadline
from pddnet.roles.readiness import DaemonLinks

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
DONE_GRACE_S = 2.0  # after the last token, how long to wait for REQUEST_DONE / last TIMELINEs


def model_info_and_tokenizer(spec: str) -> tuple[ModelInfo, Any]:
    """The served model's vocabulary, context length and tokenizer -- without its weights."""
    from pddnet.model.config import PRESETS
    from pddnet.model.tokenizer import ByteTokenizer, load_tokenizer

    if spec in PRESETS:
        cfg = PRESETS[spec]
        tok: Any = ByteTokenizer()
    else:
        path = Path(spec)
        if not path.is_dir():
            raise ValueError(
                f"unknown model {spec!r}: expected a preset ({', '.join(PRESETS)}) "
                f"or a folder in Hugging Face Llama layout"
            )
        from pddnet.model.weights import config_from_hf, read_hf_config

        cfg = config_from_hf(read_hf_config(path), path.name)
        tok = load_tokenizer(path)
    aliases = (Path(spec).name,) if Path(spec).name != spec else ()
    info = ModelInfo(
        name=spec,
        vocab_size=cfg.vocab_size,
        max_position=cfg.max_position,
        eos_token_id=tok.eos_token_id,
        aliases=aliases,
    )
    return info, tok


def chat_template_for(spec: str, tokenizer: Any) -> ChatTemplate:
    """The model folder's chat template; the documented fallback for presets."""
    from pddnet.model.config import PRESETS

    return load_chat_template(None if spec in PRESETS else Path(spec), tokenizer)


def choice_seed(seed: int, index: int) -> int:
    """Choice `index`'s seed of an n > 1 request (pddnet.engine.sampling.choice_seed: the
    router stays torch-free, so the one-line rule is repeated here and tested equal)."""
    return (seed + index) % (1 << 64)


@dataclass
class RequestState:
    request_id: str
    req: CompletionRequest
    seed: int | None
    assembler: StreamAssembler
    arrival: float
    timeline: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)
    done_seen: bool = False
    error_status: int = 500
    error_code: str | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    # Which daemon is producing the request now (prefill until a decode tier has its KV):
    # when that one is lost, the router replays the request by token ids elsewhere.
    owner: str = "prefill"
    last_release: float | None = None  # when the client last got tokens (inter-token gaps)
    replays: int = 0
    replay_target: str | None = None
    handoff_started: bool = False  # RLD began handing it to MD (it may have cut)
    index: int = 0  # the choice's index (n > 1: one state per choice)
    text: ChoiceText | None = None  # its text, ended at a stop string
    logprobs: dict[int, LogprobEntry] = field(default_factory=dict)  # by output index
    last_change: float = field(default_factory=time.monotonic)
    router_stopped: bool = False  # a stop string ended it (the daemons don't know)
    cancel_sent: bool = False
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def carriers(self) -> set[str]:
        """The daemons whose loss leaves the request with no producer: its owner (or replay
        target), and MD from the start of a handoff on, as RLD may have cut already while the
        news that MD produces (its tokens, handoff_end) has not reached us yet."""
        out = {self.owner} if self.replay_target is None else {self.replay_target}
        if self.handoff_started and self.replay_target is None:
            out.add("main_decode")
        return out

    def add_event(self, event: str, t: float, producer: str, detail: Any = None) -> None:
        self.timeline.append({"event": event, "time": t, "producer": producer, "detail": detail})
        self.touch()

    def touch(self) -> None:
        """Something happened to the request (its stall clock restarts)."""
        self.last_change = time.monotonic()
        self.changed.set()


class PeerLink:
    """One events-lane connection to a daemon, redialled while the router runs."""

    def __init__(self, router: Router, role: str, address: tuple[str, int]) -> None:
        self.router = router
        self.role = role
        self.address = address
        self.conn: Any = None
        self.connected = asyncio.Event()
        self.task: asyncio.Task | None = None
        self.connects = 0
        self.last_error: str | None = None
        self.last_pong = 0.0
        self.unanswered = 0
        self.heartbeat_deadlines = 0
        self.links = DaemonLinks()  # the daemon's readiness, from its LINK_STATE messages
        # Checked by the redial loop: Python 3.11's wait_for can swallow the cancel that close()
        # sends (when the awaited close of a lost lane finishes in the same step), and the loop
        # then redialled a stopped daemon for ever, so the router never exited on SIGTERM.
        self.closing = False

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"router-peer-{self.role}")

    async def _run(self) -> None:
        from pddnet.transport import ConnectionClosed, dial

        cfg = self.router.config
        backoff = 0.05
        while not self.closing:
            try:
                conn = await dial(
                    self.address[0],
                    self.address[1],
                    role="router",
                    instance_id=self.router.instance_id,
                    lane="events",
                    secret=cfg.secret.encode(),
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # not up yet, or refused: retry
                self.last_error = f"{type(exc).__name__}: {exc}"
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 1.0)
                continue
            backoff = 0.05
            self.conn = conn
            self.connects += 1
            self.last_error = None
            self.connected.set()
            log.info("connected to %s at %s:%d", self.role, *self.address)
            self.last_pong = time.monotonic()
            beat = asyncio.create_task(self._heartbeat(conn), name=f"router-beat-{self.role}")
            try:
                while True:
                    msg = await conn.recv()
                    await self.router._on_message(self, msg)
            except ConnectionClosed as exc:
                self.last_error = f"connection closed: {exc}"
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.exception("events lane to %s failed", self.role)
            finally:
                beat.cancel()
                self.conn = None
                self.connected.clear()
                self.links.reset()
                with contextlib.suppress(Exception):
                    await conn.close()
            if self.closing:
                return
            self.router._on_peer_lost(self)

    async def _heartbeat(self, conn: Any) -> None:
        """PING every wan.heartbeat_s; a daemon silent past the deadline (hung: SIGSTOP, or cut
        off) is treated as lost, so its requests are replayed instead of waiting for the
        request timeout."""
        wan = self.router.config.wan
        nonce = 0
        self.unanswered = 0
        while not conn.closed:
            await asyncio.sleep(wan.heartbeat_s)
            silent = await silent_past_deadline(
                lambda: self.last_pong, lambda: self.unanswered, wan.heartbeat_deadline_s
            )
            if silent is not None:
                self.heartbeat_deadlines += 1
                await conn.close(f"heartbeat deadline: {self.role} silent for {silent:.1f} s")
                return
            nonce += 1
            self.unanswered += 1
            with contextlib.suppress(Exception):
                await conn.send(m.Ping(nonce=nonce, time=time.monotonic()))

    async def send(self, msg: m.Message) -> None:
        conn = self.conn
        if conn is None:
            raise ConnectionError(f"not connected to {self.role}")
        await conn.send(msg)

    async def close(self) -> None:
        self.closing = True
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        if self.conn is not None:
            with contextlib.suppress(Exception):
                await self.conn.close()


class Router:
    """`Router(config)`: `await start()`, then HTTP on config.router.host:port (`.port`)."""

    def __init__(self, config: ClusterConfig, clock: Callable[[], float] = time.time) -> None:
        config.validate()
        self.emulation = config.emulation()  # reported times are the modelled world's (/ k)
        self.dilation = self.emulation.dilation if self.emulation else 1.0
        self.wire_scale = (
            self.emulation.wire_scale(real_kv_bytes_per_token(config.model))
            if self.emulation
            else 1.0
        )
        self.config = config = wallclock(config)
        self.clock = clock
        self.instance_id = f"router-{uuid.uuid4().hex[:8]}"
        self.model, self.tokenizer = model_info_and_tokenizer(config.model.name)
        self.chat_template = chat_template_for(config.model.name, self.tokenizer)
        roles = PEERS_BY_MODE[config.mode]
        self.peers = {r: PeerLink(self, r, getattr(config, r).dial_address()) for r in roles}
        self.requests: dict[str, RequestState] = {}
        self.port: int | None = None
        self.created = int(time.time())
        self.counters: dict[str, int] = {
            "requests": 0,
            "completed": 0,
            "errors": 0,
            "cancelled": 0,
            "rejected_overload": 0,
            "bad_requests": 0,
            "unknown_request_events": 0,
            "tokens": 0,
        }
        self.tokens_by_producer: dict[str, int] = {}
        self._runner: web.AppRunner | None = None
        self._stop = asyncio.Event()
        self._metrics = RouterMetrics()
        self._tasks: set[asyncio.Task] = set()
        self.app = self._make_app()

    # -- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        for peer in self.peers.values():
            peer.start()
        # handler_cancellation: a client that disconnects cancels its handler, which then sends
        # CANCEL to every daemon holding the request.
        # shutdown_timeout: at close, give in-flight handlers (already failed) 2 s, not 60
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.router.host, self.config.router.port)
        await site.start()
        server = site._server  # aiohttp exposes the bound port only here
        self.port = server.sockets[0].getsockname()[1] if server else self.config.router.port

    @property
    def url(self) -> str:
        return f"http://{self.config.router.host}:{self.port}"

    async def wait_connected(self, timeout: float | None = None) -> None:
        await asyncio.wait_for(
            asyncio.gather(*(p.connected.wait() for p in self.peers.values())), timeout
        )

    async def serve_forever(self) -> None:
        await self._stop.wait()

    async def close(self) -> None:
        self._stop.set()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for state in list(self.requests.values()):
            state.assembler.fail("the router is shutting down")
            state.touch()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        # all at once: each close may wait up to a second for its peer to take the last bytes
        await asyncio.gather(*(peer.close() for peer in self.peers.values()))

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
            "peers": {
                r: {
                    "connected": p.conn is not None,
                    "address": f"{p.address[0]}:{p.address[1]}",
                    "connects": p.connects,
                    "last_error": p.last_error,
                }
                for r, p in self.peers.items()
            },
        }

    # -- messages from daemons ------------------------------------------------------------------

    async def _on_message(self, peer: PeerLink, msg: m.Message) -> None:
        now = self.clock()
        if isinstance(msg, m.Ping):
            await peer.send(m.Pong(nonce=msg.nonce, time=msg.time))
            return
        if isinstance(msg, m.Pong):
            peer.last_pong = time.monotonic()
            peer.unanswered = 0
            return
        if isinstance(msg, m.LinkState):
            peer.links.apply(msg)
            if not msg.up:
                log.info("%s: %s down (%s)", peer.role, msg.link, msg.detail)
            return
        rid = getattr(msg, "request_id", None)
        state = self.requests.get(rid) if rid is not None else None
        if state is None:
            if isinstance(msg, m.ErrorMessage):
                log.warning("%s: error %s: %s", peer.role, msg.code, msg.message)
            elif rid is not None:
                self.counters["unknown_request_events"] += 1
            return
        if isinstance(msg, m.TokenEvent):
            if state.replay_target is None or msg.producer == state.replay_target:
                state.owner = msg.producer
            if msg.logprobs:
                k = len(msg.top_logprob_ids) // len(msg.token_ids)
                for j, lp in enumerate(msg.logprobs):
                    state.logprobs.setdefault(
                        msg.index + j,
                        (
                            lp,
                            msg.top_logprob_ids[j * k : (j + 1) * k],
                            msg.top_logprobs[j * k : (j + 1) * k],
                        ),
                    )
            was = len(state.assembler.tokens)
            released = state.assembler.feed_tokens(msg.index, msg.token_ids, msg.producer, now)
            if released is not None:
                if state.last_release is not None:
                    # what the client sees: one gap per release, then tokens that came with it
                    gaps = [now - state.last_release] + [0.0] * (len(released.token_ids) - 1)
                    self._metrics.observe_gaps([g / self.dilation for g in gaps])
                state.last_release = now
                self._text_released(state, released.start, released.token_ids)
            if was == 0 and state.assembler.tokens:
                state.add_event("first_token", now, "router", state.assembler.producers[0])
            if state.assembler.error:
                state.error_code = "stream_inconsistent"
        elif isinstance(msg, m.RequestDone):
            state.done_seen = True
            state.add_event("request_done", msg.time, msg.producer, msg.reason)
            state.assembler.feed_done(msg.reason, msg.num_output_tokens, msg.producer)
        elif isinstance(msg, m.ErrorMessage):
            state.add_event("error", now, peer.role, f"{msg.code}: {msg.message}")
            if state.replay_target is not None and peer.role != state.replay_target:
                pass  # about the lost attempt: the replay elsewhere carries the request now
            elif msg.code.endswith("_lost") and await self._replay(
                state, msg.code[:-5], msg.message
            ):
                pass
            else:
                self._fail(state, peer.role, msg.code, msg.message)
        elif isinstance(msg, m.Timeline):
            self._on_timeline(state, peer, msg)
        elif isinstance(msg, m.PipelineChoice):
            state.add_event("pipeline", msg.time, "prefill", msg.pipeline)
            state.details["pipeline"] = msg.pipeline
            state.details["pipeline_decision"] = pipeline_record(msg)
        elif isinstance(msg, m.PipelineChange):
            state.add_event("pipeline_change", msg.time, "prefill", msg.pipeline)
            state.details["pipeline"] = msg.pipeline
            state.details.setdefault("pipeline_changes", []).append(
                {"pipeline": msg.pipeline, "reason": msg.reason}
            )
        state.touch()

    def _text_released(self, state: RequestState, start: int, token_ids: list[int]) -> None:
        """Tokens released in order: their text. A stop string ends the choice here, at the
        token that completed it; the daemons, which do not know stop strings, are told to stop
        (CANCEL to all, as for a client that went away: each frees what it holds)."""
        assert state.text is not None
        keep = state.text.feed(token_ids)
        if keep is None:
            return
        state.assembler.stop_at(start + keep)
        state.router_stopped = True
        state.stop_reason = state.text.stopped
        state.add_event("stop_string", self.clock(), "router", state.text.stopped)
        self._spawn(self._broadcast_cancel(state, "stop string"), f"stop {state.request_id}")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    def _fail(state: RequestState, who: str, code: str, message: str) -> None:
        state.error_code = code
        unavailable = "overload" in code or "capacity" in code or code.endswith("_lost")
        state.error_status = 503 if unavailable else 500
        state.assembler.fail(f"{who}: {code}: {message}")
        state.touch()

    async def _replay(self, state: RequestState, lost: str, why: str) -> bool:
        """Replay the request by token ids on a live decode tier other than `lost`: prompt +
        the tokens the client already has, recomputed there by one prefill, decoding on from
        the next index. Once per request. False when no tier can take it."""
        asm = state.assembler
        if asm.finished or state.replays >= 1:
            return False
        targets = [
            r
            for r in ("relay", "main_decode")
            if r in self.peers and r != lost and self.peers[r].conn is not None
        ]
        if not targets:
            return False
        target = targets[0]
        req = state.req
        known = tuple(asm.tokens)
        state.replays += 1
        state.replay_target = state.owner = target
        # The attempt replaced may still be alive (a stall, not a loss) and go on producing:
        # the same tokens (sampling is a pure function of seed and position), so an index
        # delivered twice is no longer a broken cut; a *different* token is still a conflict.
        asm.strict = False
        self.counters["replays"] = self.counters.get("replays", 0) + 1
        state.add_event(
            "replay",
            self.clock(),
            "router",
            f"{lost} lost ({why[:200]}): replayed on {target} from index {len(known)}",
        )
        try:
            await self.peers[target].send(
                m.Submit(
                    request_id=state.request_id,
                    prompt_token_ids=req.prompt_token_ids,
                    seed=state.seed,
                    output_token_ids=known,
                    **req.sampling_fields(),
                )
            )
        except Exception as exc:
            self._fail(state, "router", f"{lost}_lost", f"{why}; replay on {target} failed: {exc}")
            return True
        return True

    def _on_timeline(self, state: RequestState, peer: PeerLink, msg: m.Timeline) -> None:
        number, label = msg.detail_int, msg.detail_str
        if label and number is not None:
            detail: Any = {"value": number, "label": label}
        else:
            detail = label or number
        state.add_event(msg.event, msg.time, msg.producer or peer.role, detail)
        d = state.details
        if state.replay_target is None:
            carried_by = state.carriers()
            # Who carries the request now: the decode tier that holds its KV; MD after a cut.
            if msg.event == "rld_kv_complete" or (
                msg.event == "md_kv_complete" and d.get("pipeline") == "p_md"
            ):
                state.owner = msg.producer or peer.role
            elif msg.event == "handoff_end":
                state.owner = "main_decode"
            elif msg.event == "handoff_start":  # RLD may cut from here on: MD carries it too
                state.handoff_started = True
            elif state.owner == "prefill" and (
                msg.event == "rld_kv_sent"
                or (msg.event == "wan_kv_acked" and d.get("pipeline") == "p_md")
            ):
                # P's part is over and P forgets the request: if that decode tier dies before
                # its own milestone, its loss must still replay the request.
                state.owner = "relay" if msg.event == "rld_kv_sent" else "main_decode"
            self._replay_if_a_new_carrier_is_gone(state, state.carriers() - carried_by, msg.event)
        # Figures of the `pdd` object riding on the milestone they belong to.
        if msg.event == "prefill_start" and label:
            d.setdefault("pipeline", label)
        elif msg.event in ("handoff_start", "handoff_end") and label:
            d["handoff_mode"] = label
        elif msg.event == "kv_transport" and label and "=" in label:
            path, _, backend = label.partition("=")  # e.g. "relay=mooncake"
            d.setdefault("transport", {})[path] = backend
        if number is None:
            return
        if msg.event == "handoff_end":
            d["handoff_bytes"] = number
        elif msg.event == "md_kv_complete":
            d["wan_kv_bytes"] = number  # what MD received: authoritative
        elif msg.event == "wan_kv_sent":
            d.setdefault("wan_kv_bytes", number)
        elif msg.event == "prefix_hit_tokens":
            d["prefix_hit_tokens"] = number

    def _on_peer_lost(self, peer: PeerLink) -> None:
        """A daemon's events lane is gone (dead, hung past the heartbeat deadline, cut off):
        the requests it was producing are replayed elsewhere; the others go on (a daemon that
        depended on it reports those itself)."""
        for state in list(self.requests.values()):
            if state.assembler.finished or peer.role not in state.carriers():
                continue
            why = f"lost the connection to {peer.role}: {peer.last_error}"
            self._spawn(self._replay_or_fail(state, peer.role, why), f"replay {state.request_id}")

    def _replay_if_a_new_carrier_is_gone(
        self, state: RequestState, new: set[str], event: str
    ) -> None:
        """A request just gained carriers (`new`): one whose loss reached us before this news
        was not replayed then; replay now, not at the stall timer."""
        gone = [r for r in sorted(new) if r in self.peers and self.peers[r].conn is None]
        if gone and not state.assembler.finished:
            self._spawn(
                self._replay_or_fail(
                    state, gone[0], f"{gone[0]} was lost before its {event} reached the router"
                ),
                f"replay {state.request_id}",
            )

    async def _replay_or_fail(self, state: RequestState, lost: str, why: str) -> None:
        if not await self._replay(state, lost, why):
            self._fail(state, "router", f"{lost}_lost", why)

    async def _broadcast_cancel(self, state: RequestState, reason: str) -> None:
        state.cancel_sent = True
        for peer in self.peers.values():
            with contextlib.suppress(Exception):
                await peer.send(m.Cancel(request_id=state.request_id, reason=reason[:4096]))

    # -- HTTP -------------------------------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(
            client_max_size=self.config.router.max_body_bytes, middlewares=[self._errors]
        )
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats)
        app.router.add_get("/metrics", self._metrics_page)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            if exc.status == 400:
                self.counters["bad_requests"] += 1
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            err = ApiError(exc.status, exc.reason or str(exc), kind, None, None)
            return web.json_response(err.body(), status=exc.status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response(self.model, self.created))

    def readiness(self) -> dict[str, Any]:
        """Ready when every daemon is connected and reports all its links up; otherwise what
        it waits for, one line per link (pddnet/roles/readiness.py)."""
        waiting: list[str] = []
        for role, peer in self.peers.items():
            if peer.conn is None:
                waiting.append(
                    f"{role}: the router's events lane is not connected"
                    + (f" ({peer.last_error})" if peer.last_error else "")
                )
            else:
                waiting += peer.links.waiting_for(role)
        return {
            "ready": not waiting,
            "waiting_for": waiting,
            "peers": {r: p.conn is not None and p.links.ready for r, p in self.peers.items()},
            "links": {r: p.links.to_json() for r, p in self.peers.items()},
        }

    async def _health(self, request: web.Request) -> web.Response:
        ready = self.readiness()
        ok = ready["ready"]
        body = {
            "status": "ok" if ok else "degraded",
            "mode": self.config.mode.value,
            "model": self.model.name,
            "peers": ready["peers"],
            "waiting_for": ready["waiting_for"],
            "links": ready["links"],
            "active_requests": len(self.requests),
        }
        return web.json_response(body, status=200 if ok else 503)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats())

    async def _metrics_page(self, request: web.Request) -> web.Response:
        self._metrics.active.set(len(self.requests))
        body, content_type = self._metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        req = parse_completion_request(
            body, self.model, self._encode, self.config.router.max_tokens_limit
        )
        return await self._serve(request, req, "cmpl")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        req = parse_chat_request(
            body, self.model, self._render_chat, self.config.router.max_tokens_limit
        )
        return await self._serve(request, req, "chatcmpl")

    async def _read_json(self, request: web.Request) -> Any:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(
                413,
                f"request body exceeds {self.config.router.max_body_bytes} bytes",
                "invalid_request_error",
                None,
                "body_too_large",
            ) from None
        try:
            return json.loads(raw)
        except ValueError as exc:
            raise bad_request(f"the request body is not valid JSON: {exc}") from None

    def _render_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool, kwargs: dict[str, Any]
    ) -> tuple[list[int], str]:
        """Messages -> prompt through the model's chat template (pddnet.model.chat_template)."""
        template = self.chat_template
        try:
            text = template.render(messages, add_generation_prompt, **kwargs)
        except ChatTemplateError as exc:
            raise bad_request(str(exc), "messages", "chat_template_error") from None
        except ChatTemplateUnavailable as exc:
            raise ApiError(
                500,
                f"this model's chat template cannot be used: {exc}",
                "server_error",
                None,
                "chat_template_unavailable",
            ) from None
        return self.tokenizer.encode(text, add_bos=template.add_bos), text

    async def _serve(
        self, request: web.Request, req: CompletionRequest, prefix: str
    ) -> web.StreamResponse:
        """One HTTP request: its n choices are n requests to the daemons (each its own seed,
        `choice_seed`), answered together."""
        limit = self.config.router.max_concurrent_requests
        if len(self.requests) + req.n > limit:
            self.counters["rejected_overload"] += 1
            raise ApiError(
                503,
                f"the server is overloaded ({len(self.requests)} requests in "
                f"flight, limit {limit}); retry later",
                "server_error",
                None,
                "overloaded",
            )
        # P prefills every request; one live decode tier can serve it (pdd mode: RLD is the
        # fallback while MD is down, MD while RLD is).
        decode_up = [
            r
            for r in ("relay", "main_decode")
            if r in self.peers and self.peers[r].conn is not None
        ]
        if self.peers["prefill"].conn is None or not decode_up:
            missing = [r for r, p in self.peers.items() if p.conn is None]
            raise ApiError(
                503,
                f"not connected to {', '.join(missing)}; retry later",
                "server_error",
                None,
                "peers_unavailable",
            )
        rid = f"{prefix}-{uuid.uuid4().hex}"
        states = self._admit(req, rid)
        try:
            try:
                for state in states:
                    await self.peers["prefill"].send(self._submit(state))
            except ConnectionError as exc:
                raise ApiError(
                    503,
                    f"cannot reach the prefill daemon: {exc}",
                    "server_error",
                    None,
                    "peers_unavailable",
                ) from None
            if req.stream:
                return await self._respond_stream(request, rid, states)
            return await self._respond_whole(rid, states)
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away (handler cancelled, or a write found the socket closed):
            # free the request everywhere.
            self.counters["cancelled"] += 1
            for state in states:
                state.assembler.cancel()
                await asyncio.shield(self._broadcast_cancel(state, "client disconnected"))
            raise
        finally:
            for state in states:
                self.requests.pop(state.request_id, None)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_bos=True)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special=False)

    def _admit(self, req: CompletionRequest, rid: str) -> list[RequestState]:
        # A concrete seed, fixed here: sampling is then a pure function of (seed, position), so
        # every daemon that samples the request picks the same tokens.
        seed = (
            req.seed
            if req.seed is not None
            else (secrets.randbits(63) if req.temperature > 0 else None)
        )
        changed = asyncio.Event()  # one for the whole HTTP request: any choice's progress
        states = []
        for i in range(req.n):
            sub_id = rid if req.n == 1 else f"{rid}-{i}"
            state = RequestState(
                request_id=sub_id,
                req=req,
                seed=None if seed is None else choice_seed(seed, i),
                arrival=self.clock(),
                assembler=StreamAssembler(
                    req.max_tokens, self.model.eos_token_id, req.stop_token_ids, req.ignore_eos
                ),
                changed=changed,
                index=i,
                text=ChoiceText(
                    lambda ids: self.tokenizer.decode(ids, skip_special=True),
                    req.stop,
                    req.min_tokens,
                    req.include_stop_str_in_output,
                ),
            )
            state.add_event("arrival", state.arrival, "router", len(req.prompt_token_ids))
            self.requests[sub_id] = state
            states.append(state)
        self.counters["requests"] += 1
        return states

    def _submit(self, state: RequestState) -> m.Submit:
        req = state.req
        return m.Submit(
            request_id=state.request_id,
            prompt_token_ids=req.prompt_token_ids,
            seed=state.seed,
            handoff_mode=req.handoff_mode,
            **req.sampling_fields(),
        )

    async def _next_change(self, states: list[RequestState], deadline: float) -> bool:
        """Wait until something happened to one of the requests; False at the deadline. A
        request no daemon has said anything about for `router.stall_timeout_s` is replayed by
        token ids (once): whatever swallowed it, a live decode tier carries it on."""
        stall = self.config.router.stall_timeout_s
        changed = states[0].changed
        while True:
            now = time.monotonic()
            if now >= deadline:
                return False
            live = [s for s in states if not s.assembler.finished]
            wake = min((s.last_change + stall for s in live), default=now + stall)
            try:
                await asyncio.wait_for(changed.wait(), max(0.0, min(deadline, wake) - now))
            except asyncio.TimeoutError:
                now = time.monotonic()
                for state in live:
                    if now - state.last_change < stall or now >= deadline:
                        continue
                    state.last_change = now
                    if (
                        not state.assembler.finished
                        and state.replays == 0
                        and state.assembler.finish_reason is None
                    ):
                        self.counters["stalls"] = self.counters.get("stalls", 0) + 1
                        self._metrics.stall_replays.inc()
                        why = f"no progress for {stall:g} s (last carried by {state.owner})"
                        # elsewhere than the silent carrier if possible, else wherever is live
                        if not await self._replay(state, state.owner, why):
                            await self._replay(state, "none", why)
                continue
            changed.clear()
            return True

    async def _wait_done_notice(self, state: RequestState) -> None:
        """The stream is complete; give REQUEST_DONE and the last TIMELINEs a moment (not
        after a stop string: the daemons were cancelled, no REQUEST_DONE comes)."""
        deadline = time.monotonic() + DONE_GRACE_S
        while (
            not state.done_seen
            and not state.router_stopped
            and state.assembler.finish_reason in ("eos", "stop", "length")
        ):
            if not await self._next_change([state], deadline):
                break

    def _time_out(self, states: list[RequestState]) -> None:
        """The request timeout passed: every choice not finished yet fails with a 504."""
        for state in states:
            if not state.assembler.finished:
                state.error_code, state.error_status = "timeout", 504
                state.assembler.fail(
                    f"no completion within {self.config.router.request_timeout_s:g} s"
                )

    async def _until_finished(self, states: list[RequestState]) -> None:
        """Until every choice is finished, or one failed (the others are then cancelled)."""
        deadline = time.monotonic() + self.config.router.request_timeout_s
        while not all(s.assembler.finished for s in states):
            if any(s.assembler.finish_reason == "error" for s in states):
                break
            if not await self._next_change(states, deadline):
                self._time_out(states)
        failed = [s for s in states if s.assembler.finish_reason == "error"]
        for state in states:
            if failed and not state.assembler.finished:
                state.assembler.cancel()
                await self._broadcast_cancel(state, f"choice {failed[0].index} failed")

    async def _finish(self, state: RequestState) -> None:
        asm = state.assembler
        if asm.finish_reason == "error":
            self.counters["errors"] += 1
            await self._broadcast_cancel(state, asm.error or "error")
        else:
            await self._wait_done_notice(state)
            self.counters["completed"] += 1
            if not state.done_seen and not state.cancel_sent:
                # The router saw the end (a stop token, EOS, max_tokens) but no daemon said so:
                # make sure none of them keeps decoding or holding KV for it.
                await self._broadcast_cancel(state, f"stream ended ({asm.finish_reason})")
        assert state.text is not None
        if asm.finish_reason not in ("error", "cancel") and state.text.finish():
            state.router_stopped, state.stop_reason = True, state.text.stopped
            asm.finish_reason = "stop"  # the held-back text completed a stop string
        if (
            asm.finish_reason == "stop"
            and state.stop_reason is None
            and asm.tokens
            and asm.tokens[-1] in state.req.stop_token_ids
        ):
            state.stop_reason = asm.tokens[-1]
        missing = [i for i in range(len(asm.tokens)) if i not in state.logprobs]
        if state.req.logprobs is not None and missing:
            asm.warnings.append(
                f"no logprobs came for {len(missing)} token(s), first index {missing[0]}"
            )
        self.counters["tokens"] += len(asm.tokens)
        for p in asm.producers:
            self.tokens_by_producer[p] = self.tokens_by_producer.get(p, 0) + 1
        self._metrics.observe(
            asm.finish_reason or "error",
            asm.counts_by_producer(),
            None
            if asm.first_token_time is None
            else (asm.first_token_time - state.arrival) / self.dilation,
        )
        self._metrics.by_pipeline.labels(
            state.details.get("pipeline", "unknown"), asm.finish_reason or "error"
        ).inc()
        if state.replays:
            self._metrics.replays.inc(state.replays)
        state.add_event("done", self.clock(), "router", asm.finish_reason)

    def _error(self, state: RequestState) -> ApiError:
        kind = "server_error" if state.error_status >= 500 else "invalid_request_error"
        return ApiError(
            state.error_status,
            state.assembler.error or "request failed",
            kind,
            None,
            state.error_code,
        )

    def _logprobs(
        self, state: RequestState, start: int, end: int, offset: int = 0
    ) -> tuple[dict[str, Any] | None, int]:
        """Tokens [start, end) of a choice: their logprobs object in the endpoint's shape (None
        when not requested), and the completions text offset after them."""
        req = state.req
        if req.logprobs is None:
            return None, offset
        tokens = state.assembler.tokens[start:end]
        entries = [state.logprobs.get(i) for i in range(start, end)]
        if req.chat:
            return chat_logprobs(tokens, entries, self._token_text), offset
        return completion_logprobs(tokens, entries, self._token_text, offset)

    async def _respond_whole(self, rid: str, states: list[RequestState]) -> web.Response:
        await self._until_finished(states)
        failed = [s for s in states if s.assembler.finish_reason == "error"]
        for state in failed or states:
            await self._finish(state)
        if failed:
            raise self._error(failed[0])
        choices = []
        for state in states:
            asm = state.assembler
            assert state.text is not None
            choices.append(
                ChoiceResult(
                    state.index,
                    state.text.text,
                    asm.tokens,
                    asm.finish_reason,
                    state.stop_reason,
                    self._logprobs(state, 0, len(asm.tokens))[0],
                    self.pdd_object(state),
                )
            )
        first = states[0]
        body = response_body(
            rid, int(first.arrival), first.req.model, first.req, choices, choices[0].pdd or {}
        )
        return web.json_response(body)

    async def _respond_stream(
        self, request: web.Request, rid: str, states: list[RequestState]
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        req = states[0].req
        created, model = int(states[0].arrival), req.model
        num_prompt = len(req.prompt_token_ids)
        sent_tokens = [0] * len(states)
        sent_chars = [0] * len(states)
        offsets = [0] * len(states)
        closed = [False] * len(states)
        deadline = time.monotonic() + self.config.router.request_timeout_s

        async def emit(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        def usage_now() -> dict[str, int] | None:
            if not req.continuous_usage:
                return None
            return usage(num_prompt, sum(len(s.assembler.tokens) for s in states))

        def delta(i: int, state: RequestState) -> tuple[str, list[int], dict[str, Any] | None]:
            """What choice i has that the client has not: text, tokens, their logprobs."""
            asm, text = state.assembler, state.text
            assert text is not None
            new = asm.tokens[sent_tokens[i] :]
            chars = text.text[sent_chars[i] : text.emittable]
            logprobs, offsets[i] = self._logprobs(
                state, sent_tokens[i], len(asm.tokens), offsets[i]
            )
            sent_tokens[i] = len(asm.tokens)
            sent_chars[i] += len(chars)
            return chars, new, logprobs

        error: RequestState | None = None
        while True:
            # A pass over every choice; waiting only after a pass that found nothing to do (a
            # choice's _finish may have consumed the shared change event meanwhile).
            progressed = False
            for i, state in enumerate(states):
                if closed[i]:
                    continue
                asm = state.assembler
                first = sent_tokens[i] == 0 and sent_chars[i] == 0
                if len(asm.tokens) > sent_tokens[i]:
                    chars, new, logprobs = delta(i, state)
                    await emit(
                        completion_chunk(
                            rid,
                            created,
                            model,
                            chars,
                            req,
                            new,
                            first=first,
                            index=state.index,
                            logprobs=logprobs,
                            usage_so_far=usage_now(),
                        )
                    )
                    first = False
                    progressed = True
                if not asm.finished:
                    continue
                progressed = closed[i] = True
                if asm.finish_reason == "error":
                    error = error or state
                    continue
                await self._finish(state)
                chars, new, logprobs = delta(i, state)
                await emit(
                    completion_chunk(
                        rid,
                        created,
                        model,
                        chars,
                        req,
                        new,
                        asm.finish_reason,
                        self.pdd_object(state),
                        first=first,
                        index=state.index,
                        logprobs=logprobs,
                        stop_reason=state.stop_reason,
                        usage_so_far=usage_now(),
                    )
                )
            if all(closed) or error is not None:
                break
            if progressed:
                continue
            if not await self._next_change(states, deadline):
                self._time_out(states)
        if error is not None:
            for state in states:  # the other choices stop too
                if not state.assembler.finished:
                    state.assembler.cancel()
                    await self._broadcast_cancel(state, f"choice {error.index} failed")
            await self._finish(error)
            await emit(self._error(error).body())
        elif req.include_usage:
            await emit(
                usage_chunk(
                    rid,
                    created,
                    model,
                    num_prompt,
                    sum(len(s.assembler.tokens) for s in states),
                    req.chat,
                )
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    def pdd_object(self, state: RequestState) -> dict[str, Any]:
        asm = state.assembler
        counts = asm.counts_by_producer()
        k = self.dilation
        ttft = None if asm.first_token_time is None else (asm.first_token_time - state.arrival) / k
        mode = self.config.mode
        d = state.details
        timeline = [
            {**e, "t_s": (e["time"] - state.arrival) / k}
            for e in sorted(state.timeline, key=lambda e: e["time"])
        ]
        return {
            "request_id": state.request_id,
            "mode": mode.value,
            "seed": state.seed,
            "ttft_s": ttft,
            "emulation": self.emulation.describe() if self.emulation else None,
            "pipeline": d.get("pipeline", DEFAULT_PIPELINE[mode]),
            "handoff_mode": d.get("handoff_mode"),
            "relay_tokens": counts.get("relay", 0),
            "main_tokens": counts.get("main_decode", 0),
            "prefill_tokens": counts.get("prefill", 0),
            "wan_kv_bytes": d.get("wan_kv_bytes", 0),
            # the target model's KV bytes those real bytes stand for (= real when unpaced)
            "target_wan_kv_bytes": round(d.get("wan_kv_bytes", 0) / self.wire_scale),
            "handoff_bytes": d.get("handoff_bytes", 0),
            "prefix_hit_tokens": d.get("prefix_hit_tokens", 0),
            "replays": state.replays,
            "transport": d.get("transport", {}),
            "pipeline_decision": d.get("pipeline_decision"),
            "pipeline_changes": d.get("pipeline_changes", []),
            "finish_reason": asm.finish_reason,
            "warnings": list(asm.warnings),
            "timeline": timeline,
        }


def pipeline_record(msg: m.PipelineChoice) -> dict[str, Any]:
    """P's decision and its inputs as the `pdd` object's `pipeline_decision`."""
    inputs = (
        "prompt_tokens",
        "hit_tokens",
        "max_tokens",
        "kv_bytes_per_token",
        "bandwidth_bps",
        "rtt_s",
        "rld_s_per_token",
        "rld_admits",
        "wan_backlog_bytes",
    )
    return {
        "pipeline": msg.pipeline,
        "reason": msg.reason,
        "estimated_wan_transfer_s": round(msg.wan_transfer_s, 6),
        "incremental_kv_bytes": msg.incremental_bytes,
        "wan_backlog_bytes": msg.wan_backlog_bytes,
        "inputs": {k: getattr(msg, k) for k in inputs},
        "predicted_hit_tokens": msg.predicted_hit,
        "view_stale": msg.view_stale,
    }


class RouterMetrics:
    """Prometheus metrics in a registry of the router's own (GET /metrics)."""

    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry()
        self.requests = Counter(
            "pdd_router_requests",
            "completions by how they ended",
            ["finish_reason"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "pdd_router_output_tokens",
            "output tokens by producer",
            ["producer"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "pdd_router_ttft_seconds",
            "time to first token at the router",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.active = Gauge(
            "pdd_router_active_requests", "requests in flight", registry=self.registry
        )
        self.inter_token = Histogram(
            "pdd_router_inter_token_seconds",
            "gap between token releases to the client",
            buckets=(0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=self.registry,
        )
        self.by_pipeline = Counter(
            "pdd_router_requests_by_pipeline",
            "completions by the pipeline that served them",
            ["pipeline", "finish_reason"],
            registry=self.registry,
        )
        self.replays = Counter(
            "pdd_router_replays",
            "requests replayed by token ids after the daemon producing them was lost",
            registry=self.registry,
        )
        self.stall_replays = Counter(
            "pdd_router_stall_replays",
            "replays by the last resort: no progress for "
            "router.stall_timeout_s (expected 0: a lost daemon is "
            "replayed within its heartbeat deadline)",
            registry=self.registry,
        )

    def observe_gaps(self, gaps: list[float]) -> None:
        for g in gaps:
            self.inter_token.observe(g)

    def observe(self, finish_reason: str, tokens: dict[str, int], ttft: float | None) -> None:
        self.requests.labels(finish_reason).inc()
        for producer, n in tokens.items():
            self.tokens.labels(producer).inc(n)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> tuple[bytes, str]:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        return generate_latest(self.registry), CONTENT_TYPE_LATEST


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
