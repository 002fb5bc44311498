"""A bounded soak: N concurrent clients for T seconds against a real cluster, with cancels
mixed in (a streamed request abandoned after a few chunks). Afterwards every KV pool is back
to empty, no request is held anywhere, fds (and tasks, where a daemon reports them) are back to
the baseline, and each daemon's RSS grew by at most RSS_BOUND_MIB over its post-warm-up value.

Small by default (CI): PDD_SOAK_CLIENTS=4 clients for PDD_SOAK_SECONDS=8 s. The heavy case
(`--heavy`) runs 8 clients for 60 s; either env var overrides both cases' values.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import aiohttp
import pytest

from pddnet.cluster.local import LocalCluster
from tests.chaos.harness import (
    REPORT,
    Answer,
    CaseResult,
    Outcome,
    find_leaks,
    fresh_requests,
    install_report,
    judge,
    mixed_workload,
    outcome_of,
    precompute_references,
    reference_tokens,
    send,
    snapshot,
    token_diff,
)

RSS_BOUND_MIB = 64  # allowed RSS growth per daemon over the run (after warm-up)
MAX_REQUESTS_PER_CLIENT = 400
CANCEL_SHARE = 0.25
SEED = 31


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


async def _cancel_mid_stream(
    session: aiohttp.ClientSession, url: str, index: int, body: dict, after_chunks: int
) -> Outcome:
    """A client that goes away after `after_chunks` chunks: what it read must be a prefix of
    the reference (no duplicate, no skip); the router then frees the request everywhere."""
    want = reference_tokens(body)
    tokens: list[int] = []
    async with session.post(url + "/v1/completions", json={"model": "tiny", **body}) as r:
        if r.status != 200:
            return judge(index, body, Answer([], await r.json(content_type=None), r.status))
        chunks = 0
        async for raw in r.content:
            line = raw.strip()
            if line.startswith(b"data: {") and b'"error"' not in line:
                import json

                tokens += json.loads(line[6:])["choices"][0].get("token_ids", [])
                chunks += 1
                if chunks >= after_chunks:
                    break
        r.close()
    dup, skip, repl = token_diff(want, tokens, complete=False)
    status = "wrong" if dup or skip or repl else "cancelled"
    read = Answer(tokens, http_status=None, detail="cancelled by the client mid-stream")
    out = outcome_of(index, body, read, status, len(want))
    out.duplicated, out.skipped, out.replaced = dup, skip, repl
    return out


async def soak(clients: int, seconds: float, case: str) -> CaseResult:
    pool = mixed_workload(
        48, SEED, long_prompt=(100, 400), short_prompt=(4, 40), max_tokens=(4, 80)
    )
    for b in pool:
        b["stream"] = b["stream"] or b["max_tokens"] > 40
    precompute_references(pool)
    started = time.monotonic()
    result = CaseResult(suite="soak", case=case, fault_kind="cancels", seed=SEED)
    async with LocalCluster(mode="pdd", wan="proxy", rtt_ms=10.0, bw_mbit=50.0) as cluster:
        warm = await fresh_requests(cluster)  # first-use allocations happen here
        assert all(o.status == "exact" for o in warm), [o.describe() for o in warm]
        baseline = await snapshot(cluster)
        rss0 = {r: _rss_mib(d.pid) for r, d in cluster.daemons.items()}
        deadline = time.monotonic() + seconds
        cancels = 0

        async def client(n: int) -> list[Outcome]:
            nonlocal cancels
            rng = random.Random(SEED * 1000 + n)
            out = []
            async with aiohttp.ClientSession() as session:
                for i in range(MAX_REQUESTS_PER_CLIENT):
                    if time.monotonic() >= deadline:
                        break
                    body = rng.choice(pool)
                    index = n * MAX_REQUESTS_PER_CLIENT + i
                    if body["stream"] and rng.random() < CANCEL_SHARE:
                        cancels += 1
                        out.append(
                            await _cancel_mid_stream(
                                session, cluster.url, index, body, rng.randint(1, 3)
                            )
                        )
                    else:
                        out.append(await send(session, cluster.url, index, body))
            return out

        per_client = await asyncio.gather(*(client(n) for n in range(clients)))
        result.add([o for outs in per_client for o in outs])
        result.leaks = await find_leaks(cluster, baseline)
        fresh = await fresh_requests(cluster)
        result.add(fresh)
        result.fresh_ok = all(o.status == "exact" for o in fresh)
        growth = {r: round(_rss_mib(d.pid) - rss0[r], 1) for r, d in cluster.daemons.items()}
        result.notes.append(
            f"RSS growth MiB {growth} (bound {RSS_BOUND_MIB}); {cancels} cancelled mid-stream"
        )
        result.leaks += [
            f"{r}: RSS grew {g} MiB (bound {RSS_BOUND_MIB} MiB)"
            for r, g in growth.items()
            if g > RSS_BOUND_MIB
        ]
        router = await cluster.stats("router")
        if router["active_requests"]:
            result.leaks.append(f"router: {router['active_requests']} requests still active")
        result.duration_s = round(time.monotonic() - started, 2)
        REPORT.add(result)
        result.assert_invariants(logs=cluster.run_dir / "logs")
    return result


@pytest.fixture(autouse=True)
def _report(request: pytest.FixtureRequest) -> None:
    install_report(request.config)


@pytest.mark.timeout(150)
async def test_soak_small():
    clients = int(os.environ.get("PDD_SOAK_CLIENTS", "4"))
    seconds = float(os.environ.get("PDD_SOAK_SECONDS", "8"))
    result = await soak(clients, seconds, f"soak {clients} clients x {seconds:g} s")
    assert result.sent >= clients, "every client sent at least one request"
    assert result.cancelled > 0, "some requests were cancelled mid-stream"


@pytest.mark.heavy
@pytest.mark.timeout(600)
async def test_soak_long():
    clients = int(os.environ.get("PDD_SOAK_CLIENTS", "8"))
    seconds = float(os.environ.get("PDD_SOAK_SECONDS", "60"))
    await soak(clients, seconds, f"soak {clients} clients x {seconds:g} s")
