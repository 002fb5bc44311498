"""Answering one completion: wait for its choices, settle them, answer whole or as SSE.

An HTTP request's n choices are n requests (pddnet/lifecycle/router_request.py) woken by one
event. While waiting, the stall clock runs (a request no daemon said anything about for
`router.stall_timeout_s` is replayed by token ids, once) and so does the request timeout (a 504).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from aiohttp import web

from pddnet.api.responses import (
    ChoiceResult,
    chat_logprobs,
    completion_chunk,
    completion_logprobs,
    response_body,
    usage,
    usage_chunk,
)
from pddnet.api.types import ApiError
from pddnet.lifecycle.router_request import RouterRequest
from pddnet.roles.router_face import RouterFace

DONE_GRACE_S = 2.0  # after the last token, how long to wait for REQUEST_DONE / last TIMELINEs


class Completion:
    """The choices of one HTTP request (`states`), woken by `changed`."""

    def __init__(
        self, router: RouterFace, rid: str, states: list[RouterRequest], changed: asyncio.Event
    ) -> None:
        self.router = router
        self.rid = rid
        self.states = states
        self.changed = changed
        self.timeout_s = router.config.router.request_timeout_s

    # -- the two answers ---------------------------------------------------------------------------

    async def whole(self) -> web.Response:
        states = self.states
        await self._until_finished()
        failed = [s for s in states if s.failed]
        for state in failed or states:
            await self._finish(state)
        if failed:
            raise self._error(failed[0])
        choices = []
        for state in states:
            asm = state.assembler
            choices.append(
                ChoiceResult(
                    state.index,
                    state.text.text,
                    asm.tokens,
                    asm.finish_reason,
                    state.stop_reason,
                    self._logprobs(state, 0, len(asm.tokens))[0],
                    state.pdd().to_json(),
                )
            )
        first = states[0]
        body = response_body(
            self.rid, int(first.arrival), first.req.model, first.req, choices, choices[0].pdd or {}
        )
        return web.json_response(body)

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        rid, states = self.rid, self.states
        req = states[0].req
        created, model = int(states[0].arrival), req.model
        num_prompt = len(req.prompt_token_ids)
        sent_tokens = [0] * len(states)
        sent_chars = [0] * len(states)
        offsets = [0] * len(states)
        closed = [False] * len(states)
        deadline = time.monotonic() + self.timeout_s

        async def emit(obj: dict[str, Any]) -> None:
            await resp.write(b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n")

        def usage_now() -> dict[str, int] | None:
            if not req.continuous_usage:
                return None
            return usage(num_prompt, sum(len(s.assembler.tokens) for s in states))

        def delta(i: int, state: RouterRequest) -> tuple[str, list[int], dict[str, Any] | None]:
            """What choice i has that the client has not: text, tokens, their logprobs."""
            asm, text = state.assembler, state.text
            new = asm.tokens[sent_tokens[i] :]
            chars = text.text[sent_chars[i] : text.emittable]
            logprobs, offsets[i] = self._logprobs(
                state, sent_tokens[i], len(asm.tokens), offsets[i]
            )
            sent_tokens[i] = len(asm.tokens)
            sent_chars[i] += len(chars)
            return chars, new, logprobs

        async def emit_delta(
            i: int,
            state: RouterRequest,
            first: bool,
            finish_reason: str | None = None,
            pdd: dict[str, Any] | None = None,
            stop_reason: int | str | None = None,
        ) -> None:
            """One chunk with what choice i has that the client has not (the last one with its
            finish_reason, pdd object and stop_reason)."""
            chars, new, logprobs = delta(i, state)
            await emit(
                completion_chunk(
                    rid,
                    created,
                    model,
                    chars,
                    req,
                    new,
                    finish_reason,
                    pdd,
                    first=first,
                    index=state.index,
                    logprobs=logprobs,
                    stop_reason=stop_reason,
                    usage_so_far=usage_now(),
                )
            )

        error: RouterRequest | None = None
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
                    await emit_delta(i, state, first)
                    first = False
                    progressed = True
                if not asm.finished:
                    continue
                progressed = closed[i] = True
                if state.failed:
                    error = error or state
                    continue
                await self._finish(state)
                await emit_delta(
                    i,
                    state,
                    first,
                    finish_reason=asm.finish_reason,
                    pdd=state.pdd().to_json(),
                    stop_reason=state.stop_reason,
                )
            if all(closed) or error is not None:
                break
            if progressed:
                continue
            if not await self._next_change(states, deadline):
                self._time_out(states)
        if error is not None:
            for state in states:  # the other choices stop too
                if not state.finished:
                    state.assembler.cancel()
                    await self.router.cancel(state, f"choice {error.index} failed")
            await self._finish(error)
            await emit(self._error(error).body())
        elif req.include_usage:
            total = sum(len(s.assembler.tokens) for s in states)
            await emit(usage_chunk(rid, created, model, num_prompt, total, req.chat))
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    # -- waiting -----------------------------------------------------------------------------------

    async def _next_change(self, states: list[RouterRequest], deadline: float) -> bool:
        """Wait until something happened to one of the requests; False at the deadline. The
        stall clock runs meanwhile (RouterRequest.stalled)."""
        router = self.router
        stall = router.config.router.stall_timeout_s
        while True:
            now = time.monotonic()
            if now >= deadline:
                return False
            live = [s for s in states if not s.finished]
            t = router.clock()
            wake_in = min((s.last_change + stall - t for s in live), default=stall)
            try:
                await asyncio.wait_for(self.changed.wait(), max(0.0, min(deadline - now, wake_in)))
            except asyncio.TimeoutError:
                if time.monotonic() >= deadline:
                    continue
                t, up = router.clock(), router.lanes.connected()
                for state in live:
                    actions = state.stalled(t, stall, up)
                    if actions:
                        await router.apply(state, actions)
                continue
            self.changed.clear()
            return True

    async def _until_finished(self) -> None:
        """Until every choice is finished, or one failed (the others are then cancelled)."""
        states = self.states
        deadline = time.monotonic() + self.timeout_s
        while not all(s.finished for s in states):
            if any(s.failed for s in states):
                break
            if not await self._next_change(states, deadline):
                self._time_out(states)
        failed = [s for s in states if s.failed]
        for state in states:
            if failed and not state.finished:
                state.assembler.cancel()
                await self.router.cancel(state, f"choice {failed[0].index} failed")

    def _time_out(self, states: list[RouterRequest]) -> None:
        """The request timeout passed: every choice not finished yet fails with a 504."""
        for state in states:
            state.time_out(self.timeout_s)

    async def _finish(self, state: RouterRequest) -> None:
        router = self.router
        asm = state.assembler
        if state.failed:
            router.counters["errors"] += 1
            await router.cancel(state, asm.error or "error")
        else:
            # The stream is complete: give REQUEST_DONE and the last TIMELINEs a moment.
            deadline = time.monotonic() + DONE_GRACE_S
            while state.awaits_done_notice:
                if not await self._next_change([state], deadline):
                    break
            router.counters["completed"] += 1
            if not state.done_seen and not state.cancel_sent:
                # The router saw the end (a stop token, EOS, max_tokens) but no daemon said so:
                # make sure none of them keeps decoding or holding KV for it.
                await router.cancel(state, f"stream ended ({asm.finish_reason})")
        state.finish(router.clock())
        router.counters["tokens"] += len(asm.tokens)
        for p in asm.producers:
            router.tokens_by_producer[p] = router.tokens_by_producer.get(p, 0) + 1
        ttft = asm.first_token_time
        router.metrics.observe(
            asm.finish_reason or "error",
            asm.counts_by_producer(),
            None if ttft is None else (ttft - state.arrival) / router.dilation,
        )
        pipeline = state.served.pipeline or "unknown"
        router.metrics.by_pipeline.labels(pipeline, asm.finish_reason or "error").inc()
        if state.replays:
            router.metrics.replays.inc(state.replays)

    # -- shapes ------------------------------------------------------------------------------------

    @staticmethod
    def _error(state: RouterRequest) -> ApiError:
        kind = "server_error" if state.error_status >= 500 else "invalid_request_error"
        message = state.assembler.error or "request failed"
        return ApiError(state.error_status, message, kind, None, state.error_code)

    def _logprobs(
        self, state: RouterRequest, start: int, end: int, offset: int = 0
    ) -> tuple[dict[str, Any] | None, int]:
        """Tokens [start, end) of a choice: their logprobs object in the endpoint's shape (None
        when not requested), and the completions text offset after them."""
        req = state.req
        if req.logprobs is None:
            return None, offset
        tokens = state.assembler.tokens[start:end]
        entries = [state.logprobs.get(i) for i in range(start, end)]
        tokenizer = self.router.tokenizer

        def token_text(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special=False)

        if req.chat:
            return chat_logprobs(tokens, entries, token_text), offset
        return completion_logprobs(tokens, entries, token_text, offset)
