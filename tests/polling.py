"""One way for tests to wait on a running cluster: poll a condition until it holds or a bound
passes (every wait in a test is bounded, and says what it waited for when it times out)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def wait_for(
    cond: Callable[[], Awaitable[Any]], timeout: float, what: str, step: float = 0.05
) -> Any:
    """The first truthy value of `await cond()`; AssertionError naming `what` after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = await cond()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(step)
