"""Load drivers shared by the benchmarks and the demo: send a seeded workload to a router and
record what the client sees (`StreamRecord` per request, in workload order).

`drive` sends any workload as conversations: an agent workload's turn t is sent at max(its
arrival, turn t-1 done) and its prompt is built from what turn t-1 really returned (closed loop
per conversation); a Poisson `BenchRequest` is a conversation of one turn, so such a workload is
sent open loop at its arrival offsets. It takes a `progress` (pddnet.bench.progress) updated
once per finished request.

On emulated devices (``dilation`` k > 1) the workload's own time is stretched: a request due
at ``arrival_s`` is sent ``arrival_s x k`` wall seconds after the start (think times included),
so the offered load is the modelled one; the records carry k and report durations / k.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from pddnet.bench.client import StreamRecord, stream_completion
from pddnet.workload.agent import AgentRequest, follow_up_prompt
from pddnet.workload.poisson import BenchRequest


def _body(model: str, prompt: Sequence[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        **extra,
    }


def _sender(
    session: Any,
    url: str,
    model: str,
    progress: Any,
    dilation: float,
    **extra: Any,
) -> Callable[[float, Sequence[int], int], Awaitable[StreamRecord]]:
    """The one way both drivers send a request: wait for its arrival offset (stretched by the
    dilation, counted from now), stream it, and count it done on the progress."""
    start = time.monotonic()

    async def send(arrival_s: float, prompt: Sequence[int], max_tokens: int) -> StreamRecord:
        await asyncio.sleep(max(0.0, arrival_s * dilation - (time.monotonic() - start)))
        body = _body(model, prompt, max_tokens, **extra)
        rec = await stream_completion(session, url, body, dilation=dilation)
        if progress is not None:
            progress.update(1)
        return rec

    return send


async def warm_up(session: Any, url: str, model: str, dilation: float = 1.0) -> None:
    """One tiny request, so that first-touch costs (allocations, lazy imports) are not measured."""
    rec = await stream_completion(session, url, _body(model, [1, 2, 3], 2), dilation=dilation)
    if rec.error is not None:
        raise RuntimeError(f"warm-up request failed: {rec.error}")


def _turn(req: BenchRequest | AgentRequest) -> int:
    return req.turn if isinstance(req, AgentRequest) else 0


def _conversations(workload: Sequence[BenchRequest | AgentRequest]) -> list[list[int]]:
    """Workload indices per conversation (in order of first appearance), turns in order; each
    `BenchRequest` is a conversation of its own."""
    by_conv: dict[tuple[str, int], list[int]] = {}
    for i, r in enumerate(workload):
        key = ("agent", r.conversation_id) if isinstance(r, AgentRequest) else ("open", i)
        by_conv.setdefault(key, []).append(i)
    return [sorted(ix, key=lambda j: _turn(workload[j])) for ix in by_conv.values()]


async def drive(
    session: Any,
    url: str,
    workload: Sequence[BenchRequest | AgentRequest],
    model: str,
    progress: Any = None,
    dilation: float = 1.0,
    **extra: Any,
) -> list[StreamRecord]:
    """Send `workload` to the router at `url`; the records come back in workload order."""
    conversations = _conversations(workload)
    records: list[StreamRecord | None] = [None] * len(workload)
    send = _sender(session, url, model, progress, dilation, **extra)

    async def conversation(turns: list[int]) -> None:
        prompt: tuple[int, ...] = ()
        output: list[int] = []
        for i in turns:
            req = workload[i]
            if isinstance(req, AgentRequest):
                prompt = follow_up_prompt(req, prompt, output)
            else:
                prompt = req.prompt_token_ids
            rec = records[i] = await send(req.arrival_s, prompt, req.max_tokens)
            if rec.error is not None:  # the conversation cannot go on without this turn
                for j in turns:
                    if records[j] is None:
                        records[j] = StreamRecord(
                            sent_at=time.time(),
                            error=f"not sent: turn {_turn(req)} failed",
                            dilation=dilation,
                        )
                        if progress is not None:
                            progress.update(1)
                return
            output = rec.token_ids

    await asyncio.gather(*(conversation(turns) for turns in conversations))
    return [r for r in records if r is not None]
