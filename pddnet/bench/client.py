"""A streaming completions client that measures what the user sees (TTFT, inter-token gaps)."""

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

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.sent_at

    def inter_token_s(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:], strict=False)]


async def stream_completion(session: Any, url: str, body: dict[str, Any]) -> StreamRecord:
    """POST a streaming completion with return_token_ids and record token arrival times."""
    body = {**body, "stream": True, "return_token_ids": True}
    rec = StreamRecord(sent_at=time.time())
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
