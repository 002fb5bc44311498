"""The chaos report's fault figures without a cluster: which requests count as affected and
what they added, and that the /health poller keeps the router's first non-200 answer."""

from __future__ import annotations

import time

import pytest
from aiohttp import web

import tests.chaos.harness as harness
from tests.chaos.harness import HealthWatch, Outcome, added_latency, after, link_chaos
from tests.polling import wait_for


def _done(
    index: int, start: float, end: float, status: str = "exact", md_tokens: int = 0
) -> Outcome:
    return Outcome(
        index=index,
        status=status,
        tokens=[],
        expected_len=0,
        started_at=start,
        ended_at=end,
        pdd={"main_tokens": md_tokens},
    )


def test_added_latency_counts_requests_in_flight_at_the_fault_or_before_recovery():
    outcomes = [
        _done(0, 0.0, 1.0),  # over before the fault: not affected
        _done(1, 0.5, 4.0),  # in flight at the fault (t=2)
        _done(2, 3.0, 5.0, md_tokens=9),  # started after the fault, before recovery
        _done(3, 7.0, 8.0),  # started after recovery: not affected
        _done(4, 1.0, 3.0, "clear_error"),
    ]  # affected, but nothing to compare
    twins = [_done(i, 10.0, 10.0 + d, "completed") for i, d in enumerate([1.0, 1.5, 2.5, 1, 1])]
    lat = added_latency(outcomes, twins, injected_at=2.0, recovered_at=6.0)
    assert (lat["affected"], lat["compared"]) == (3, 2)
    assert [r["added_s"] for r in lat["requests"]] == [None, 2.0, -0.5, None, None]
    assert lat["added_p50_s"] == 0.75 and lat["added_max_s"] == 2.0
    assert lat["handoff_changed"] == 1  # request 2 went to MD, its twin did not


def test_added_latency_without_an_injected_fault_or_twins():
    outcomes = [_done(0, 0.0, 1.0)]
    assert added_latency(outcomes, None, None, None)["affected"] == 0
    whole = added_latency(outcomes, None, None, None, whole_workload=True)
    assert whole["affected"] == 1 and whole["added_p50_s"] is None


@pytest.mark.asyncio(loop_scope="session")
async def test_health_watch_keeps_the_first_unready_answer():
    state = {"ok": True}

    async def health(request: web.Request) -> web.Response:
        if state["ok"]:
            return web.json_response({"status": "ok"})
        return web.json_response({"waiting_for": ["prefill: main-decode control down"]}, status=503)

    app = web.Application()
    app.router.add_get("/health", health)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    watch = HealthWatch(f"http://127.0.0.1:{port}", period_s=0.01)
    try:
        watch.start()
        await wait_for(lambda: watch.polls >= 2, 5, "the watch to poll a healthy router", 0.01)
        fault_at = time.monotonic()
        state["ok"] = False
        await wait_for(lambda: watch.unready, 2, "the watch to see the router unready", 0.01)
    finally:
        await watch.stop()
        await runner.cleanup()
    hit = watch.first_unready(fault_at)
    assert hit is not None and hit[1] == 503 and "main-decode" in hit[2]
    assert 0 <= hit[0] - fault_at < 1.0
    assert watch.first_unready(time.monotonic() + 1) is None


@pytest.mark.asyncio(loop_scope="session")
async def test_link_fault_marks_its_injection_and_heal(monkeypatch):
    class FakeControl:
        async def chaos(self, kind: str, duration: float, **params: object) -> dict:
            return {}

    monkeypatch.setattr(harness, "control", lambda cluster: FakeControl())
    fault = link_chaos("partition", after(0), duration=0.05)
    await fault.inject(None)
    assert fault.injected_at is not None and fault.healed_at is not None
    assert fault.healed_at - fault.injected_at >= 0.05
