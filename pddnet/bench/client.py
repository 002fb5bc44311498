"""A streaming completions client that measures what the user sees (TTFT, inter-token gaps).

A cluster on emulated devices runs time-dilated by k (pddnet.device.dilation): the client's
raw clock readings (``sent_at``, ``first_token_at``, ``token_times``: ``time.time()``, the
clock of the daemons' timelines) stay wall-clock, and every duration the record reports
(``ttft_s``, ``inter_token_s``, ``span_s``) is divided by the record's ``dilation``: the
modelled world's time. Unpaced (k = 1) the numbers are exactly the raw ones.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StreamRecord:
    sent_at: float
    first_token_at: float | None = None
    token_times: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    pdd: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    dilation: float = 1.0  # the cluster's time dilation k: reported durations are / k
    prompt_len: int | None = None  # prompt tokens sent (None for a text prompt)

    def span_s(self, start: float, end: float) -> float:
        """A duration between two of this record's raw (wall-clock) times, in modelled time."""
        return (end - start) / self.dilation

    @property
    def ttft_s(self) -> float | None:
        return (
            None if self.first_token_at is None else self.span_s(self.sent_at, self.first_token_at)
        )

    @property
    def wall_ttft_s(self) -> float | None:
        """TTFT on this box's clock (= ttft_s when unpaced)."""
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [self.span_s(a, b) for a, b in zip(t, t[1:], strict=False)]


async def stream_completion(
    session: Any, url: str, body: dict[str, Any], dilation: float = 1.0
) -> StreamRecord:
    """POST a streaming completion with return_token_ids and record token arrival times
    (`dilation`: the cluster's k, kept on the record so its durations come out modelled)."""
    body = {**body, "stream": True, "return_token_ids": True}
    prompt = body.get("prompt")
    rec = StreamRecord(
        sent_at=time.time(),
        dilation=dilation,
        prompt_len=len(prompt) if isinstance(prompt, list) else None,
    )
    async with session.post(url.rstrip("/") + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            rec.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            return rec
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                rec.error = str(chunk["error"])
                break
            now = time.time()
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and rec.first_token_at is None:
                    rec.first_token_at = now
                rec.token_ids.extend(ids)
                rec.token_times.extend([now] * len(ids))
            if "pdd" in chunk:
                rec.pdd = chunk["pdd"]
    return rec
