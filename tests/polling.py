"""One way for tests to wait: poll a condition until it holds or a bound passes (every wait in
a test is bounded, and says what it waited for when it times out).

`wait_for` is for coroutines (its condition may be a plain function or a coroutine function);
`wait_for_sync` is the same loop for plain (thread-blocking) tests. A sleep that IS the test (a
fault's duration, a deliberately idle period, pacing a load) is not a wait: it stays a sleep.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

# What was waited for: a text, or a function giving one at the timeout (to show the last state).
What = str | Callable[[], str]


def _timed_out(timeout: float, what: What) -> AssertionError:
    said = what() if callable(what) else what
    return AssertionError(f"timed out after {timeout:g} s waiting for {said}")


async def wait_for(
    cond: Callable[[], Any | Awaitable[Any]], timeout: float, what: What, step: float = 0.05
) -> Any:
    """The first truthy value of `cond()` (awaited if it is awaitable); AssertionError naming
    `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what)
        await asyncio.sleep(step)


def wait_for_sync(cond: Callable[[], Any], timeout: float, what: What, step: float = 0.05) -> Any:
    """`wait_for` for code that is not a coroutine: the first truthy value of `cond()`."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _timed_out(timeout, what)
        time.sleep(step)
