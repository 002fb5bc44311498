"""The control API (aiohttp on loopback) driving a live proxied link, its client and CLI."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from emulation.control import ControlClient, ControlError, make_control_app, start_control_server
from emulation.link import Link
from emulation.proxy import WanProxy
from tests.link_measurement import assert_measured
from tests.polling import wait_for

LOOP = "127.0.0.1"
REPO = Path(__file__).resolve().parents[1]


class Rig:
    """Echo server <- proxy (link) <- a probe loop that keeps traffic flowing all the time."""

    def __init__(self, link: Link) -> None:
        self.link = link
        self.rtts: list[tuple[float, float]] = []  # (sent at, rtt ms)
        self.errors: list[BaseException] = []

    async def probe(self, port: int) -> None:
        try:
            reader, writer = await asyncio.open_connection(LOOP, port)
            i = 0
            while True:
                payload = i.to_bytes(8, "big")
                t0 = time.monotonic()
                writer.write(payload)
                assert await reader.readexactly(8) == payload
                self.rtts.append((t0, (time.monotonic() - t0) * 1000))
                i += 1
                await asyncio.sleep(0.005)  # paces the probes: traffic all the time, not a flood
        except asyncio.CancelledError:
            writer.close()
            raise
        except BaseException as exc:  # noqa: BLE001 - recorded and asserted on by the tests
            self.errors.append(exc)

    def rtts_since(self, t: float) -> list[float]:
        return [r for t0, r in self.rtts if t0 >= t]


@pytest.fixture
async def rig() -> AsyncIterator[tuple[Rig, ControlClient, WanProxy]]:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(echo, LOOP, 0)
    link = Link(delay_ms=5, rate_mbit=100)
    proxy = await WanProxy((LOOP, 0), (LOOP, server.sockets[0].getsockname()[1]), link).start()
    app = make_control_app(link, time.monotonic, on_reset=proxy.reset_connections)
    runner, port = await start_control_server(app)
    r = Rig(link)
    task = asyncio.create_task(r.probe(proxy.port))
    try:
        yield r, ControlClient(f"http://{LOOP}:{port}"), proxy
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await runner.cleanup()
        await proxy.close()
        server.close()
        await server.wait_closed()


async def test_get_shows_both_directions_with_counters(rig) -> None:
    r, client, _ = rig

    async def probed() -> bool:
        snap = await client.show()
        return all(snap[d]["counters"]["packets_out"] > 5 for d in ("a_to_b", "b_to_a"))

    await wait_for(probed, 5, "a few probes through both directions")
    snap = await client.show()
    assert set(snap) >= {"a_to_b", "b_to_a"}
    for name in ("a_to_b", "b_to_a"):
        assert snap[name]["effects"]["delay_ms"] == 5 and snap[name]["effects"]["rate_mbit"] == 100
        c = snap[name]["counters"]
        assert c["packets_out"] > 5 and c["bytes_out"] == 8 * c["packets_out"]
        assert c["delay"]["min_ms"] == pytest.approx(5, abs=1e-6)
    assert "loss_pct" in snap["restricted"]
    one = await client.show("b_to_a")
    assert list(one) == ["b_to_a"]


@pytest.mark.link_measurement
async def test_patch_changes_the_live_link_and_duration_reverts(rig) -> None:
    r, client, _ = rig
    changed = time.monotonic()
    reply = await client.set("a_to_b", duration=0.6, delay_ms=40)
    assert reply["link"]["a_to_b"]["effects"]["delay_ms"] == 40
    assert reply["link"]["a_to_b"]["pending"]["reverts"][0]["effects"] == ["delay_ms"]
    # Probes take ~50 ms each now: five of them fit well inside the change's 0.6 s.
    await wait_for(lambda: len(r.rtts_since(changed + 0.05)) >= 5, 5, "probes on the slow link")
    slow = r.rtts_since(changed + 0.05)
    assert slow
    assert_measured(statistics.median(slow), 45 - 3, 45 + 3, "RTT median while changed (ms)")

    async def reverted() -> bool:
        return (await client.show("a_to_b"))["a_to_b"]["effects"]["delay_ms"] == 5

    await wait_for(reverted, 5, "the change to revert after its 0.6 s")
    await wait_for(lambda: len(r.rtts_since(changed + 0.7)) >= 5, 5, "probes after the revert")
    back = r.rtts_since(changed + 0.7)
    assert back
    assert_measured(statistics.median(back), 10 - 3, 10 + 3, "RTT median after revert (ms)")


async def test_post_and_delete(rig) -> None:
    r, client, _ = rig
    base = client.base_url
    async with aiohttp.ClientSession() as s:
        async with s.post(
            f"{base}/link/both", json={"jitter_ms": 1, "jitter_dist": "uniform"}
        ) as resp:
            assert resp.status == 200
            body = await resp.json()
            assert body["link"]["b_to_a"]["effects"]["jitter_dist"] == "uniform"
        async with s.delete(f"{base}/link/b_to_a") as resp:
            assert resp.status == 200
            fx = (await resp.json())["link"]["b_to_a"]["effects"]
            assert fx["jitter_ms"] == 0 and fx["delay_ms"] == 5
    snap = await client.show()
    assert snap["a_to_b"]["effects"]["jitter_ms"] == 1
    await client.clear()
    assert (await client.show())["a_to_b"]["effects"]["jitter_ms"] == 0


async def test_schedule_steps_and_trace(rig, tmp_path: Path) -> None:
    r, client, _ = rig
    loaded = time.monotonic()
    await client.load_schedule(steps=[{"at": 0.2, "delay_ms": 30, "duration": 0.3}])

    async def delay_is(ms: float) -> bool:
        return (await client.show())["a_to_b"]["effects"]["delay_ms"] == ms

    await wait_for(lambda: delay_is(30), 5, "the step at 0.2 s to apply")
    await wait_for(lambda: delay_is(5), 5, "the step to end after its 0.3 s")
    during = [rtt for t0, rtt in r.rtts if loaded + 0.25 <= t0 <= loaded + 0.4]
    assert during and min(during) >= 60 - 1
    trace = tmp_path / "trace.csv"
    trace.write_text("time,rate_mbit,delay_ms\n0,50,7\n0.2,20,9\n")
    reply = await client.load_schedule(trace=str(trace), loop=True)
    assert reply["link"]["a_to_b"]["pending"]["schedule"]["period_s"] == pytest.approx(0.4)

    async def second_row() -> bool:
        fx = (await client.show())["b_to_a"]["effects"]
        return (fx["rate_mbit"], fx["delay_ms"]) == (20, 9)

    await wait_for(second_row, 5, "the trace's second row on b_to_a")


@pytest.mark.link_measurement
async def test_chaos_verbs_with_durations(rig) -> None:
    r, client, _ = rig
    await client.chaos("latency-spike", 0.3, add_ms=50)
    assert (await client.show())["b_to_a"]["effects"]["delay_ms"] == 55
    await client.chaos("bandwidth-collapse", 0.3, fraction=0.05, direction="a_to_b")
    snap = await client.show()
    assert (
        snap["a_to_b"]["effects"]["rate_mbit"] == 5
        and snap["b_to_a"]["effects"]["rate_mbit"] == 100
    )
    await client.chaos("jitter-storm", 0.3, jitter_ms=2)

    async def all_reverted() -> bool:
        fx = (await client.show())["a_to_b"]["effects"]
        return (fx["delay_ms"], fx["rate_mbit"], fx["jitter_ms"]) == (5, 100, 0)

    await wait_for(all_reverted, 5, "the three chaos verbs to revert after their 0.3 s")
    start = time.monotonic()
    await client.chaos("partition", 0.5)
    assert (await client.show())["a_to_b"]["effects"]["partition"] is True
    await asyncio.sleep(0.3)  # the partition's first 0.3 s, watched by the probe
    done = [t0 + rtt / 1000 for t0, rtt in r.rtts]
    through = [t for t in done if start + 0.03 < t < start + 0.3]
    assert_measured(len(through), 0, 0, "replies through the partition")
    await client.heal()
    assert (await client.show())["a_to_b"]["effects"]["partition"] is False
    await wait_for(lambda: r.rtts_since(start + 0.3), 5, "a probe after the heal")
    assert r.rtts_since(start + 0.3)  # the same probe connection carries on
    assert not r.errors


async def test_reset_connections(rig) -> None:
    r, client, proxy = rig
    await wait_for(lambda: r.rtts, 5, "the probe's connection to carry traffic")
    assert (await client.reset_connections()) == {"ok": True, "reset": 1}
    await wait_for(lambda: r.errors, 5, "the probe to see its connection reset")
    assert r.errors and isinstance(r.errors[0], (ConnectionResetError, asyncio.IncompleteReadError))
    assert proxy.connections == 0


async def test_reset_is_501_without_connections_to_reset() -> None:
    runner, port = await start_control_server(make_control_app(Link()))
    try:
        with pytest.raises(ControlError) as err:
            await ControlClient(f"{LOOP}:{port}").reset_connections()
        assert err.value.status == 501 and "no connections" in err.value.message
    finally:
        await runner.cleanup()


@pytest.mark.parametrize(
    ("method", "path", "body", "message"),
    [
        ("PATCH", "/link/sideways", {"delay_ms": 1}, "unknown direction 'sideways'"),
        ("POST", "/link/both", b"{delay_ms: 1", "bad JSON body"),
        ("POST", "/link/both", b"[1, 2]", "the JSON body must be an object, got list"),
        ("PATCH", "/link/a_to_b", {"warp": 9}, "unknown effect 'warp'"),
        ("PATCH", "/link/a_to_b", {"delay_ms": -4}, "delay_ms must be >= 0 ms, got -4"),
        ("PATCH", "/link/a_to_b", {"jitter_dist": "cauchy"}, "unknown distribution 'cauchy'"),
        ("PATCH", "/link/a_to_b", {"loss_pct": 5}, "loss_pct=5.0 is not supported here"),
        ("PATCH", "/link/a_to_b", {"delay_ms": 1, "duration": -1}, "duration must be a number"),
        (
            "PATCH",
            "/link/a_to_b",
            {"direction": "b_to_a", "delay_ms": 1},
            "direction goes in the URL",
        ),
        ("PATCH", "/link/a_to_b", {}, "no effects given"),
        ("POST", "/chaos/meteor", {"duration": 1}, "unknown chaos 'meteor'"),
        ("POST", "/chaos/partition", {}, "needs a duration"),
        ("POST", "/chaos/latency-spike", {"duration": 1, "add": 5}, "bad parameters for chaos"),
        ("POST", "/chaos/loss-burst", {"duration": 1}, "not supported here"),
        ("POST", "/chaos/heal", {"duration": 1}, "heal takes no parameters"),
        ("POST", "/link/schedule", {"steps": [], "trace": "x.csv"}, "give exactly one of"),
        (
            "POST",
            "/link/schedule",
            {"steps": [{"at": 1, "warp": 1}]},
            "schedule step 0: unknown effect 'warp'",
        ),
        ("POST", "/link/schedule", {"steps": [], "speed": 2}, "unknown schedule field(s) speed"),
        ("POST", "/link/schedule", {"trace": "/nonexistent/t.csv"}, "does not exist"),
    ],
)
async def test_bad_requests_get_400_naming_the_problem_while_traffic_flows(
    rig, method: str, path: str, body, message: str
) -> None:
    r, client, _ = rig
    await wait_for(lambda: r.rtts, 5, "traffic on the link")
    before = len(r.rtts)
    async with aiohttp.ClientSession() as s:
        kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
        async with s.request(method, client.base_url + path, **kwargs) as resp:
            assert resp.status == 400
            assert message in (await resp.json())["error"]
    fx = (await client.show())["a_to_b"]["effects"]
    assert fx["delay_ms"] == 5 and fx["loss_pct"] == 0 and fx["partition"] is False
    await wait_for(lambda: len(r.rtts) > before + 3, 5, "more probes through the link")
    assert len(r.rtts) > before + 3 and not r.errors  # the link kept running


async def test_client_raises_control_error_with_the_message(rig) -> None:
    _, client, _ = rig
    with pytest.raises(ControlError) as err:
        await client.set("a_to_b", delay_ms="slow")
    assert err.value.status == 400 and "delay_ms must be a number" in err.value.message


# --- CLI ------------------------------------------------------------------------------------


def _cli(argv: list[str]) -> int:
    from emulation.wan_cli import register

    parser = argparse.ArgumentParser(prog="pdd")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.handler(args)


async def test_wan_set_and_show_cli(rig, capsys) -> None:
    _, client, _ = rig
    url = client.base_url
    rc = await asyncio.to_thread(
        _cli,
        [
            "wan",
            "set",
            "--control",
            url,
            "--direction",
            "a_to_b",
            "delay_ms=25",
            "jitter_dist=uniform",
            "rate_mbit=null",
        ],
    )
    assert rc == 0
    fx = (await client.show())["a_to_b"]["effects"]
    assert (fx["delay_ms"], fx["jitter_dist"], fx["rate_mbit"]) == (25, "uniform", None)
    assert await asyncio.to_thread(_cli, ["wan", "show", "--control", url]) == 0
    out = capsys.readouterr().out
    assert "a_to_b: effects" in out and '"delay_ms": 25.0' in out
    assert await asyncio.to_thread(_cli, ["wan", "show", "--control", url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["a_to_b"]["effects"]["delay_ms"] == 25
    rc = await asyncio.to_thread(_cli, ["wan", "set", "--control", url, "delay_ms=-1"])
    assert rc == 1 and "delay_ms must be >= 0 ms" in capsys.readouterr().err
    rc = await asyncio.to_thread(
        _cli, ["wan", "chaos", "--control", url, "latency-spike", "add_ms=10", "--duration", "0.2"]
    )
    assert rc == 0 and (await client.show())["b_to_a"]["effects"]["delay_ms"] == 15
    assert await asyncio.to_thread(_cli, ["wan", "reset", "--control", url]) == 0
    assert "reset 1 connection(s)" in capsys.readouterr().out


def test_wan_cli_reports_an_unreachable_control_api(capsys) -> None:
    assert _cli(["wan", "show", "--control", "http://127.0.0.1:9"]) == 1
    assert "cannot reach the control API" in capsys.readouterr().err


async def test_wan_proxy_command_runs_until_sigterm() -> None:
    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data)
        writer.close()

    server = await asyncio.start_server(echo, LOOP, 0)
    up = server.sockets[0].getsockname()[1]
    code = (
        "import argparse, sys; from emulation.wan_cli import register; "
        "p = argparse.ArgumentParser(prog='pdd'); register(p.add_subparsers(dest='c')); "
        "a = p.parse_args(sys.argv[1:]); sys.exit(a.handler(a))"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        code,
        "wan",
        "proxy",
        "--listen",
        f"{LOOP}:0",
        "--upstream",
        f"{LOOP}:{up}",
        "--control",
        f"{LOOP}:0",
        "--rtt-ms",
        "20",
        "--bw-mbit",
        "100",
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    try:
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert line.startswith("wan proxy: "), line
        listen_port = int(line.split(" -> ")[0].rsplit(":", 1)[1])
        control = line.rsplit("control ", 1)[1].strip()
        reader, writer = await asyncio.open_connection(LOOP, listen_port)
        t0 = time.monotonic()
        writer.write(b"hello")
        assert await asyncio.wait_for(reader.readexactly(5), 5) == b"hello"
        assert (time.monotonic() - t0) * 1000 >= 20 - 0.5
        snap = await ControlClient(control).show()
        assert snap["a_to_b"]["effects"]["delay_ms"] == 10
        writer.close()
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        server.close()
        await server.wait_closed()
