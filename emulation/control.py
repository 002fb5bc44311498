"""The emulator's runtime control API (aiohttp, loopback) and its client.

One app serves every shell (TCP proxy, packet forwarder): it only talks to the `Link` model.
JSON in, JSON out. Routes:

    GET    /link                       effects, counters and pending changes of both directions
    GET    /link/{direction}           the same for a_to_b or b_to_a
    POST   /link/{direction}           change effects: {"delay_ms": 40, "duration": 5}
    PATCH  /link/{direction}           (same as POST: a partial change; direction may be "both")
    DELETE /link[/{direction}]         back to the link's initial effects, cancel timed changes
    POST   /link/schedule              {"steps": [...]} or {"trace": "path.csv"}, "loop", "period"
    POST   /chaos/{kind}               partition | latency-spike | bandwidth-collapse |
                                       loss-burst | jitter-storm, with {"duration": s, ...}
    POST   /chaos/heal                 end a partition / blackhole now
    POST   /connections/reset          abort every connection (shells that have connections)

A bad request gets a 400 whose JSON `error` says what was wrong; the link keeps running.
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import ClientSession, ClientTimeout, web

from emulation.link import Link

DIRECTION_NAMES = ("a_to_b", "b_to_a", "both")


class BadRequest(ValueError):
    pass


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def _body(request: web.Request) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        return {}
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"bad JSON body: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequest(f"the JSON body must be an object, got {type(data).__name__}")
    return data


def _direction(request: web.Request) -> str:
    name = request.match_info.get("direction", "both")
    if name not in DIRECTION_NAMES:
        raise BadRequest(f"unknown direction {name!r} (known: {', '.join(DIRECTION_NAMES)})")
    return name


def make_control_app(
    link: Link,
    clock: Callable[[], float] = time.monotonic,
    on_reset: Callable[[], Awaitable[int] | int] | None = None,
) -> web.Application:
    """The control API for `link`; `clock` gives the `now` passed to the model."""

    def view(direction: str = "both") -> dict[str, Any]:
        snap = link.snapshot(clock())
        if direction != "both":
            return {direction: snap[direction]}
        return snap

    async def get_link(request: web.Request) -> web.Response:
        return web.json_response(view(_direction(request)))

    async def change(request: web.Request) -> web.Response:
        direction = _direction(request)
        body = await _body(request)
        if "direction" in body or "now" in body:
            raise BadRequest(
                "the direction goes in the URL (/link/a_to_b), not in the body"
                if "direction" in body
                else "'now' is not an effect"
            )
        duration = body.pop("duration", None)
        link.set(clock(), direction, duration, **body)
        return web.json_response({"ok": True, "link": view(direction)})

    async def clear(request: web.Request) -> web.Response:
        direction = _direction(request)
        link.clear(clock(), direction)
        return web.json_response({"ok": True, "link": view(direction)})

    async def schedule(request: web.Request) -> web.Response:
        body = await _body(request)
        unknown = set(body) - {"steps", "trace", "loop", "period"}
        if unknown:
            raise BadRequest(
                f"unknown schedule field(s) {', '.join(sorted(unknown))} "
                "(known: steps, trace, loop, period)"
            )
        if ("steps" in body) == ("trace" in body):
            raise BadRequest("give exactly one of 'steps' (a list) or 'trace' (a file path)")
        source = body.get("steps", body.get("trace"))
        if "trace" in body and not isinstance(source, str):
            raise BadRequest(f"trace must be a file path string, got {source!r}")
        if "steps" in body and not isinstance(source, list):
            raise BadRequest(f"steps must be a list, got {type(source).__name__}")
        link.load_schedule(clock(), source, loop=body.get("loop", False), period=body.get("period"))
        return web.json_response({"ok": True, "link": view()})

    async def chaos(request: web.Request) -> web.Response:
        kind = request.match_info["kind"]
        body = await _body(request)
        if kind == "heal":
            if body:
                raise BadRequest(f"heal takes no parameters, got {', '.join(sorted(body))}")
            link.heal(clock())
            return web.json_response({"ok": True, "link": view()})
        if "duration" not in body:
            raise BadRequest(f"chaos {kind!r} needs a duration (seconds)")
        duration = body.pop("duration")
        if "now" in body or "kind" in body:
            raise BadRequest("'now' and 'kind' are not chaos parameters")
        link.chaos(clock(), kind, duration, **body)
        return web.json_response({"ok": True, "kind": kind, "duration": duration, "link": view()})

    async def reset(request: web.Request) -> web.Response:
        if on_reset is None:
            return _error(501, "this shell has no connections to reset")
        result = on_reset()
        if inspect.isawaitable(result):
            result = await result
        return web.json_response({"ok": True, "reset": int(result)})

    @web.middleware
    async def errors(request: web.Request, handler: Callable) -> web.StreamResponse:
        try:
            return await handler(request)
        except ValueError as exc:  # BadRequest and every validation error of the model
            return _error(400, str(exc))

    app = web.Application(middlewares=[errors])
    app.router.add_get("/link", get_link)
    app.router.add_delete("/link", clear)
    app.router.add_post("/link/schedule", schedule)
    app.router.add_get("/link/{direction}", get_link)
    app.router.add_post("/link/{direction}", change)
    app.router.add_patch("/link/{direction}", change)
    app.router.add_delete("/link/{direction}", clear)
    app.router.add_post("/chaos/{kind}", chaos)
    app.router.add_post("/connections/reset", reset)
    return app


async def start_control_server(
    app: web.Application, host: str = "127.0.0.1", port: int = 0
) -> tuple[web.AppRunner, int]:
    """Serve `app`; returns the runner (call `await runner.cleanup()`) and the bound port."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, bound


class ControlError(RuntimeError):
    """The control API refused a request; `status` and the server's message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class ControlClient:
    """Async client of the control API (used by `pdd wan set/show`, tests and chaos suites)."""

    def __init__(self, base_url: str, timeout: float = 10.0) -> None:
        if not base_url.startswith(("http://", "https://")):
            base_url = "http://" + base_url
        self.base_url = base_url.rstrip("/")
        self._timeout = ClientTimeout(total=timeout)

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict:
        async with ClientSession(timeout=self._timeout) as session:
            async with session.request(method, self.base_url + path, json=body) as resp:
                try:
                    data = await resp.json(content_type=None)
                except (json.JSONDecodeError, ValueError):
                    data = {"error": (await resp.text())[:200]}
                if resp.status >= 400:
                    raise ControlError(resp.status, str(data.get("error", data)))
                return data

    async def show(self, direction: str = "both") -> dict:
        return await self._call("GET", "/link" if direction == "both" else f"/link/{direction}")

    async def set(
        self, direction: str = "both", duration: float | None = None, **effects: Any
    ) -> dict:
        body = dict(effects)
        if duration is not None:
            body["duration"] = duration
        return await self._call("PATCH", f"/link/{direction}", body)

    async def clear(self, direction: str = "both") -> dict:
        return await self._call("DELETE", "/link" if direction == "both" else f"/link/{direction}")

    async def chaos(self, kind: str, duration: float, **params: Any) -> dict:
        return await self._call("POST", f"/chaos/{kind}", {"duration": duration, **params})

    async def heal(self) -> dict:
        return await self._call("POST", "/chaos/heal", {})

    async def load_schedule(
        self,
        steps: list[dict] | None = None,
        trace: str | None = None,
        loop: bool = False,
        period: float | None = None,
    ) -> dict:
        body: dict[str, Any] = {"loop": loop}
        if steps is not None:
            body["steps"] = steps
        if trace is not None:
            body["trace"] = trace
        if period is not None:
            body["period"] = period
        return await self._call("POST", "/link/schedule", body)

    async def reset_connections(self) -> dict:
        return await self._call("POST", "/connections/reset", {})
