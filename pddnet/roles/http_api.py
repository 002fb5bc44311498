"""The router's HTTP front (aiohttp): /v1/completions, /v1/chat/completions, /v1/models, /health,
/stats, /metrics. Requests are parsed by pddnet/api/types.py, admitted and submitted by the
router (pddnet/roles/router.py), answered by pddnet/roles/completion.py.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from aiohttp import web

from pddnet.api.parse import parse_chat_request, parse_completion_request
from pddnet.api.responses import models_response
from pddnet.api.types import ApiError, CompletionRequest, ModelInfo, bad_request
from pddnet.model.chat_template import (
    ChatTemplate,
    ChatTemplateError,
    ChatTemplateUnavailable,
    load_chat_template,
)
from pddnet.model.tokenizer import Tokenizer
from pddnet.roles.completion import Completion
from pddnet.roles.router_face import RouterFace


def model_info_and_tokenizer(spec: str) -> tuple[ModelInfo, Tokenizer]:
    """The served model's vocabulary, context length and tokenizer -- without its weights."""
    from pddnet.model.config import PRESETS
    from pddnet.model.tokenizer import ByteTokenizer, load_tokenizer

    if spec in PRESETS:
        cfg = PRESETS[spec]
        tok: Tokenizer = ByteTokenizer()
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


def chat_template_for(spec: str, tokenizer: Tokenizer) -> ChatTemplate:
    """The model folder's chat template; the documented fallback for presets."""
    from pddnet.model.config import PRESETS

    return load_chat_template(None if spec in PRESETS else Path(spec), tokenizer)


def unavailable(message: str, code: str) -> ApiError:
    return ApiError(503, message, "server_error", None, code)


class HttpFront:
    """The router's aiohttp application; `port` once started."""

    def __init__(self, router: RouterFace) -> None:
        self.router = router
        self.config = router.config
        self.model, self.tokenizer = router.model, router.tokenizer
        self.chat_template = chat_template_for(self.config.model.name, self.tokenizer)
        self.created = int(time.time())
        self.port: int | None = None
        self._runner: web.AppRunner | None = None
        self.app = web.Application(
            client_max_size=self.config.router.max_body_bytes, middlewares=[self._errors]
        )
        self.app.router.add_post("/v1/completions", self._completions)
        self.app.router.add_post("/v1/chat/completions", self._chat_completions)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)
        self.app.router.add_get("/stats", self._stats)
        self.app.router.add_get("/metrics", self._metrics_page)

    async def start(self) -> None:
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

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- handlers ---------------------------------------------------------------------------------

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except ApiError as exc:
            if exc.status == 400:
                self.router.counters["bad_requests"] += 1
            return web.json_response(exc.body(), status=exc.status)
        except web.HTTPException as exc:
            if exc.status < 400:
                raise
            kind = "invalid_request_error" if exc.status < 500 else "server_error"
            err = ApiError(exc.status, exc.reason or str(exc), kind, None, None)
            return web.json_response(err.body(), status=exc.status)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(models_response(self.model, self.created))

    async def _health(self, request: web.Request) -> web.Response:
        ready = self.router.lanes.readiness()
        ok = ready["ready"]
        body = {
            "status": "ok" if ok else "degraded",
            "mode": self.config.mode.value,
            "model": self.model.name,
            "peers": ready["peers"],
            "waiting_for": ready["waiting_for"],
            "links": ready["links"],
            "active_requests": len(self.router.requests),
        }
        return web.json_response(body, status=200 if ok else 503)

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.router.stats())

    async def _metrics_page(self, request: web.Request) -> web.Response:
        metrics = self.router.metrics
        metrics.active.set(len(self.router.requests))
        body, content_type = metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._read_json(request)
        req = parse_completion_request(
            body,
            self.model,
            lambda text: self.tokenizer.encode(text, add_bos=True),
            self.config.router.max_tokens_limit,
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
        """One HTTP request: its n choices are n requests to the daemons, answered together."""
        router = self.router
        limit = self.config.router.max_concurrent_requests
        if len(router.requests) + req.n > limit:
            router.counters["rejected_overload"] += 1
            raise unavailable(
                f"the server is overloaded ({len(router.requests)} requests in "
                f"flight, limit {limit}); retry later",
                "overloaded",
            )
        # P prefills every request; one live decode tier can serve it (pdd mode: RLD is the
        # fallback while MD is down, MD while RLD is).
        up = router.lanes.connected()
        if "prefill" not in up or not up & {"relay", "main_decode"}:
            missing = [r for r in router.peers if r not in up]
            raise unavailable(
                f"not connected to {', '.join(missing)}; retry later", "peers_unavailable"
            )
        rid = f"{prefix}-{uuid.uuid4().hex}"
        changed = asyncio.Event()  # one for the whole HTTP request: any choice's progress
        states = router.admit(req, rid, changed)
        try:
            try:
                for state in states:
                    await router.submit(state)
            except ConnectionError as exc:
                raise unavailable(
                    f"cannot reach the prefill daemon: {exc}", "peers_unavailable"
                ) from None
            completion = Completion(router, rid, states, changed)
            if req.stream:
                return await completion.stream(request)
            return await completion.whole()
        except (asyncio.CancelledError, ConnectionResetError):
            # The client went away (handler cancelled, or a write found the socket closed):
            # free the request everywhere.
            router.counters["cancelled"] += 1
            for state in states:
                state.assembler.cancel()
                await asyncio.shield(router.cancel(state, "client disconnected"))
            raise
        finally:
            router.forget(states)
