"""EngineWorker: a real Engine stepping in one thread while the event loop stays responsive."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pddnet.engine.engine import Engine
from pddnet.engine.sampling import SamplingParams
from pddnet.engine.worker import EngineWorker, WorkerClosed
from pddnet.model.loader import load_model
from tests.polling import wait_for


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny")


def prompts(tok) -> list[list[int]]:
    return [
        tok.encode(text, add_bos=True)
        for text in (
            "the quick brown fox",
            "a",
            "pddnet hands off by token ids",
            "relay decode " * 5,
        )
    ]


class Collector:
    """on_outputs/on_error: record what arrives, and on which thread."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.errors: list[BaseException] = []
        self.threads: set[int] = set()
        self.changed = asyncio.Event()

    def on_outputs(self, outputs) -> None:
        self.threads.add(threading.get_ident())
        for out in outputs:
            self.tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.finished.add(out.request_id)
        self.changed.set()

    def on_error(self, exc: BaseException) -> None:
        self.threads.add(threading.get_ident())
        self.errors.append(exc)
        self.changed.set()

    async def wait_for(self, cond, timeout: float = 60.0) -> None:
        async with asyncio.timeout(timeout):
            while not cond():
                self.changed.clear()
                await self.changed.wait()


def started(tiny, name: str, **engine_options) -> tuple[Engine, EngineWorker, Collector]:
    """A real Engine (64 blocks of 4 tokens unless `engine_options` say otherwise) stepped by
    a worker `name` that hands its outputs and errors to a Collector."""
    model, tok = tiny
    col = Collector()
    engine = Engine(model, tok, **({"num_blocks": 64, "block_size": 4} | engine_options))
    worker = EngineWorker(engine, col.on_outputs, name=name, on_error=col.on_error)
    return engine, worker, col


def worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("pdd-")]


async def test_runs_requests_token_exact_vs_generate(tiny):
    model, tok = tiny
    reference = Engine(model, tok, num_blocks=128, block_size=4)
    greedy = [reference.generate(p, 12, ignore_eos=True) for p in prompts(tok)]
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234)
    sampled = reference.generate(prompts(tok)[0], 12, seeded, ignore_eos=True)

    col = Collector()
    engine = Engine(model, tok, num_blocks=128, block_size=4)
    worker = EngineWorker(
        engine, col.on_outputs, threads=1, name="test-exact", on_error=col.on_error
    )
    ids = [
        await worker.call(engine.add_request, p, 12, None, f"g{i}", ignore_eos=True)
        for i, p in enumerate(prompts(tok))
    ]
    ids.append(
        await worker.call(engine.add_request, prompts(tok)[0], 12, seeded, "s0", ignore_eos=True)
    )
    await col.wait_for(lambda: col.finished == set(ids))
    assert [col.tokens[f"g{i}"] for i in range(len(greedy))] == greedy
    assert col.tokens["s0"] == sampled
    assert col.threads == {threading.get_ident()}  # outputs delivered on the loop's thread
    assert not col.errors
    # A call runs in the worker thread and returns its value here.
    assert await worker.call(threading.get_ident) != threading.get_ident()
    assert await worker.call(lambda: engine.num_unfinished) == 0
    await worker.close()
    assert not worker.alive and worker_threads() == []
    engine.close()
    reference.close()


async def test_after_step_sees_each_steps_outputs_in_the_engine_thread_before_the_loop(tiny):
    model, tok = tiny
    col = Collector()
    seen: list[tuple[int, tuple[str, ...], bool]] = []  # (thread, ended ids, the loop has them)

    def after_step(outputs) -> None:
        if any(o.finished for o in outputs):
            done = tuple(o.request_id for o in outputs if o.finished)
            seen.append((threading.get_ident(), done, any(r in col.finished for r in done)))
        raise RuntimeError("a failing hook")  # logged: the outputs still reach the loop

    engine = Engine(model, tok, num_blocks=64, block_size=4)
    worker = EngineWorker(
        engine, col.on_outputs, name="test-after", on_error=col.on_error, after_step=after_step
    )
    for i, p in enumerate(prompts(tok)[:2]):
        await worker.call(engine.add_request, p, 3 + 4 * i, None, f"r{i}", ignore_eos=True)
    await col.wait_for(lambda: col.finished == {"r0", "r1"})
    # each request's end was seen in the engine thread, before the loop had it
    assert [done for _, done, _ in seen] == [("r0",), ("r1",)]
    assert not any(loop_had_it for _, _, loop_had_it in seen)
    assert {thread for thread, _, _ in seen} == {await worker.call(threading.get_ident)}
    assert not col.errors
    await worker.close()
    engine.close()


async def test_loop_stays_responsive_during_a_long_step(tiny):
    engine, worker, col = started(
        tiny, "test-responsive", num_blocks=512, block_size=16, max_num_batched_tokens=4096
    )
    ticks_during_step = 0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal ticks_during_step
        while not stop.is_set():
            await asyncio.sleep(0.005)  # the loop's heartbeat: what the test counts
            ticks_during_step += worker.in_step

    task = asyncio.create_task(ticker())
    long_prompt = [i % 250 for i in range(1, 1500)]  # one big prefill step
    rid = await worker.call(engine.add_request, long_prompt, 3, None, "long", ignore_eos=True)
    await col.wait_for(lambda: rid in col.finished)
    stop.set()
    await task
    assert ticks_during_step > 0, "the loop never ran while the engine was stepping"
    assert len(col.tokens[rid]) == 3
    await worker.close()
    assert worker_threads() == []
    engine.close()


async def test_exceptions_reach_the_loop_and_the_thread_survives(tiny):
    engine, worker, col = started(tiny, "test-errors")
    # A failing call raises here, in the caller.
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await worker.call(engine.add_request, [10_000], 4)
    # A failing step goes to on_error on the loop; the worker keeps serving afterwards.
    real_step = engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("simulated forward failure")
        return real_step()

    engine.step = flaky_step  # type: ignore[method-assign]
    await worker.call(engine.add_request, prompts(tiny[1])[1], 4, None, "after", ignore_eos=True)
    await col.wait_for(lambda: col.errors)
    assert "simulated forward failure" in str(col.errors[0]) and worker.num_errors == 1
    assert worker.alive
    worker.wake()  # the loop decides to retry
    await col.wait_for(lambda: "after" in col.finished)
    assert len(col.tokens["after"]) == 4
    await worker.close()
    with pytest.raises(WorkerClosed):
        await worker.call(lambda: engine.num_unfinished)
    await worker.close()  # idempotent
    assert worker_threads() == []
    engine.close()


async def test_no_spin_when_no_progress_is_possible(tiny):
    engine, worker, col = started(tiny, "test-held")
    # A held request with its prompt computed has nothing to do until released.
    rid = await worker.call(
        engine.add_request, prompts(tiny[1])[0], 4, None, "held", hold=True, ignore_eos=True
    )

    async def prompt_computed() -> bool:  # asked on the worker's thread, between its steps
        return not await worker.call(engine.has_work)

    await wait_for(prompt_computed, 10, "the held request's prompt to be computed")
    steps = worker.num_steps
    await asyncio.sleep(0.2)  # a deliberately idle period: no step may run in it
    assert worker.num_steps == steps, "the worker kept stepping with nothing to do"
    await worker.call(engine.set_hold, rid, False)
    await col.wait_for(lambda: rid in col.finished)
    assert len(col.tokens[rid]) == 4
    await worker.close()
    engine.close()


async def test_close_fails_queued_calls_and_leaves_no_thread(tiny):
    engine, worker, col = started(
        tiny, "test-close", num_blocks=512, block_size=16, max_num_batched_tokens=4096
    )
    await worker.call(
        engine.add_request, [i % 250 for i in range(1, 1200)], 50, None, "busy", ignore_eos=True
    )
    pending = asyncio.ensure_future(worker.call(lambda: engine.num_unfinished))
    await worker.close()
    result = await asyncio.gather(pending, return_exceptions=True)
    assert isinstance(result[0], (int, WorkerClosed))  # ran before the stop, or was refused
    assert not worker.alive and worker_threads() == []
    with pytest.raises(ValueError):
        EngineWorker(engine, col.on_outputs, threads=0)
    engine.close()


async def test_a_broken_engine_is_reported_and_later_calls_fail_fast(tiny):
    engine, worker, col = started(tiny, "test-broken")
    engine.close()  # a real fault: the KV pool is gone, so the next step fails
    engine.scheduler.has_work = None  # and the scheduler itself is broken: has_work() raises
    worker.wake()
    await col.wait_for(lambda: col.errors)
    assert isinstance(col.errors[0], TypeError)
    await wait_for(lambda: not worker.alive, 2, "the broken worker to stop", step=0.01)
    assert not worker.alive
    with pytest.raises(WorkerClosed):
        await worker.call(lambda: 1)
    await worker.close()
    assert worker_threads() == []
