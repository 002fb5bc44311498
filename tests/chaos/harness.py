"""The chaos harness: a bounded mixed workload through the router, one fault injected at a chosen
moment, and the invariants of DESIGN.md section 4 checked afterwards.

    result = await run_case(cluster, "partition 2 s", "partition", bodies, fault)
    result.assert_invariants()          # raises with every broken invariant and the seed

Every request ends in exactly one of these outcomes:
  exact         completed, token-exact against the colocated reference engine
  clear_error   failed with an OpenAI-style error naming the cause ({"error": {"message",
                "type", "code"}}, HTTP status >= 400 or one SSE error event before [DONE]), and
                the tokens streamed before the error are a prefix of the reference
  wrong         tokens differ from the reference (duplicated, skipped or different ids)
  unclear_error failed, but not with a clear OpenAI-style error
  lost          no answer within CLIENT_TIMEOUT_S (a hang), or the connection dropped without
                an error or [DONE]
After the workload (and the healing of the fault): no KV block, request, shared-memory segment,
socket/fd (or task, where a daemon reports a task count) is left on any daemon beyond the
baseline taken before the fault, and a fresh request is served token-exact.

Results go to the process-wide REPORT; `install_report(config)` makes pytest print its table at
the end of the run and write it as JSON under results/chaos/.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import json
import os
import random
import signal
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from pddnet.cluster.local import LocalCluster
from pddnet.kv.shm import segments_of, unlink_segment
from tests.polling import wait_for

ROOT = Path(__file__).resolve().parents[2]
RESULTS_DIR = ROOT / "results" / "chaos"
MODEL = "tiny"
# A request with no answer after this long counts as lost (hung). Far above any request of the
# workloads here (the longest needs a few seconds on a busy 2-core box), far below pytest's timeout.
CLIENT_TIMEOUT_S = 60.0
LEAK_TIMEOUT_S = 20.0  # how long daemons get to free what ended requests held
HEALTH_TIMEOUT_S = 30.0  # how long a healed cluster gets until /health is ok again
# fds: a closing connection's socket can outlive the request by a moment on either side, and a
# stats refresh or /health probe of our own may be open while we count.
FD_SLACK = 3
# Per-connection tasks (outboxes, heartbeats, readers) come and go with redials: a leak shows as
# growth with the number of requests, well past this.
TASK_SLACK = 6
DAEMON_ROLES = ("prefill", "relay", "main_decode")
CLEAR_ERROR_TYPES = (
    "invalid_request_error",
    "server_error",
    "rate_limit_error",
    "authentication_error",
    "permission_error",
    "not_found_error",
)


# -- the reference ---------------------------------------------------------------------------------

_REFERENCE: dict[str, list[int]] = {}
_MODEL: list[Any] = []


def reference_tokens(body: dict[str, Any]) -> list[int]:
    """The colocated reference engine's tokens for a request body (cached)."""
    key = _reference_key(body)
    if key not in _REFERENCE:
        _REFERENCE[key] = _generate(body)
    return _REFERENCE[key]


def _reference_key(body: dict[str, Any]) -> str:
    keys = ("prompt", "max_tokens", "temperature", "top_p", "top_k", "seed", "ignore_eos")
    return json.dumps({k: body.get(k) for k in keys}, sort_keys=True)


def _generate(body: dict[str, Any]) -> list[int]:
    from pddnet.engine.engine import Engine
    from pddnet.engine.sampling import SamplingParams
    from pddnet.model.loader import load_model

    if not _MODEL:
        _MODEL.append(load_model(MODEL))
    model, tok = _MODEL[0]
    engine = Engine(model, tok, num_blocks=256, block_size=16)
    try:
        sp = SamplingParams(
            temperature=body["temperature"],
            top_p=body.get("top_p", 1.0),
            top_k=body.get("top_k", 0),
            seed=body.get("seed"),
        )
        return engine.generate(
            body["prompt"], body["max_tokens"], sp, ignore_eos=body.get("ignore_eos", False)
        )
    finally:
        engine.close()


def _generate_in_helper(bodies: list[dict[str, Any]], torch_threads: int) -> list[list[int]]:
    """A spawned helper's share of precompute_references (the same thread count as the test
    process: the reference must not depend on which process computed it)."""
    import torch

    torch.set_num_threads(torch_threads)
    return [_generate(b) for b in bodies]


# -- the workload ----------------------------------------------------------------------------------


def sampling_fields(rng: random.Random, seeded: bool, temperature: float) -> dict[str, Any]:
    """A body's sampling: greedy, or seeded sampling at `temperature` with top_p and top_k drawn
    from `rng` (so both kinds of request check the daemons against the reference engine)."""
    if not seeded:
        return {"temperature": 0.0}
    return {
        "temperature": temperature,
        "top_p": rng.choice([1.0, 0.9]),
        "top_k": rng.choice([0, 40]),
        "seed": rng.randrange(2**63),
    }


def mixed_workload(
    n: int,
    seed: int,
    long_prompt: tuple[int, int] = (200, 500),
    short_prompt: tuple[int, int] = (4, 60),
    max_tokens: tuple[int, int] = (8, 160),
    first_prompt: int | None = None,
) -> list[dict[str, Any]]:
    """`n` request bodies: long prompts (KV that takes a while to cross) alternate with short
    ones, streamed and whole, greedy and seeded sampling, mostly ignore_eos so outputs are long
    enough to be handed over. `first_prompt`: the first request's prompt length (a copy that
    is sure to be crossing the WAN for a while). A pure function of `seed`."""
    rng = random.Random(seed)
    bodies = []
    for i in range(n):
        lo, hi = long_prompt if i % 2 == 0 else short_prompt
        plen = rng.randint(lo, hi) if i or first_prompt is None else first_prompt
        prompt = [256] + [rng.randrange(256) for _ in range(plen)]
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": rng.randint(*max_tokens),
            "ignore_eos": rng.random() < 0.85,
            "return_token_ids": True,
            "stream": i % 3 != 2,
            **sampling_fields(rng, seeded=i % 2 == 1, temperature=0.8),
        }
        bodies.append(body)
    return bodies


# A helper process needs ~3 s (torch, the model) before its first token, about this many tokens
# of the reference engine: below twice that a batch is computed here alone.
HELPER_START_TOKENS = 750


def precompute_references(bodies: list[dict[str, Any]]) -> None:
    """Compute references before a cluster takes the cores (and before any timing matters).

    The reference engine runs on one core, so a large batch is split with one spawned helper
    process, which takes the other core; each request is still computed on its own."""
    todo = {_reference_key(b): b for b in bodies}
    todo = {k: b for k, b in todo.items() if k not in _REFERENCE}
    cost = {k: b["max_tokens"] + len(b["prompt"]) // 16 for k, b in todo.items()}
    total = sum(cost.values())
    if total < 2 * HELPER_START_TOKENS:
        for b in todo.values():
            reference_tokens(b)
        return
    # the helper's share: the costliest first until it has half of what is left after its start
    helper: list[str] = []
    share = 0
    for k in sorted(todo, key=cost.__getitem__, reverse=True):
        if share + cost[k] <= (total - HELPER_START_TOKENS) / 2:
            helper.append(k)
            share += cost[k]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    import torch

    ctx = multiprocessing.get_context("spawn")  # never fork a process that holds torch threads
    with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:
        done = pool.submit(_generate_in_helper, [todo[k] for k in helper], torch.get_num_threads())
        for k, b in todo.items():
            if k not in helper:
                reference_tokens(b)
        _REFERENCE.update(zip(helper, done.result(), strict=True))


# -- one request -----------------------------------------------------------------------------------


@dataclass
class Outcome:
    index: int
    status: str  # exact | clear_error | cancelled | wrong | unclear_error | lost
    tokens: list[int]
    expected_len: int
    http_status: int | None = None
    error: dict[str, Any] | None = None
    duplicated: int = 0
    skipped: int = 0
    replaced: int = 0
    detail: str = ""
    prompt_len: int = 0
    stream: bool = False
    pdd: dict[str, Any] | None = None
    started_at: float | None = None  # time.monotonic() when the request was sent
    ended_at: float | None = None  # ... and when its answer ended (or was given up on)

    @property
    def latency_s(self) -> float | None:
        if self.started_at is None or self.ended_at is None:
            return None
        return self.ended_at - self.started_at

    def describe(self) -> str:
        brief = {}
        if self.pdd:
            brief = {
                k: self.pdd.get(k)
                for k in (
                    "request_id",
                    "pipeline",
                    "handoff_mode",
                    "relay_tokens",
                    "main_tokens",
                    "prefill_tokens",
                )
            }
        return (
            f"request {self.index} ({self.prompt_len}-token prompt, "
            f"{'stream' if self.stream else 'whole'}): {self.status}; got {len(self.tokens)}"
            f"/{self.expected_len} tokens, dup {self.duplicated}, skip {self.skipped}, "
            f"replaced {self.replaced}; HTTP {self.http_status}; error {self.error}; "
            f"{self.detail} {brief}".strip()
        )


def token_diff(want: list[int], got: list[int], complete: bool) -> tuple[int, int, int]:
    """(duplicated, skipped, replaced) tokens of `got` against `want`. For a request that failed
    (`complete` False) `got` only has to be a prefix, so missing tokens at the end are fine."""
    if got == want or (not complete and got == want[: len(got)]):
        return 0, 0, 0
    ops = difflib.SequenceMatcher(a=want, b=got, autojunk=False).get_opcodes()
    if not complete and ops and ops[-1][0] == "delete":
        ops = ops[:-1]
    dup = sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag == "insert")
    skip = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag == "delete")
    repl = sum(max(i2 - i1, j2 - j1) for tag, i1, i2, j1, j2 in ops if tag == "replace")
    return dup, skip, repl


def is_clear_error(err: Any, need_code: bool = True) -> bool:
    """OpenAI's error shape with a message and (for server-side failures) a code naming the
    cause: {"error": {"message": "...", "type": "...", "param": ..., "code": "..."}}."""
    if not isinstance(err, dict) or not isinstance(err.get("error"), dict):
        return False
    e = err["error"]
    message, kind, code = e.get("message"), e.get("type"), e.get("code")
    if not isinstance(message, str) or len(message.strip()) < 8:
        return False
    if kind not in CLEAR_ERROR_TYPES or "param" not in e:
        return False
    return not need_code or (isinstance(code, str) and bool(code))


@dataclass
class Answer:
    """What the client got for one request, before a verdict: the token ids, the error (None
    when the answer ended well), the HTTP status, the router's pdd object and a note."""

    tokens: list[int]
    error: dict[str, Any] | None = None
    http_status: int | None = 200
    pdd: dict[str, Any] | None = None
    detail: str = ""


def outcome_of(
    index: int, body: dict[str, Any], answer: Answer, status: str, expected_len: int
) -> Outcome:
    """The Outcome of request `index`, with what every verdict records of its body and answer."""
    return Outcome(
        index=index,
        status=status,
        tokens=answer.tokens,
        expected_len=expected_len,
        http_status=answer.http_status,
        error=answer.error,
        detail=answer.detail,
        prompt_len=len(body["prompt"]),
        stream=bool(body.get("stream")),
        pdd=answer.pdd,
    )


def judge(index: int, body: dict[str, Any], answer: Answer) -> Outcome:
    """Against the reference engine's tokens: exact, a clear or unclear error, or wrong."""
    want = reference_tokens(body)
    tokens, error, pdd = answer.tokens, answer.error, answer.pdd
    dup, skip, repl = token_diff(want, tokens, error is None)
    out = outcome_of(index, body, answer, "exact", len(want))
    out.duplicated, out.skipped, out.replaced = dup, skip, repl
    if dup or skip or repl:
        out.status = "wrong"
    elif error is not None:
        out.status = "clear_error" if is_clear_error(error) else "unclear_error"
    elif tokens != want:
        out.status = "wrong"
    elif pdd is not None:
        made = pdd.get("relay_tokens", 0) + pdd.get("main_tokens", 0) + pdd.get("prefill_tokens", 0)
        if made != len(tokens):  # the router counted an index twice or not at all
            out.status = "wrong"
            out.detail += f" producers account for {made} tokens, the stream has {len(tokens)}"
    return out


Verdict = Callable[[int, dict[str, Any], Answer], Outcome]


def count_only(index: int, body: dict[str, Any], answer: Answer) -> Outcome:
    """A verdict without the reference engine (for the no-fault latency pass, whose bodies
    have no precomputed reference): "completed" when all max_tokens came without an error."""
    ok = answer.error is None and len(answer.tokens) == body["max_tokens"]
    return outcome_of(index, body, answer, "completed" if ok else "failed", body["max_tokens"])


async def send(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    body: dict[str, Any],
    read_late_s: float = 0.0,
    read_pause_s: float = 0.0,
    timeout_s: float = CLIENT_TIMEOUT_S,
    verdict: Verdict = judge,
) -> Outcome:
    """One completion through the router, judged (by `verdict`), with its start and end times.
    `read_late_s`: a slow client that starts reading the stream only that long after the
    answer began; `read_pause_s` between chunks."""
    started = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            out = await _send(session, url, index, body, read_late_s, read_pause_s, verdict)
    except TimeoutError:
        why = f"no answer within {timeout_s:g} s: the request hung"
        out = _lost(index, body, Answer([], http_status=None, detail=why), verdict)
    except (aiohttp.ClientError, ConnectionError, ValueError) as exc:
        why = f"the connection ended without an answer: {type(exc).__name__}: {exc}"
        out = _lost(index, body, Answer([], http_status=None, detail=why), verdict)
    out.started_at, out.ended_at = started, time.monotonic()
    return out


def _lost(index: int, body: dict[str, Any], answer: Answer, verdict: Verdict) -> Outcome:
    """A request whose answer never ended: lost, whatever the verdict."""
    expected = len(reference_tokens(body)) if verdict is judge else body["max_tokens"]
    return outcome_of(index, body, answer, "lost", expected)


async def _send(
    session: aiohttp.ClientSession,
    url: str,
    index: int,
    body: dict[str, Any],
    read_late_s: float,
    read_pause_s: float,
    verdict: Verdict = judge,
) -> Outcome:
    payload = {"model": MODEL, **body}
    async with session.post(url + "/v1/completions", json=payload) as r:
        if r.status != 200:
            text = await r.text()
            try:
                err = json.loads(text)
            except ValueError:
                err = {"unparsed": text[:500]}
            return verdict(index, body, Answer([], err, r.status))
        if not body.get("stream"):
            data = await r.json()
            choice = data["choices"][0]
            return verdict(index, body, Answer(list(choice["token_ids"]), pdd=data.get("pdd")))
        if read_late_s:
            await asyncio.sleep(read_late_s)
        tokens: list[int] = []
        error = last = None
        done = False
        async for raw in r.content:
            line = raw.strip()
            if not line:
                continue
            if not line.startswith(b"data: "):
                unparsed = {"unparsed": line[:200].decode(errors="replace")}
                why = "a stream line that is not an SSE data event"
                return verdict(index, body, Answer(tokens, unparsed, detail=why))
            data = line[6:]
            if data == b"[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk
                continue
            tokens += chunk["choices"][0].get("token_ids", [])
            last = chunk
            if read_pause_s:
                await asyncio.sleep(read_pause_s)
        if not done:
            cut = Answer(tokens, error, detail="the stream ended without [DONE]")
            return _lost(index, body, cut, verdict)
        if error is None and (last is None or last["choices"][0].get("finish_reason") is None):
            unended = {"unparsed": "no finish_reason"}
            why = "[DONE] without a final chunk"
            return verdict(index, body, Answer(tokens, unended, detail=why))
        return verdict(index, body, Answer(tokens, error, pdd=(last or {}).get("pdd")))


# -- daemon state: the leak baseline ---------------------------------------------------------------


def _count_fds(pid: int) -> tuple[int, int]:
    """(open fds, of which sockets) of a process, from /proc."""
    fd_dir = f"/proc/{pid}/fd"
    fds = sockets = 0
    for name in os.listdir(fd_dir):
        fds += 1
        with contextlib.suppress(OSError):
            if os.readlink(os.path.join(fd_dir, name)).startswith("socket:"):
                sockets += 1
    return fds, sockets


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


@dataclass
class DaemonState:
    role: str
    pid: int
    fds: int
    sockets: int
    threads: int
    tasks: int | None  # a daemon's asyncio task count, where its stats report one
    stats: dict[str, Any]


async def daemon_state(cluster: LocalCluster, role: str) -> DaemonState:
    pid = cluster.daemons[role].pid
    stats = await cluster.stats(role)
    fds, sockets = _count_fds(pid)
    threads = len(os.listdir(f"/proc/{pid}/task"))
    tasks = stats.get("tasks")
    return DaemonState(
        role, pid, fds, sockets, threads, tasks if isinstance(tasks, int) else None, stats
    )


async def snapshot(cluster: LocalCluster) -> dict[str, DaemonState]:
    return {role: await daemon_state(cluster, role) for role in cluster.daemons}


def _held(role: str, stats: dict[str, Any]) -> list[str]:
    """What a daemon's stats say it still holds for requests (should be nothing when idle)."""
    out = []
    if role == "router":
        if stats.get("active_requests"):
            out.append(f"router: {stats['active_requests']} requests still active")
        return out
    used = stats.get("kv_blocks", {}).get("used", 0)
    if used:
        out.append(f"{role}: {used} KV blocks still used")
    active = stats.get("requests", {}).get("active", 0)
    if active:
        out.append(
            f"{role}: {active} requests still active (phases {stats.get('active_phases', {})})"
        )
    if stats.get("early_takeovers_waiting"):
        out.append(f"{role}: {stats['early_takeovers_waiting']} early TAKEOVERs still held")
    return out


async def find_leaks(
    cluster: LocalCluster,
    baseline: dict[str, DaemonState],
    dead_pids: set[int] = frozenset(),
    timeout_s: float = LEAK_TIMEOUT_S,
    ignore_roles: set[str] = frozenset(),
) -> list[str]:
    """Poll until nothing is held beyond `baseline`, or `timeout_s`: the leaks still there.
    `dead_pids`: daemons this case killed (their /dev/shm segments must be gone as well)."""
    deadline = time.monotonic() + timeout_s
    while True:
        leaks: list[str] = []
        for role, d in cluster.daemons.items():
            if role in ignore_roles:
                continue
            if not pid_alive(d.pid):
                leaks.append(f"{role} (pid {d.pid}) is not running")
                continue
            try:
                now = await daemon_state(cluster, role)
            except (RuntimeError, TimeoutError, OSError, aiohttp.ClientError) as exc:
                leaks.append(f"{role}: no stats: {exc}")
                continue
            leaks += _held(role, now.stats)
            base = baseline.get(role)
            if base is None or base.pid != now.pid:
                continue  # restarted: a new process has no earlier requests to leak
            if now.fds > base.fds + FD_SLACK:
                leaks.append(
                    f"{role}: {now.fds} fds open ({now.sockets} sockets), "
                    f"{base.fds} ({base.sockets} sockets) before"
                )
            if (
                now.tasks is not None
                and base.tasks is not None
                and now.tasks > base.tasks + TASK_SLACK
            ):
                leaks.append(f"{role}: {now.tasks} asyncio tasks, {base.tasks} before")
        live = [d.pid for d in cluster.daemons.values() if pid_alive(d.pid)]
        extra = segments_of(sorted(p for p in dead_pids if not pid_alive(p)))
        relay_pids = [d.pid for r, d in cluster.daemons.items() if r == "relay"]
        live_segments = segments_of(live)
        pools = segments_of(relay_pids)
        if extra:
            leaks.append(f"/dev/shm segments of killed daemons left: {extra}")
        if len(live_segments) > len(pools) or len(pools) > len(relay_pids):
            leaks.append(f"/dev/shm segments beyond RLD's one pool: {live_segments}")
        if not leaks or time.monotonic() > deadline:
            return leaks
        await asyncio.sleep(0.3)


def remove_segments_of(pids: set[int]) -> list[str]:
    """Unlink /dev/shm segments of daemons we killed (after counting them): nothing of ours
    may stay on the machine, and the launcher only cleans up after the daemons it still knows."""
    names = segments_of(sorted(p for p in pids if not pid_alive(p)))
    for name in names:
        unlink_segment(name)
    return names


# -- recovery --------------------------------------------------------------------------------------


async def wait_healthy(cluster: LocalCluster, timeout_s: float = HEALTH_TIMEOUT_S) -> str | None:
    """None once the router's /health is ok, else what it last said."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as s:
        while time.monotonic() < deadline:
            try:
                async with s.get(cluster.url + "/health") as r:
                    if r.status == 200:
                        return None
                    last = f"HTTP {r.status}: {await r.text()}"
            except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            await asyncio.sleep(0.2)
    return last


FRESH_BODIES = [
    {
        "prompt": [256] + list(range(40, 160)),
        "max_tokens": 24,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    },
    {
        "prompt": [256] + list(range(10, 30)),
        "max_tokens": 12,
        "temperature": 0.7,
        "seed": 11,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": False,
    },
]


async def fresh_requests(cluster: LocalCluster) -> list[Outcome]:
    """After healing: /health ok, then new requests (one streamed, one whole) token-exact."""
    unhealthy = await wait_healthy(cluster)
    if unhealthy is not None:
        return [
            Outcome(
                index=-1,
                status="lost",
                tokens=[],
                expected_len=0,
                detail=f"router /health not ok within {HEALTH_TIMEOUT_S:g} s: {unhealthy}",
            )
        ]
    async with aiohttp.ClientSession() as s:
        return [await send(s, cluster.url, -1 - i, b) for i, b in enumerate(FRESH_BODIES)]


async def restart_daemon(cluster: LocalCluster, role: str, timeout_s: float = 60.0) -> None:
    """Start a killed daemon again with the same config and port, and wait until it serves."""
    old = cluster.launcher.daemons[role]
    if pid_alive(old.pid):
        raise RuntimeError(f"{role} (pid {old.pid}) is still running: kill it first")
    await cluster.restart(role, timeout_s)


# -- faults ----------------------------------------------------------------------------------------

Trigger = Callable[[LocalCluster], Awaitable[str]]


def after(seconds: float) -> Trigger:
    async def wait(cluster: LocalCluster) -> str:
        await asyncio.sleep(seconds)
        return f"{seconds:g} s after the workload started"

    return wait


def when_phase(
    role: str, phases: tuple[str, ...], settle_s: float = 0.0, poll_s: float = 0.05
) -> Trigger:
    """The moment a request on `role` is in one of `phases` (from its stats' active_phases):
    e.g. MD receiving_kv = mid-transfer / before handoff, RLD streaming = during a streaming
    handoff, MD decoding = after the handoff."""

    async def wait(cluster: LocalCluster) -> str:
        while True:
            stats = await cluster.stats(role)
            hit = {rid: p for rid, p in stats.get("active_phases", {}).items() if p in phases}
            if hit:
                if settle_s:
                    await asyncio.sleep(settle_s)
                rid, phase = next(iter(hit.items()))
                return f"{role} had {rid} in phase {phase}"
            await asyncio.sleep(poll_s)

    return wait


@dataclass
class Fault:
    """One fault: `inject` at the moment `at` says, `heal` afterwards (also on failure).

    `injected_at` / `healed_at` (time.monotonic()) are the moments the fault took effect and
    was undone (link effect reverted, stopped process continued, killed process restarted and
    serving); `inject` and `heal` mark them, as only they know when that happened. For a fault
    that does not mark, run_case takes "inject was called" as injected_at and reports no
    recovery time (it cannot know when the fault was undone)."""

    kind: str
    inject: Callable[[LocalCluster], Awaitable[str]]
    at: Trigger
    heal: Callable[[LocalCluster], Awaitable[None]] | None = None
    destructive: bool = False  # leaves the cluster unfit for further cases
    killed_roles: tuple[str, ...] = ()
    injected_at: float | None = None
    healed_at: float | None = None

    def mark_injected(self) -> None:
        self.injected_at = time.monotonic()

    def mark_healed(self) -> None:
        self.healed_at = time.monotonic()


def control(cluster: LocalCluster) -> Any:
    from emulation.control import ControlClient

    url = cluster.wan.get("control_url")
    if not url:
        raise RuntimeError(
            f"this cluster has no WAN control API (shell {cluster.wan.get('shell')})"
        )
    return ControlClient(url)


def link_chaos(kind: str, at: Trigger, duration: float, **params: Any) -> Fault:
    """A chaos verb of the WAN control API (partition, latency-spike, jitter-storm, ...)."""

    async def inject(cluster: LocalCluster) -> str:
        fault.mark_injected()
        await control(cluster).chaos(kind, duration, **params)
        extra = ", ".join(f"{k}={v}" for k, v in params.items())
        # The fault lasts this long: the emulator reverts it by itself `duration` after it
        # applied it, i.e. at most a local round trip before this sleep ends.
        await asyncio.sleep(duration)
        fault.mark_healed()
        return f"{kind} for {duration:g} s" + (f" ({extra})" if extra else "")

    async def heal(cluster: LocalCluster) -> None:
        c = control(cluster)
        with contextlib.suppress(Exception):
            await c.heal()
        await c.clear()
        if fault.injected_at is not None and fault.healed_at is None:
            fault.mark_healed()  # inject was cut short: the heal above undid the effect

    fault = Fault(kind=kind, inject=inject, at=at, heal=heal)
    return fault


def reset_connections(at: Trigger) -> Fault:
    async def inject(cluster: LocalCluster) -> str:
        fault.mark_injected()
        res = await control(cluster).reset_connections()
        fault.mark_healed()  # a reset is over once done: from here the daemons must redial
        return f"reset {res.get('reset')} WAN connections"

    fault = Fault(kind="connection-reset", inject=inject, at=at, destructive=True)
    return fault


def sigkill(role: str, at: Trigger, restart: bool = True) -> Fault:
    killed: set[int] = set()

    async def inject(cluster: LocalCluster) -> str:
        pid = cluster.daemons[role].pid
        fault.mark_injected()
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
        return f"SIGKILL {role} (pid {pid})"

    async def heal(cluster: LocalCluster) -> None:
        d = cluster.daemons[role]
        if d.proc.poll() is None and d.pid not in killed:
            return  # the moment never came: nothing was killed
        # The kernel reaps it at once; wait (at most 5 s, as a settle) for the zombie to go.
        with contextlib.suppress(AssertionError):
            await wait_for(lambda: d.proc.poll() is not None, 5, f"{role}'s zombie to go")
        if restart:
            await restart_daemon(cluster, role)
            fault.mark_healed()  # the new process serves (its peers may still be redialling)

    fault = Fault(
        kind=f"sigkill-{role}",
        inject=inject,
        at=at,
        heal=heal,
        destructive=True,
        killed_roles=(role,),
    )
    return fault


def sigstop(role: str, at: Trigger, hang_s: float) -> Fault:
    """Hang a daemon (SIGSTOP) for `hang_s`, then SIGCONT."""

    async def inject(cluster: LocalCluster) -> str:
        pid = cluster.daemons[role].pid
        fault.mark_injected()
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(hang_s)
        finally:
            os.kill(pid, signal.SIGCONT)
            fault.mark_healed()
        return f"SIGSTOP {role} (pid {pid}) for {hang_s:g} s, then SIGCONT"

    async def heal(cluster: LocalCluster) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(cluster.daemons[role].pid, signal.SIGCONT)

    fault = Fault(kind=f"sigstop-{role}", inject=inject, at=at, heal=heal)
    return fault


# -- fault figures: detection, recovery, added latency ---------------------------------------------

HEALTH_POLL_S = 0.05  # the /health poller's period while a case runs
HEALTH_POLL_MAX = 20000  # its bound on polls (~17 min at 50 ms, far beyond any case)
PROBE_GAP_S = 0.1  # between recovery probes that the cluster refused with a clear error


class HealthWatch:
    """Polls the router's GET /health every HEALTH_POLL_S while a case runs, keeping the
    router's non-200 answers: (arrival time, HTTP status, what it waited for first). A GET
    that gets no answer within 1 s is not a verdict (the router was busy, not unready)."""

    def __init__(self, url: str, period_s: float = HEALTH_POLL_S) -> None:
        self.url = url
        self.period_s = period_s
        self.polls = 0
        self.unready: list[tuple[float, int, str]] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as s:
            for _ in range(HEALTH_POLL_MAX):
                t = time.monotonic()
                try:
                    async with s.get(self.url + "/health") as r:
                        if r.status != 200:
                            body = await r.json(content_type=None)
                            waiting = body.get("waiting_for") if isinstance(body, dict) else None
                            first = waiting[0] if isinstance(waiting, list) and waiting else ""
                            self.unready.append((time.monotonic(), r.status, str(first)[:300]))
                except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                    pass
                self.polls += 1
                await asyncio.sleep(max(0.0, self.period_s - (time.monotonic() - t)))

    def first_unready(self, since: float) -> tuple[float, int, str] | None:
        """The first non-200 answer that arrived at or after `since`."""
        return next((u for u in self.unready if u[0] >= since), None)


def twin_body(body: dict[str, Any]) -> dict[str, Any]:
    """The no-fault twin of a request: the same prompt length, output length (the reference's,
    with ignore_eos so that it is exactly that), sampling and streaming, but other prompt token
    ids. Sending the very same body twice would let one of the two hit MD's radix cache (then
    less or no KV crosses the WAN, the mid-transfer moment may never come, and the latencies
    are not comparable); the tiny model's compute does not depend on the token values."""
    prompt = body["prompt"]
    rng = random.Random("twin:" + ",".join(map(str, prompt[:64])))
    # every token after the first moves by 1..255 (mod 256): no block of it matches the original
    twin = dict(body, prompt=[prompt[0]] + [(t + 1 + rng.randrange(255)) % 256 for t in prompt[1:]])
    made = len(reference_tokens(body))
    if made:
        twin.update(max_tokens=made, ignore_eos=True)
    return twin


def probe_body(case: str) -> dict[str, Any]:
    """The recovery probe of a case: a short streamed greedy request, its prompt drawn from the
    case's name so that it does not hit a cache left by another case's probe."""
    rng = random.Random("probe:" + case)
    return {
        "prompt": [256] + [rng.randrange(256) for _ in range(120)],
        "max_tokens": 24,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": True,
    }


async def no_fault_pass(
    cluster: LocalCluster,
    bodies: list[dict[str, Any]],
    concurrency: int,
    probe: dict[str, Any] | None = None,
) -> tuple[list[Outcome], Outcome | None]:
    """The twins of `bodies`, through the router `concurrency` at a time, as the case sends
    the originals: their latencies are the "without the fault" side of the added latency.
    Then `probe`'s twin alone: what a recovery probe costs on a healthy, idle cluster."""
    sem = asyncio.Semaphore(concurrency)
    twins = [twin_body(b) for b in bodies]

    async def one(i: int, body: dict[str, Any]) -> Outcome:
        async with sem:
            return await send(session, cluster.url, i, body, verdict=count_only)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        outs = list(await asyncio.gather(*(one(i, b) for i, b in enumerate(twins))))
        probe_twin = (
            await send(session, cluster.url, -99, twin_body(probe), verdict=count_only)
            if probe is not None
            else None
        )
    return outs, probe_twin


async def probe_recovery(
    cluster: LocalCluster, body: dict[str, Any], retry_for_s: float = HEALTH_TIMEOUT_S
) -> tuple[Outcome | None, int]:
    """Fresh requests from the moment a fault was healed, one at a time, until one is not
    refused with a clear error (the cluster saying it is not ready yet), for at most
    `retry_for_s`: (that outcome, attempts), or (None, attempts) when all were refused."""
    deadline = time.monotonic() + retry_for_s
    attempts = 0
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        while attempts == 0 or time.monotonic() < deadline:
            attempts += 1
            out = await send(session, cluster.url, -100 - attempts, body)
            if out.status != "clear_error":
                return out, attempts
            await asyncio.sleep(PROBE_GAP_S)
    return None, attempts


def added_latency(
    outcomes: list[Outcome],
    twins: list[Outcome] | None,
    injected_at: float | None,
    recovered_at: float | None,
    whole_workload: bool = False,
) -> dict[str, Any]:
    """Added latency of the affected requests: those in flight at the fault or started after
    it and before recovery (`whole_workload`: all, for a fault that lasts the whole workload,
    e.g. a slow client). Compared: affected requests that completed token-exact and whose twin
    completed too; added = latency - twin's latency (negative when the fault run was faster)."""
    per: list[dict[str, Any]] = []
    added: list[float] = []
    affected = changed = 0
    for o in outcomes:
        if o.started_at is None or o.ended_at is None:
            continue
        if whole_workload:
            hit = True
        elif injected_at is None:
            hit = False
        else:
            hit = o.ended_at > injected_at and (recovered_at is None or o.started_at < recovered_at)
        affected += hit
        twin = twins[o.index] if twins is not None and o.index < len(twins) else None
        base = twin.latency_s if twin is not None and twin.status == "completed" else None
        lat = o.latency_s
        delta = (
            round(lat - base, 3)
            if hit and o.status == "exact" and base is not None and lat is not None
            else None
        )
        md, md_twin = (
            (o.pdd or {}).get("main_tokens"),
            (twin.pdd or {}).get("main_tokens") if twin is not None else None,
        )
        if delta is not None:
            added.append(delta)
            # handed over to MD in one run and not the other: on one box a handoff costs more
            # than RLD finishing alone, which outweighs most faults here (docs/chaos.md)
            changed += bool(md) != bool(md_twin)
        # who produced the tokens explains many deltas: a request that RLD finished alone
        # (its handoff to MD never came) can be faster than its handed-over twin
        per.append(
            {
                "index": o.index,
                "status": o.status,
                "affected": hit,
                "latency_s": round(lat, 3) if lat is not None else None,
                "no_fault_s": round(base, 3) if base is not None else None,
                "added_s": delta,
                "md_tokens": md,
                "md_tokens_no_fault": md_twin,
            }
        )
    return {
        "affected": affected,
        "compared": len(added),
        "handoff_changed": changed,
        "added_p50_s": round(statistics.median(added), 3) if added else None,
        "added_max_s": round(max(added), 3) if added else None,
        "requests": per,
    }


def _link_counts(st: DaemonState) -> tuple[int, int]:
    """(peer losses, heartbeat deadlines) of one daemon, from its stats()."""
    peers = st.stats.get("peers")
    losses = (
        sum(int(p.get("losses", 0)) for p in peers.values() if isinstance(p, dict))
        if isinstance(peers, dict)
        else 0
    )
    counters = st.stats.get("counters")
    deadlines = int(counters.get("heartbeat_deadlines", 0)) if isinstance(counters, dict) else 0
    return losses, deadlines


def link_losses(before: dict[str, DaemonState], after: dict[str, DaemonState]) -> tuple[int, int]:
    """(peer losses, heartbeat deadlines) the daemons counted between two snapshots; a
    restarted daemon (another pid) counts everything since its start."""
    losses = deadlines = 0
    for role, now in after.items():
        n_loss, n_dead = _link_counts(now)
        base = before.get(role)
        if base is not None and base.pid == now.pid:
            b_loss, b_dead = _link_counts(base)
            n_loss, n_dead = n_loss - b_loss, n_dead - b_dead
        losses += n_loss
        deadlines += n_dead
    return losses, deadlines


async def _states(cluster: LocalCluster) -> dict[str, DaemonState]:
    """Every live daemon's state (a dead one is left out rather than failing the figures)."""
    out = {}
    for role, d in cluster.daemons.items():
        if role == "router" or not pid_alive(d.pid):
            continue
        with contextlib.suppress(RuntimeError, TimeoutError, OSError, aiohttp.ClientError):
            out[role] = await daemon_state(cluster, role)
    return out


async def _router_stalls(cluster: LocalCluster) -> int | None:
    """The router's count of stall replays (stats()["stalls"], absent until the first)."""
    try:
        stats = await cluster.stats("router")
    except (aiohttp.ClientError, OSError, ValueError, asyncio.TimeoutError):
        return None
    return int(stats.get("stalls", 0))


# -- a case ----------------------------------------------------------------------------------------


@dataclass
class CaseResult:
    suite: str
    case: str
    fault_kind: str
    seed: int | None
    sent: int = 0
    exact: int = 0
    clear_errors: int = 0
    cancelled: int = 0  # abandoned by the client on purpose, prefix-correct
    wrong: int = 0
    unclear_errors: int = 0
    lost: int = 0
    duplicated: int = 0
    skipped: int = 0
    leaks: list[str] = field(default_factory=list)
    fresh_ok: bool = True
    fault_injected: bool = True
    fault_detail: str = ""
    fuzz_inputs: int = 0
    duration_s: float = 0.0
    error_codes: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # What the fault cost (docs/chaos.md, "What a fault cost"); None: not measured / not seen.
    detection_s: float | None = None  # injection -> the router's /health first not 200
    detected_as: str = ""  # what /health waited for then
    recover_s: float | None = None  # heal -> first fresh request token-exact
    recovery_probes: int = 0  # fresh requests sent from the heal on until then
    probe_no_fault_s: float | None = None  # the probe's twin on the idle, healthy cluster
    affected: int = 0  # requests in flight at the fault or before recovery
    added_p50_s: float | None = None  # latency - no-fault twin's latency, affected requests
    added_max_s: float | None = None
    handoff_changed: int = 0  # compared requests handed to MD in one run only
    no_fault_pass_s: float | None = None  # what the twins' pass cost (wall clock)
    stall_replays: int | None = None  # router stats()["stalls"] after - before
    peer_losses: int | None = None  # daemons' stats()["peers"][*]["losses"] after - before
    heartbeat_deadlines: int | None = None
    latencies: list[dict[str, Any]] = field(default_factory=list)

    def add(self, outcomes: list[Outcome]) -> None:
        for o in outcomes:
            self.sent += 1
            self.duplicated += o.duplicated
            self.skipped += o.skipped
            if o.status == "exact":
                self.exact += 1
                continue
            if o.status == "cancelled":
                self.cancelled += 1
                continue
            if o.status == "clear_error":
                self.clear_errors += 1
                code = str(o.error["error"].get("code")) if o.error else "?"
                self.error_codes[code] = self.error_codes.get(code, 0) + 1
                continue
            if o.status == "wrong":
                self.wrong += 1
            elif o.status == "unclear_error":
                self.unclear_errors += 1
            else:
                self.lost += 1
            self.problems.append(o.describe())

    def broken(self) -> list[str]:
        out = list(self.problems)
        if not self.fault_injected:
            out.append(f"the fault was never injected: {self.fault_detail}")
        out += [f"leak: {leak}" for leak in self.leaks]
        if not self.fresh_ok:
            out.append("no fresh request was served after healing")
        if self.stall_replays:
            # the router's last resort: a request nobody reported on for its stall timeout
            # (30 s). A lost daemon's requests must be replayed within its heartbeat deadline.
            out.append(f"{self.stall_replays} request(s) waited for the router's stall replay")
        return out

    def assert_invariants(self, logs: Any = None) -> None:
        """Raise with every broken invariant, the seed to replay and where the logs are."""
        problems = self.broken()
        if problems:
            seed = (
                f" (seed {self.seed}: replay with PDD_CHAOS_SEED={self.seed})"
                if self.seed is not None
                else ""
            )
            where = f"\n  daemon logs: {logs}" if logs else ""
            raise AssertionError(
                f"{self.case}{seed}: {len(problems)} broken invariant(s); "
                f"fault: {self.fault_detail}\n  " + "\n  ".join(problems) + where
            )


async def run_case(
    cluster: LocalCluster,
    case: str,
    bodies: list[dict[str, Any]],
    fault: Fault | None,
    seed: int | None = None,
    concurrency: int = 4,
    suite: str = "chaos",
    read_late_s: float = 0.0,
    read_pause_s: float = 0.0,
    fault_timeout_s: float = 30.0,
    kind: str | None = None,
    measure_no_fault: bool = True,
) -> CaseResult:
    """Run `bodies` through the router `concurrency` at a time, inject `fault` at its moment
    (concurrently), heal, then check leaks and fresh requests. Recorded in REPORT.

    It also measures what the fault cost (docs/chaos.md): first the bodies' no-fault twins
    (`measure_no_fault`, for a case with a fault or a `kind`), then, while the case runs, the
    router's /health every 50 ms (detection), a recovery probe from the heal on (recovery),
    and the router's stall replays and the daemons' peer losses over the whole case."""
    started = time.monotonic()
    result = CaseResult(
        suite=suite, case=case, fault_kind=kind or (fault.kind if fault else "none"), seed=seed
    )
    probe = probe_body(case)
    precompute_references(bodies + FRESH_BODIES + [probe])
    stalls_before = await _router_stalls(cluster)
    twins: list[Outcome] | None = None
    if measure_no_fault and (fault is not None or kind is not None):
        t0 = time.monotonic()
        twins, probe_twin = await no_fault_pass(
            cluster, bodies, concurrency, probe if fault is not None else None
        )
        result.no_fault_pass_s = round(time.monotonic() - t0, 2)
        if probe_twin is not None and probe_twin.status == "completed":
            result.probe_no_fault_s = round(probe_twin.latency_s or 0.0, 3)
        result.problems += [
            f"no-fault twin: {o.describe()}" for o in twins if o.status == "lost"
        ]  # a hang is a hang, fault or not
        # the leak baseline below is taken once the twins' requests are freed
        await find_leaks(cluster, {}, timeout_s=5.0)
    baseline = await snapshot(cluster)
    killed_pids = {cluster.daemons[r].pid for r in (fault.killed_roles if fault else ())}
    sem = asyncio.Semaphore(concurrency)
    workload_done = asyncio.Event()
    if fault is not None:
        fault.injected_at = fault.healed_at = None
    watch = HealthWatch(cluster.url)
    probe_task: asyncio.Future | None = None

    def start_probe() -> None:
        nonlocal probe_task
        if probe_task is None and fault is not None and fault.healed_at is not None:
            probe_task = asyncio.ensure_future(probe_recovery(cluster, probe))

    async def one(i: int, body: dict[str, Any]) -> Outcome:
        async with sem:
            return await send(session, cluster.url, i, body, read_late_s, read_pause_s)

    async def inject() -> str:
        assert fault is not None
        moment = asyncio.ensure_future(fault.at(cluster))
        ended = asyncio.ensure_future(workload_done.wait())
        await asyncio.wait({moment, ended}, return_when=asyncio.FIRST_COMPLETED)
        if not moment.done():
            moment.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await moment
            raise LookupError("the workload ended before the chosen moment came")
        ended.cancel()
        when = moment.result()
        called = time.monotonic()
        try:
            detail = await fault.inject(cluster)
        finally:
            if fault.injected_at is None:
                fault.injected_at = called
        start_probe()  # a fault that is over when inject returns (link effect, SIGSTOP)
        return f"{detail} when {when}"

    watch.start()
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
            fault_task = asyncio.ensure_future(inject()) if fault else None
            outcomes = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
            workload_done.set()
            if fault_task is not None:
                try:
                    result.fault_detail = await asyncio.wait_for(fault_task, fault_timeout_s)
                except LookupError as exc:
                    result.fault_injected, result.fault_detail = False, str(exc)
                except asyncio.TimeoutError:
                    result.fault_injected = False
                    result.fault_detail = f"injection did not finish within {fault_timeout_s:g} s"
        result.add(outcomes)
    finally:
        try:
            if fault is not None and fault.heal is not None:
                try:
                    await fault.heal(cluster)
                except Exception as exc:  # recorded: the case still gets its leak and fresh checks
                    result.problems.append(f"healing the fault failed: {type(exc).__name__}: {exc}")
                start_probe()  # a fault that heal undoes (a killed daemon restarted)
            probe_out, result.recovery_probes = await probe_task if probe_task else (None, 0)
        finally:
            await watch.stop()
    recovered_at = _record_recovery(result, fault, probe_out)
    _record_detection(result, fault, watch)
    lat = added_latency(
        outcomes,
        twins,
        fault.injected_at if fault else None,
        recovered_at,
        whole_workload=fault is None and kind is not None,
    )
    result.affected, result.added_p50_s, result.added_max_s = (
        lat["affected"],
        lat["added_p50_s"],
        lat["added_max_s"],
    )
    result.latencies = lat["requests"]
    result.handoff_changed = lat["handoff_changed"]
    if twins is not None and lat["compared"] < lat["affected"]:
        result.notes.append(
            f"added latency from {lat['compared']} of {lat['affected']} affected "
            f"requests (the others failed, or their twin did)"
        )
    result.leaks = await find_leaks(cluster, baseline, killed_pids)
    fresh = await fresh_requests(cluster)
    result.fresh_ok = all(o.status == "exact" for o in fresh)
    result.problems += [f"after healing: {o.describe()}" for o in fresh if o.status != "exact"]
    stalls_after = await _router_stalls(cluster)
    if stalls_before is not None and stalls_after is not None:
        result.stall_replays = stalls_after - stalls_before
    result.peer_losses, result.heartbeat_deadlines = link_losses(baseline, await _states(cluster))
    if killed_pids:
        left = remove_segments_of(killed_pids)
        if left:
            result.notes.append(f"removed /dev/shm segments the killed daemon left: {left}")
    result.duration_s = round(time.monotonic() - started, 2)
    REPORT.add(result)
    return result


def _record_recovery(
    result: CaseResult, fault: Fault | None, probe: Outcome | None
) -> float | None:
    """recover_s from the recovery probe; returns the moment of recovery (None: unknown)."""
    if fault is None or fault.healed_at is None:
        return None
    if probe is None:
        result.notes.append(
            f"no recovery probe was served within {HEALTH_TIMEOUT_S:g} s of the "
            f"heal ({result.recovery_probes} refused with a clear error)"
        )
        return None
    if probe.status != "exact":  # the same invariants as every request
        result.problems.append(f"recovery probe after the heal: {probe.describe()}")
        return None
    assert probe.ended_at is not None
    result.recover_s = round(probe.ended_at - fault.healed_at, 3)
    return probe.ended_at


def _record_detection(result: CaseResult, fault: Fault | None, watch: HealthWatch) -> None:
    """detection_s: injection -> the first non-200 /health answer after it (None: none came)."""
    if fault is None or fault.injected_at is None or not result.fault_injected:
        return
    if any(u[0] < fault.injected_at for u in watch.unready):
        result.notes.append("the router's /health was already not ok before the fault")
    hit = watch.first_unready(fault.injected_at)
    if hit is not None:
        result.detection_s = round(hit[0] - fault.injected_at, 3)
        result.detected_as = f"HTTP {hit[1]}: {hit[2]}"


def chaos_seed() -> int:
    """The seed of a randomised schedule: PDD_CHAOS_SEED to replay one, else a fresh one."""
    env = os.environ.get("PDD_CHAOS_SEED")
    return int(env) if env else random.randrange(1 << 31)


# -- the report ------------------------------------------------------------------------------------

COLUMNS = [
    ("suite", "suite"),
    ("case", "case"),
    ("fault", "fault_kind"),
    ("sent", "sent"),
    ("exact", "exact"),
    ("clear err", "clear_errors"),
    ("cancelled", "cancelled"),
    ("lost", "lost"),
    ("wrong", "wrong"),
    ("unclear", "unclear_errors"),
    ("dup", "duplicated"),
    ("skip", "skipped"),
    ("leaks", "leaks"),
    ("fresh ok", "fresh_ok"),
    ("fuzz inputs", "fuzz_inputs"),
    ("detect s", "detection_s"),
    ("recover s", "recover_s"),
    ("affected", "affected"),
    ("added p50 s", "added_p50_s"),
    ("added max s", "added_max_s"),
    ("stalls", "stall_replays"),
    ("losses", "peer_losses"),
    ("s", "duration_s"),
]


def _cell(v: Any) -> str:
    if isinstance(v, list):
        return str(len(v))
    if isinstance(v, bool):
        return "yes" if v else "NO"
    if v is None:
        return "-"  # not measured, or (detection) never visible
    return f"{v:.2f}" if isinstance(v, float) else str(v)


def _spread(values: list[float | None]) -> dict[str, Any]:
    """max and median of the measured values (None: not measured), and how many there were."""
    got = [v for v in values if v is not None]
    return {
        "cases": len(got),
        "max": max(got) if got else None,
        "median": round(statistics.median(got), 3) if got else None,
    }


class SuiteReport:
    """Every case of this pytest process: the table at the end and results/chaos/report.json."""

    def __init__(self) -> None:
        self.cases: list[CaseResult] = []

    def add(self, result: CaseResult) -> None:
        self.cases.append(result)

    def totals(self) -> dict[str, Any]:
        c = self.cases
        return {
            "cases": len(c),
            "faults_by_kind": dict(Counter(r.fault_kind for r in c if r.fault_kind != "none")),
            "requests_sent": sum(r.sent for r in c),
            "completed_token_exact": sum(r.exact for r in c),
            "failed_with_clear_error": sum(r.clear_errors for r in c),
            "cancelled_by_client": sum(r.cancelled for r in c),
            "lost": sum(r.lost for r in c),
            "wrong_tokens": sum(r.wrong for r in c),
            "unclear_errors": sum(r.unclear_errors for r in c),
            "duplicated_tokens": sum(r.duplicated for r in c),
            "skipped_tokens": sum(r.skipped for r in c),
            "leaks": sum(len(r.leaks) for r in c),
            "fresh_request_failures": sum(not r.fresh_ok for r in c),
            "fuzz_inputs": sum(r.fuzz_inputs for r in c),
            "detection_s": _spread([r.detection_s for r in c]),
            "recover_s": _spread([r.recover_s for r in c]),
            "added_p50_s": _spread([r.added_p50_s for r in c]),
            "added_max_s": _spread([r.added_max_s for r in c]),
            "stall_replays": sum(r.stall_replays or 0 for r in c),
            "peer_losses": sum(r.peer_losses or 0 for r in c),
        }

    def table(self) -> str:
        rows = [[h for h, _ in COLUMNS]]
        for r in self.cases:
            rows.append([_cell(getattr(r, key)) for _, key in COLUMNS])
        widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
        lines = [
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in rows
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        t = self.totals()
        lines.append("")
        lines.append("totals: " + ", ".join(f"{k} {v}" for k, v in t.items()))
        lines.append(
            "detect s: fault -> router /health first not 200 (-: never, e.g. a latency "
            "spike); recover s: heal -> first fresh request token-exact; added: latency "
            "- no-fault twin's, affected requests (docs/chaos.md)"
        )
        return "\n".join(lines)

    def write(self, path: Path | None = None) -> Path:
        path = path or RESULTS_DIR / "report.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "written_at": time.time(),
            "totals": self.totals(),
            "cases": [asdict(r) for r in self.cases],
        }
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)
        return path


REPORT = SuiteReport()
_PLUGIN_NAME = "pddnet-chaos-report"
WORKER_CASES = "pddnet_chaos_cases"  # a pytest-xdist worker's cases, in its workeroutput


class _ReportPlugin:
    def pytest_sessionfinish(self, session: Any) -> None:
        # A pytest-xdist worker hands its cases to the controller, which prints and writes them
        # with every other worker's (each worker writing report.json would keep only its share).
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:
            workeroutput[WORKER_CASES] = [asdict(r) for r in REPORT.cases]

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not REPORT.cases or hasattr(terminalreporter.config, "workerinput"):
            return  # nothing, or a worker: the controller reports
        path = REPORT.write()
        terminalreporter.section("pddnet chaos / fuzz / soak report")
        terminalreporter.write_line(REPORT.table())
        terminalreporter.write_line(f"written to {path}")
        for r in REPORT.cases:
            for line in r.broken():
                terminalreporter.write_line(f"  {r.case}: {line}")


def install_report(config: Any) -> None:
    """Print REPORT's table at the end of this pytest run and write it as JSON (once)."""
    if not config.pluginmanager.has_plugin(_PLUGIN_NAME):
        config.pluginmanager.register(_ReportPlugin(), _PLUGIN_NAME)


def merge_worker_cases(config: Any, workeroutput: dict[str, Any]) -> None:
    """In the pytest-xdist controller (tests/conftest.py's pytest_testnodedown): a finished
    worker's cases join REPORT, which the controller then prints and writes for the whole run."""
    cases = workeroutput.get(WORKER_CASES)
    if cases:
        REPORT.cases += [CaseResult(**c) for c in cases]
        install_report(config)
