"""A daemon's voice to the router: TOKEN_EVENT, REQUEST_DONE, TIMELINE and ERROR on the most
recent live events lane (the router dials it; a daemon never dials the router)."""

from __future__ import annotations

import logging
import time
from collections import Counter

from pddnet.engine.sampling import TokenLogprob
from pddnet.lifecycle.sampling import event_logprobs
from pddnet.protocol import ErrorMessage, Message, RequestDone, TokenEvent
from pddnet.protocol.messages import MAX_LOGPROB_TOKENS, Timeline

from .outbox import Outbox

log = logging.getLogger("pddnet.roles")


def now() -> float:
    """Wall-clock time for TOKEN_EVENT / TIMELINE (one clock on one box; see protocol.md)."""
    return time.time()


class ToRouter:
    """The Daemon base's messages to the router. Its events lanes (`_router`, most recent
    last) are accepted and dropped by the Daemon's connection handling."""

    role: str
    instance_id: str
    counters: Counter[str]
    _router: list[Outbox]

    def to_router(self, msg: Message, drop_quietly: bool = False) -> None:
        for box in reversed(self._router):
            if box.alive:
                box.post(msg)
                return
        if drop_quietly:  # a state the router will be sent whole when it connects
            return
        self.counters["router_messages_dropped"] += 1
        log.warning("%s: no router connected; dropped %s", self.instance_id, msg.TYPE.name)

    def emit_tokens(
        self,
        rid: str,
        index: int,
        tokens: tuple[int, ...] | list[int],
        logprobs: list[TokenLogprob | None] | tuple[TokenLogprob, ...] | None = None,
    ) -> None:
        """TOKEN_EVENT(s) to the router; with `logprobs` (one entry per token, for a request
        that asks for them) at most MAX_LOGPROB_TOKENS tokens per event."""
        self.counters["tokens_emitted"] += len(tokens)
        tokens = tuple(tokens)
        step = MAX_LOGPROB_TOKENS if logprobs else max(1, len(tokens))
        for start in range(0, len(tokens), step):
            part = tokens[start : start + step]
            extra = event_logprobs(logprobs[start : start + step], len(part)) if logprobs else {}
            self.to_router(
                TokenEvent(
                    request_id=rid,
                    index=index + start,
                    token_ids=part,
                    producer=self.role,
                    time=now(),
                    **extra,
                )
            )

    def request_done(self, rid: str, reason: str, num_prompt: int, num_output: int) -> RequestDone:
        msg = RequestDone(
            request_id=rid,
            reason=reason,
            num_prompt_tokens=num_prompt,
            num_output_tokens=num_output,
            producer=self.role,
            time=now(),
        )
        self.to_router(msg)
        return msg

    def timeline(
        self, rid: str, event: str, detail_int: int | None = None, detail_str: str = ""
    ) -> None:
        self.to_router(
            Timeline(
                request_id=rid,
                event=event,
                time=now(),
                producer=self.role,
                detail_int=detail_int,
                detail_str=detail_str,
            )
        )

    def error(self, rid: str | None, code: str, message: str) -> None:
        self.to_router(ErrorMessage(request_id=rid, code=code, message=message[:4096]))
