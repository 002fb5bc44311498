"""tests/polling.py, the one way tests wait: the first truthy value, or a timeout that says
what was waited for."""

from __future__ import annotations

import pytest

from tests.polling import wait_for, wait_for_sync


def counting(ready_at: int):
    calls: list[int] = []

    def cond() -> str | None:
        calls.append(1)
        return "ready" if len(calls) >= ready_at else None

    return cond, calls


async def test_wait_for_gives_the_first_truthy_value_of_a_plain_or_async_condition() -> None:
    cond, calls = counting(3)
    assert await wait_for(cond, 5, "three calls", step=0) == "ready" and len(calls) == 3

    async def answer() -> int:
        return 7

    assert await wait_for(answer, 5, "an answer") == 7
    assert await wait_for(lambda: answer(), 5, "an answer") == 7  # a coroutine is awaited


async def test_wait_for_times_out_naming_what_it_waited_for() -> None:
    with pytest.raises(AssertionError, match=r"^timed out after 0.05 s waiting for the link$"):
        await wait_for(lambda: 0, 0.05, "the link", step=0.01)
    state = {"held": 3}
    with pytest.raises(AssertionError, match=r"waiting for KV freed, held: 4$"):
        await wait_for(
            lambda: state.update(held=4), 0.05, lambda: f"KV freed, held: {state['held']}", 0.01
        )


def test_wait_for_sync_is_the_same_loop_for_plain_code() -> None:
    cond, calls = counting(2)
    assert wait_for_sync(cond, 5, "two calls", step=0) == "ready" and len(calls) == 2
    with pytest.raises(AssertionError, match=r"^timed out after 0.05 s waiting for nothing$"):
        wait_for_sync(lambda: [], 0.05, "nothing", step=0.01)
