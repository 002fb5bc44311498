"""OpenAI completions parsing: every bad body gets a 400 (404 for an unknown model) whose message
names what was wrong, in OpenAI's error shape; good bodies become a CompletionRequest. Also the
response shapes and the incremental detokenizer."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp
import pytest

from pddnet.api.parse import parse_completion_request
from pddnet.api.responses import completion_chunk, completion_response, models_response
from pddnet.api.types import ApiError, ModelInfo
from pddnet.lifecycle.choice_text import IncrementalDetokenizer
from pddnet.model.tokenizer import ByteTokenizer
from pddnet.protocol import messages as m
from tests.polling import wait_for

TOK = ByteTokenizer()
MODEL = ModelInfo(
    name="tiny", vocab_size=259, max_position=4096, eos_token_id=257, aliases=("tiny-alias",)
)


def parse(body, limit=4096):
    return parse_completion_request(body, MODEL, lambda t: TOK.encode(t, add_bos=True), limit)


def test_text_prompt_defaults():
    r = parse({"model": "tiny", "prompt": "hi"})
    assert r.prompt_token_ids == (256, ord("h"), ord("i")) and r.prompt_text == "hi"
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k) == (16, 1.0, 1.0, 0)
    assert r.seed is None and r.needs_seed and not r.stream and not r.ignore_eos
    assert parse({"model": "tiny-alias", "prompt": "x", "temperature": 0}).needs_seed is False


@pytest.mark.parametrize(
    "prompt, ids",
    [
        ([1, 2, 3], (1, 2, 3)),
        (["ab"], (256, 97, 98)),
        ([[5, 6]], (5, 6)),
        ("", (256,)),
    ],
)
def test_prompt_forms(prompt, ids):
    assert parse({"model": "tiny", "prompt": prompt}).prompt_token_ids == ids


def test_full_body():
    r = parse(
        {
            "model": "tiny",
            "prompt": [1, 2],
            "max_tokens": 7,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": -1,
            "seed": 2**64 - 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,
            "ignore_eos": True,
            "stop_token_ids": [10],
            "handoff_mode": "streaming",
            "n": 1,
            "echo": False,
            "logprobs": None,
            "stop": [],
            "user": "u",
        }
    )
    assert (r.max_tokens, r.top_k, r.seed, r.stream, r.include_usage) == (
        7,
        0,
        2**64 - 1,
        True,
        True,
    )
    assert r.return_token_ids and r.ignore_eos and r.stop_token_ids == (10,)
    assert r.handoff_mode == "streaming" and not r.needs_seed


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ([1, 2], None, "must be a JSON object"),
        ({"prompt": "x"}, "model", "provide a model"),
        ({"model": 3, "prompt": "x"}, "model", "model must be a string"),
        ({"model": "tiny"}, "prompt", "provide a prompt"),
        ({"model": "tiny", "prompt": 5}, "prompt", "prompt must be a string"),
        ({"model": "tiny", "prompt": []}, "prompt", "must not be empty"),
        ({"model": "tiny", "prompt": ["a", "b"]}, "prompt", "holds 2 prompts"),
        ({"model": "tiny", "prompt": [1, "a"]}, "prompt", "must be integers"),
        ({"model": "tiny", "prompt": [1, 999]}, "prompt", "token id 999 is outside"),
        ({"model": "tiny", "prompt": [1, True]}, "prompt", "must be integers"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 2.5}, "max_tokens", "max_tokens must be"),
        ({"model": "tiny", "prompt": "x", "max_tokens": 5000}, "max_tokens", "server's limit"),
        (
            {"model": "tiny", "prompt": [1] * 4000, "max_tokens": 100},
            "max_tokens",
            "maximum context length is 4096",
        ),
        ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
        ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature", "[0, 2]"),
        ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
        ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p", "[0, 1]"),
        ({"model": "tiny", "prompt": "x", "top_k": -2}, "top_k", "top_k must be"),
        ({"model": "tiny", "prompt": "x", "seed": -1}, "seed", "seed must be"),
        ({"model": "tiny", "prompt": "x", "seed": 2**64}, "seed", "seed must be"),
        (
            {"model": "tiny", "prompt": "x", "stream": "yes"},
            "stream",
            "stream must be true or false",
        ),
        (
            {"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when stream",
        ),
        ({"model": "tiny", "prompt": "x", "n": 0}, "n", "n must be an integer in [1, 16]"),
        ({"model": "tiny", "prompt": "x", "n": 17}, "n", "n must be an integer in [1, 16]"),
        ({"model": "tiny", "prompt": "x", "n": 2, "best_of": 3}, "best_of", "not supported"),
        ({"model": "tiny", "prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be"),
        ({"model": "tiny", "prompt": "x", "logprobs": True}, "logprobs", "logprobs must be"),
        ({"model": "tiny", "prompt": "x", "stop": [""]}, "stop", "1..1024 characters"),
        ({"model": "tiny", "prompt": "x", "stop": 5}, "stop", "string or an array of strings"),
        ({"model": "tiny", "prompt": "x", "stop": ["a"] * 17}, "stop", "at most 16"),
        ({"model": "tiny", "prompt": "x", "echo": True}, "echo", "not supported"),
        ({"model": "tiny", "prompt": "x", "suffix": "z"}, "suffix", "not supported"),
        ({"model": "tiny", "prompt": "x", "logit_bias": {"1": 5}}, "logit_bias", "not supported"),
        (
            {"model": "tiny", "prompt": "x", "max_tokens": 4, "min_tokens": 5},
            "min_tokens",
            "less than or equal to max_tokens=4",
        ),
        ({"model": "tiny", "prompt": "x", "min_tokens": -1}, "min_tokens", "min_tokens must be"),
        ({"model": "tiny", "prompt": "x", "presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        (
            {"model": "tiny", "prompt": "x", "frequency_penalty": "x"},
            "frequency_penalty",
            "must be a number",
        ),
        ({"model": "tiny", "prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "> 0"),
        (
            {"model": "tiny", "prompt": "x", "repetition_penalty": 101},
            "repetition_penalty",
            "[0, 100]",
        ),
        (
            {"model": "tiny", "prompt": "x", "top_logprobs": 2},
            "top_logprobs",
            "Unrecognized request argument",
        ),
        (
            {
                "model": "tiny",
                "prompt": "x",
                "stream": True,
                "stream_options": {"continuous_usage_stats": 1},
            },
            "stream_options.continuous_usage_stats",
            "true or false",
        ),
        ({"model": "tiny", "prompt": "x", "stop_token_ids": [300]}, "stop_token_ids", "[0, 259)"),
        ({"model": "tiny", "prompt": "x", "handoff_mode": "fast"}, "handoff_mode", "one-shot"),
        ({"model": "tiny", "prompt": "x", "bogus": 1}, "bogus", "Unrecognized request argument"),
    ],
)
def test_bad_bodies_get_400_naming_the_problem(body, param, fragment):
    with pytest.raises(ApiError) as info:
        parse(body)
    err = info.value
    assert err.status == 400, err.message
    assert fragment in err.message
    assert err.param == param
    shape = err.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"}
    assert shape["type"] == "invalid_request_error"


def test_unknown_model_is_404():
    with pytest.raises(ApiError) as info:
        parse({"model": "gpt-5", "prompt": "x"})
    assert info.value.status == 404 and info.value.code == "model_not_found"
    assert "`gpt-5` does not exist" in info.value.message


def test_response_shapes():
    r = parse({"model": "tiny", "prompt": [1, 2], "return_token_ids": True})
    pdd = {"ttft_s": 0.1}
    body = completion_response("cmpl-1", 5, "tiny", "ab", "eos", r, [97, 98, 257], pdd)
    assert body["object"] == "text_completion" and body["pdd"] is pdd
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["token_ids"] == [97, 98, 257]
    assert choice["prompt_token_ids"] == [1, 2]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 3, "total_tokens": 5}
    chunk = completion_chunk("cmpl-1", 5, "tiny", "a", r, [97], first=True)
    assert chunk["choices"][0]["finish_reason"] is None and "pdd" not in chunk
    assert chunk["choices"][0]["prompt_token_ids"] == [1, 2]
    last = completion_chunk("cmpl-1", 5, "tiny", "", r, (), "length", pdd)
    assert last["choices"][0]["finish_reason"] == "length" and last["pdd"] is pdd
    assert models_response(MODEL, 1)["data"][0]["id"] == "tiny"


def test_incremental_detokenizer_never_splits_a_character():
    ids = TOK.encode("héllo → wörld", add_bos=False)
    detok = IncrementalDetokenizer(lambda t: TOK.decode(t))
    deltas = [detok.feed([i]) for i in ids]
    assert "".join(deltas) + detok.flush() == "héllo → wörld"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1] == "" and deltas[2] == "é"  # first byte of é held back
    # A truncated character at the end is flushed as U+FFFD rather than lost.
    d2 = IncrementalDetokenizer(lambda t: TOK.decode(t))
    assert d2.feed([97]) == "a" and d2.feed([0xE2]) == "" and d2.flush() == "\ufffd"


# -- the router's HTTP surface, with scripted daemons on the real transport --------------------


class ScriptedDaemon:
    """A peer speaking the real protocol over the real transport: records what the router sends
    and lets the test answer as P / RLD / MD would."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.received: list = []
        self.conns: list = []
        self.got = asyncio.Event()

    async def start(self) -> int:
        from pddnet.transport import Server

        self.server = Server(
            "127.0.0.1",
            0,
            role=self.role,
            instance_id=f"test-{self.role}",
            secret=b"s3cret",
            on_connection=self._on_conn,
        )
        return await self.server.start()

    async def _on_conn(self, conn) -> None:
        self.conns.append(conn)
        with contextlib.suppress(Exception):
            # as a real daemon does when the router connects: its links (here: just started)
            await conn.send(m.LinkState(link="started", up=True, since=time.time(), ready=True))
            async for msg in conn:
                self.received.append(msg)
                self.got.set()

    async def send(self, msg) -> None:
        await self.conns[-1].send(msg)

    async def wait_for(self, kind, timeout: float = 5.0):
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            for msg in self.received:
                if isinstance(msg, kind):
                    return msg
            self.got.clear()
            await asyncio.wait_for(self.got.wait(), deadline - asyncio.get_running_loop().time())


@contextlib.asynccontextmanager
async def scripted_router(**router_overrides):
    from pddnet.config import load_config
    from pddnet.roles.router import Router

    daemons = {r: ScriptedDaemon(r) for r in ("prefill", "relay", "main_decode")}
    ports = {r: await d.start() for r, d in daemons.items()}
    overrides = {"secret": "s3cret", "router.port": 0, **{f"{r}.port": p for r, p in ports.items()}}
    overrides.update({f"router.{k}": v for k, v in router_overrides.items()})
    router = Router(load_config(None, overrides))
    await router.start()
    try:
        await router.wait_connected(10)
        await wait_for(
            lambda: all(d.conns for d in daemons.values()), 10, "the router at every daemon", 0.01
        )
        yield router, daemons
    finally:
        await router.close()
        for d in daemons.values():
            await d.server.close()


async def send_tokens(daemon, rid, index, ids, producer="relay", **extra):
    """The scripted daemon produces tokens `ids` at `index` of request `rid`."""
    await daemon.send(
        m.TokenEvent(
            request_id=rid,
            index=index,
            token_ids=tuple(ids),
            producer=producer,
            time=time.time(),
            **extra,
        )
    )


async def send_done(daemon, rid, n, producer="relay"):
    """The scripted daemon ends request `rid` after `n` tokens (3 prompt tokens, length)."""
    await daemon.send(
        m.RequestDone(
            request_id=rid,
            reason="length",
            num_prompt_tokens=3,
            num_output_tokens=n,
            producer=producer,
            time=time.time(),
        )
    )


async def send_timeline(daemon, rid, event, producer, **detail):
    """The scripted daemon reports timeline `event` of request `rid` (detail_int, detail_str)."""
    await daemon.send(
        m.Timeline(request_id=rid, event=event, time=time.time(), producer=producer, **detail)
    )


async def submits(daemon, n: int) -> list:
    """The first `n` SUBMITs the scripted daemon receives (one per choice of an n > 1 request)."""

    def got() -> list | None:
        subs = [x for x in daemon.received if isinstance(x, m.Submit)]
        return subs if len(subs) >= n else None

    return await wait_for(got, 5, f"{n} SUBMITs", 0.01)


def sse_events(body: bytes) -> list[dict]:
    """The complete JSON events of an SSE body, read in whole or in part."""
    return [
        json.loads(line[6:]) for line in body.split(b"\n\n")[:-1] if line.startswith(b"data: {")
    ]


def post_completion(http, router, path="/v1/completions", **body):
    """The client's POST of `body` (model "tiny"), running while the test scripts the daemons'
    answers."""
    return asyncio.ensure_future(http.post(router.url + path, json={"model": "tiny", **body}))


@contextlib.asynccontextmanager
async def scripted_post(path="/v1/completions", **body):
    """A scripted router with the client's POST of `body` running: (the pending response, the
    router, its daemons, the client's session)."""
    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        yield post_completion(http, router, path, **body), router, daemons, http


STREAM_WITH_USAGE = {"stream": True, "stream_options": {"include_usage": True}}


async def test_router_assembles_out_of_order_tokens_from_two_producers():
    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        post = post_completion(
            http, router, prompt="ab", max_tokens=5, temperature=0.5, return_token_ids=True
        )
        sub = await daemons["prefill"].wait_for(m.Submit)
        assert sub.prompt_token_ids == (256, 97, 98) and sub.seed is not None  # seed fixed
        rid = sub.request_id
        md, rld = daemons["main_decode"], daemons["relay"]
        await send_tokens(md, rid, 3, (100, 101), "main_decode")
        await send_timeline(
            rld, rid, "handoff_end", "main_decode", detail_int=40, detail_str="one-shot"
        )
        await send_tokens(rld, rid, 0, (72, 105, 33))
        await send_done(md, rid, 5, "main_decode")
        resp = await post
        body = await resp.json()
        assert resp.status == 200, body
        choice = body["choices"][0]
        assert choice["token_ids"] == [72, 105, 33, 100, 101] and choice["text"] == "Hi!de"
        assert choice["finish_reason"] == "length"
        pdd = body["pdd"]
        assert (pdd["relay_tokens"], pdd["main_tokens"]) == (3, 2)
        assert pdd["handoff_mode"] == "one-shot" and pdd["handoff_bytes"] == 40
        assert pdd["seed"] == sub.seed and pdd["ttft_s"] >= 0
        assert [e["event"] for e in pdd["timeline"]][0] == "arrival"
        async with http.get(router.url + "/metrics") as r:
            text = await r.text()
        assert 'pdd_router_output_tokens_total{producer="relay"} 3.0' in text
        assert 'pdd_router_requests_total{finish_reason="length"} 1.0' in text


async def test_router_conflict_is_an_error_and_cancels_everywhere():
    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        post = post_completion(http, router, prompt=[1, 2], max_tokens=4, temperature=0)
        rid = (await daemons["prefill"].wait_for(m.Submit)).request_id
        await send_tokens(daemons["relay"], rid, 0, (5, 6))
        await send_tokens(daemons["main_decode"], rid, 1, (7,), "main_decode")
        resp = await post
        body = await resp.json()
        assert resp.status == 500 and "conflict at token index 1" in body["error"]["message"]
        for d in daemons.values():
            assert (await d.wait_for(m.Cancel)).request_id == rid


async def test_router_overload_disconnect_and_http_errors():
    async with (
        scripted_router(max_concurrent_requests=1, max_body_bytes=4096) as (router, daemons),
        aiohttp.ClientSession() as http,
    ):
        url = router.url + "/v1/completions"
        async with http.get(router.url + "/health") as r:
            assert r.status == 200 and (await r.json())["status"] == "ok"
        async with http.get(router.url + "/v1/models") as r:
            assert (await r.json())["data"][0]["id"] == "tiny"
        async with http.post(url, data=b"{not json") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]
        async with http.post(url, data=b"x" * 5000) as r:
            assert r.status == 413
        async with http.post(url, json={"model": "nope", "prompt": "x"}) as r:
            assert r.status == 404 and (await r.json())["error"]["code"] == "model_not_found"
        # One request in flight (streaming, never answered) fills the router: the next gets 503.
        first = await http.post(
            url,
            json={
                "model": "tiny",
                "prompt": "x",
                "stream": True,
                "max_tokens": 50,
                "temperature": 0,
            },
        )
        rid = (await daemons["prefill"].wait_for(m.Submit)).request_id
        await send_tokens(daemons["relay"], rid, 0, (65,))
        line = await first.content.readline()
        assert line.startswith(b"data: ") and json.loads(line[6:])["choices"][0]["text"] == "A"
        async with http.post(url, json={"model": "tiny", "prompt": "y"}) as r:
            body = await r.json()
            assert r.status == 503 and body["error"]["code"] == "overloaded"
        # The client goes away mid-stream: CANCEL reaches P, RLD and MD.
        first.close()
        for d in daemons.values():
            assert (await d.wait_for(m.Cancel)).request_id == rid
        assert router.stats()["cancelled"] == 1


async def test_health_is_ok_only_when_every_daemon_reports_all_its_links_up():
    """Issue 23: /health aggregates the daemons' LINK_STATE; a daemon missing a link keeps it
    503, naming the link, since when and why."""

    async def health(http, status):
        async with http.get(router.url + "/health") as r:
            return (await r.json()) if r.status == status else None

    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        ok = await wait_for(lambda: health(http, 200), 5, "/health ok")
        assert ok["waiting_for"] == [] and ok["peers"] == dict.fromkeys(daemons, True)
        await daemons["prefill"].send(
            m.LinkState(
                link="main-decode control",
                up=False,
                since=time.time(),
                ready=False,
                detail="redial: cannot connect to 10.0.0.2:7300",
            )
        )
        body = await wait_for(lambda: health(http, 503), 5, "/health degraded")
        assert body["status"] == "degraded" and body["peers"]["prefill"] is False
        [line] = body["waiting_for"]
        assert line.startswith("prefill: main-decode control down since ")
        assert line.endswith("(redial: cannot connect to 10.0.0.2:7300)")
        link = body["links"]["prefill"]["links"]["main-decode control"]
        assert link["up"] is False and "10.0.0.2" in link["detail"]
        await daemons["prefill"].send(
            m.LinkState(link="main-decode control", up=True, since=time.time(), ready=True)
        )
        await wait_for(lambda: health(http, 200), 5, "/health ok again")


@pytest.mark.parametrize("order", ["handed-then-lost", "lost-then-handed"])
async def test_a_request_p_handed_to_rld_is_replayed_at_once_when_rld_is_lost(order):
    """Issue 23's silent requests: P has handed the request to RLD (KV_DONE out, P forgets it)
    and RLD dies before its own rld_kv_complete. The router replays it on MD at once, in
    either order of the two news, instead of at the 30 s stall timer."""
    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        p, rld, md = daemons["prefill"], daemons["relay"], daemons["main_decode"]
        post = post_completion(http, router, prompt=[1, 2], max_tokens=3, temperature=0)
        rid = (await p.wait_for(m.Submit)).request_id
        handed = m.Timeline(
            request_id=rid, event="rld_kv_sent", time=time.time(), producer="prefill", detail_int=64
        )

        async def relay_gone():
            return router.peers["relay"].conn is None

        async def relay_carries():
            return router.requests[rid].owner == "relay"

        if order == "handed-then-lost":
            await p.send(handed)
            await wait_for(relay_carries, 5, "the router to count RLD as the carrier")
            await rld.server.close()
        else:
            await rld.server.close()
            await wait_for(relay_gone, 5, "the router to see RLD gone")
            await p.send(handed)
        replay = await md.wait_for(m.Submit, timeout=5)  # the stall timer would be 30 s
        assert replay.request_id == rid and replay.output_token_ids == ()
        await send_tokens(md, rid, 0, (72, 105, 33), "main_decode")
        await send_done(md, rid, 3, "main_decode")
        resp = await post
        body = await resp.json()
        assert resp.status == 200 and body["choices"][0]["text"] == "Hi!", body
        assert router.stats()["replays"] == 1 and "stalls" not in router.stats()
        async with http.get(router.url + "/metrics") as r:
            metrics = await r.text()
        assert "pdd_router_stall_replays_total 0.0" in metrics


async def test_md_lost_right_after_rlds_cut_is_replayed_at_once():
    """The same window at the handoff: RLD has cut (handoff_start) and MD dies before any of
    its tokens or its handoff_end reach the router. MD is a carrier from handoff_start on, so
    its loss replays the request on RLD at once, not at the stall timer."""
    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        p, rld, md = daemons["prefill"], daemons["relay"], daemons["main_decode"]
        post = post_completion(http, router, prompt=[1, 2], max_tokens=3, temperature=0)
        rid = (await p.wait_for(m.Submit)).request_id
        await send_tokens(rld, rid, 0, (72,))
        await send_timeline(rld, rid, "handoff_start", "relay", detail_int=1, detail_str="one-shot")
        await md.server.close()
        replay = await rld.wait_for(m.Submit, timeout=5)  # the stall timer would be 30 s
        assert replay.request_id == rid and replay.output_token_ids == (72,)
        await send_tokens(rld, rid, 1, (105, 33))
        await send_done(rld, rid, 3)
        resp = await post
        body = await resp.json()
        assert resp.status == 200 and body["choices"][0]["text"] == "Hi!", body
        assert "stalls" not in router.stats()


async def test_router_health_is_503_without_its_daemons():
    from pddnet.cluster.wan_setup import free_port
    from pddnet.config import load_config
    from pddnet.roles.router import Router

    ports = {f"{r}.port": free_port() for r in ("prefill", "main_decode")}
    router = Router(
        load_config(None, {"secret": "s", "router.port": 0, "mode": "cross-dc", **ports})
    )
    await router.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(router.url + "/health") as r:
                body = await r.json()
                assert r.status == 503 and body["peers"] == {"prefill": False, "main_decode": False}
                assert [w.split(":")[0] for w in body["waiting_for"]] == ["prefill", "main_decode"]
            async with http.post(
                router.url + "/v1/completions", json={"model": "tiny", "prompt": "x"}
            ) as r:
                assert r.status == 503 and "not connected" in (await r.json())["error"]["message"]
    finally:
        await router.close()


# -- issue 24: vLLM's sampling extensions, stop strings, n, logprobs, chat ----------------------


def test_extension_fields_parse_and_travel_in_the_sampling_fields():
    r = parse(
        {
            "model": "tiny",
            "prompt": "x",
            "max_tokens": 30,
            "min_tokens": 10,
            "stop": "\n\n",
            "n": 3,
            "best_of": 3,
            "logprobs": 5,
            "presence_penalty": 0.5,
            "frequency_penalty": -1,
            "repetition_penalty": 1.3,
            "include_stop_str_in_output": True,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
    )
    assert (r.n, r.min_tokens, r.stop, r.logprobs) == (3, 10, ("\n\n",), 5)
    assert r.include_stop_str_in_output and r.continuous_usage and not r.chat
    fields = r.sampling_fields()
    assert fields["min_tokens"] == 10 and fields["repetition_penalty"] == 1.3
    assert fields["frequency_penalty"] == -1.0 and fields["logprobs"] == 5
    from pddnet.protocol import Submit

    Submit(request_id="r", prompt_token_ids=r.prompt_token_ids, seed=1, **fields)  # valid wire


def parse_chat(body, limit=4096, template=None):
    from pddnet.api.parse import parse_chat_request
    from pddnet.model.chat_template import load_chat_template

    template = template or load_chat_template(None, TOK)

    def render(messages, add_generation_prompt, kwargs):
        text = template.render(messages, add_generation_prompt, **kwargs)
        return TOK.encode(text, add_bos=template.add_bos), text

    return parse_chat_request(body, MODEL, render, limit)


def test_chat_request_renders_the_messages():
    r = parse_chat(
        {
            "model": "tiny",
            "messages": [
                {"role": "system", "content": "S"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                },
            ],
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 2,
        }
    )
    assert r.chat and r.prompt_text == "system: S\nuser: a\nb\nassistant:"
    assert r.prompt_token_ids == tuple(TOK.encode(r.prompt_text, add_bos=True))
    assert (r.max_tokens, r.logprobs) == (9, 2)
    # default max_tokens: the rest of the context, within the server's limit
    r = parse_chat({"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, limit=100)
    assert r.max_tokens == 100 and r.logprobs is None
    r = parse_chat(
        {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "logprobs": True}
    )
    assert r.logprobs == 0
    r = parse_chat(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "add_generation_prompt": False,
            "tools": [],
            "response_format": {"type": "text"},
        }
    )
    assert r.prompt_text == "user: hi\n"


@pytest.mark.parametrize(
    "extra, param, fragment",
    [
        ({"messages": []}, "messages", "non-empty array"),
        ({"messages": "hi"}, "messages", "non-empty array"),
        (
            {"messages": [{"role": "user", "content": 3}]},
            "messages[0].content",
            "string or an array of text parts",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content",
            "only text parts",
        ),
        ({"messages": [{"content": "x"}]}, "messages[0].role", "role must be a non-empty string"),
        (
            {"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
            "messages[0].tool_calls",
            "not supported",
        ),
        ({"tools": [{"type": "function"}]}, "tools", "not supported"),
        ({"tool_choice": "auto"}, "tool_choice", "not supported"),
        ({"response_format": {"type": "json_object"}}, "response_format", "not supported"),
        ({"logit_bias": {"5": 1}}, "logit_bias", "not supported"),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs to be true"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "[0, 20]"),
        ({"max_completion_tokens": 0}, "max_completion_tokens", "must be an integer >= 1"),
        ({"max_tokens": 5000}, "max_tokens", "server's limit"),
        ({"prompt": "x"}, "prompt", "Unrecognized request argument"),
        ({"suffix": "x"}, "suffix", "Unrecognized request argument"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs", "must be an object"),
    ],
)
def test_bad_chat_bodies_get_400_naming_the_field(extra, param, fragment):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **extra}
    with pytest.raises(ApiError) as info:
        parse_chat(body)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert fragment in info.value.message


def test_choice_text_stop_strings_as_vllm():
    from pddnet.lifecycle.choice_text import ChoiceText

    def decode(ids):
        return TOK.decode(ids)

    ids = TOK.encode("Hello STOP world", add_bos=False)
    t = ChoiceText(decode, ("STOP",))
    kept = t.feed(ids)
    assert kept == len("Hello STOP") and t.text == "Hello " and t.stopped == "STOP"
    assert t.final and t.emittable == len("Hello ")
    inc = ChoiceText(decode, ("STOP", "xyz"), include_stop=True)
    assert inc.feed(ids) == len("Hello STOP") and inc.text == "Hello STOP"
    # streaming holds back len(longest stop) - 1 characters, so no part of a stop is sent
    held = ChoiceText(decode, ("STOP",))
    assert held.feed(TOK.encode("Hello ST", add_bos=False)) is None
    assert held.text[: held.emittable] == "Hello"
    assert held.finish() is False and held.text[: held.emittable] == "Hello ST"
    # not before min_tokens tokens: a stop string inside the first min_tokens is text
    late = ChoiceText(decode, ("l",), min_tokens=3)
    assert late.feed(TOK.encode("hello", add_bos=False)) == 4 and late.text == "hel"
    # a stop string completed by text the detokenizer held back (a cut UTF-8 character)
    euro = ChoiceText(decode, ("€",))
    raw = list("a€".encode())
    assert euro.feed(raw) == 4 and euro.text == "a"


def test_chat_and_logprob_shapes():
    from pddnet.api.responses import (
        ChoiceResult,
        chat_logprobs,
        completion_logprobs,
        response_body,
    )

    r = parse_chat(
        {
            "model": "tiny",
            "messages": [{"role": "user", "content": "hi"}],
            "return_token_ids": True,
            "logprobs": True,
            "top_logprobs": 1,
        }
    )
    body = response_body(
        "chatcmpl-1",
        5,
        "tiny",
        r,
        [ChoiceResult(0, "ab", [97, 98], "length", None, None, {"x": 1})],
        {"x": 1},
    )
    assert body["object"] == "chat.completion" and body["prompt_token_ids"][0] == 256
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "ab"}
    assert choice["token_ids"] == [97, 98] and choice["finish_reason"] == "length"
    assert body["usage"] == {
        "prompt_tokens": len(r.prompt_token_ids),
        "completion_tokens": 2,
        "total_tokens": len(r.prompt_token_ids) + 2,
    }
    entries = [(-0.5, (98, 97), (-0.1, -0.5)), None]
    chat = chat_logprobs([97, 98], entries, lambda t: chr(t))
    assert chat["content"][0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [
            {"token": "b", "logprob": -0.1, "bytes": [98]},
            {"token": "a", "logprob": -0.5, "bytes": [97]},
        ],
    }
    assert chat["content"][1]["logprob"] is None
    comp, end = completion_logprobs(
        [97, 98], [(-0.5, (98,), (-0.1,)), (-1.0, (), ())], lambda t: chr(t), offset=3
    )
    assert (
        comp
        == {
            "text_offset": [3, 4],
            "token_logprobs": [-0.5, -1.0],
            "tokens": ["a", "b"],
            "top_logprobs": [{"b": -0.1, "a": -0.5}, {"b": -1.0}],
        }
        and end == 5
    )
    first = completion_chunk("c", 1, "tiny", "a", r, [97], first=True)
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "a"}
    assert first["prompt_token_ids"][0] == 256
    last = completion_chunk("c", 1, "tiny", "", r, (), "stop", {"p": 1}, stop_reason="\n")
    assert last["choices"][0]["delta"] == {} and last["choices"][0]["stop_reason"] == "\n"


async def test_router_stop_string_ends_the_choice_and_cancels_the_daemons():
    async with scripted_post(
        prompt="ab",
        max_tokens=50,
        temperature=0,
        stop=["!!", "zz"],
        return_token_ids=True,
        stream=True,
    ) as (post, router, daemons, _):
        rid = (await daemons["prefill"].wait_for(m.Submit)).request_id
        await send_tokens(daemons["relay"], rid, 0, b"Hi!")
        await send_tokens(daemons["main_decode"], rid, 4, b"yy", "main_decode")  # not released yet
        await send_tokens(daemons["relay"], rid, 3, b"!x")  # "Hi!!" completes "!!" at index 3
        resp = await post
        lines = sse_events(await resp.read())
        text = "".join(c["choices"][0]["text"] for c in lines)
        ids = [t for c in lines for t in c["choices"][0].get("token_ids", [])]
        assert text == "Hi" and ids == list(b"Hi!!")  # the stop string is not in the text
        last = lines[-1]["choices"][0]
        assert last["finish_reason"] == "stop" and last["stop_reason"] == "!!"
        assert all("!" not in c["choices"][0]["text"] for c in lines)  # never sent, held
        for d in daemons.values():  # every daemon is told to stop and free the request
            cancel = await d.wait_for(m.Cancel)
            assert cancel.request_id == rid and "stop string" in cancel.reason
        assert router.stats()["active_requests"] == 0


async def test_router_n_choices_have_derived_seeds_and_logprobs():
    async with scripted_post(
        prompt="ab",
        max_tokens=2,
        temperature=0.7,
        seed=41,
        n=2,
        logprobs=1,
        return_token_ids=True,
    ) as (post, _, daemons, _):
        subs = await submits(daemons["prefill"], 2)
        assert [s.seed for s in subs] == [41, 42] and all(s.logprobs == 1 for s in subs)
        for i, sub in enumerate(subs):
            await send_tokens(
                daemons["relay"],
                sub.request_id,
                0,
                [65 + i, 66],
                logprobs=(-0.25, -0.5),
                top_logprob_ids=(65 + i, 66),
                top_logprobs=(-0.25, -0.5),
            )
            await send_done(daemons["relay"], sub.request_id, 2)
        resp = await post
        body = await resp.json()
        assert resp.status == 200, body
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == ["AB", "BB"]
        assert body["usage"]["completion_tokens"] == 4
        lp = body["choices"][1]["logprobs"]
        assert lp["tokens"] == ["B", "B"] and lp["token_logprobs"] == [-0.25, -0.5]
        assert lp["top_logprobs"] == [{"B": -0.25}, {"B": -0.5}]
        assert body["choices"][0]["pdd"]["seed"] == 41 and body["choices"][1]["pdd"]["seed"] == 42
        assert body["pdd"]["seed"] == 41


async def test_router_chat_stream_shape():
    async with scripted_post(
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=3,
        temperature=0,
        **STREAM_WITH_USAGE,
    ) as (post, router, daemons, http):
        sub = await daemons["prefill"].wait_for(m.Submit)
        assert sub.prompt_token_ids == tuple(TOK.encode("user: hi\nassistant:", add_bos=True))
        await send_tokens(daemons["relay"], sub.request_id, 0, b"OK.")
        await send_done(daemons["relay"], sub.request_id, 3)
        resp = await post
        chunks = sse_events(await resp.read())
        assert all(c["object"] == "chat.completion.chunk" for c in chunks)
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": "OK."}
        assert chunks[-2]["choices"][0]["finish_reason"] == "length" and "pdd" in chunks[-2]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
        async with http.post(
            router.url + "/v1/chat/completions",
            json={"model": "tiny", "messages": [{"role": "user"}], "tools": [{"type": "function"}]},
        ) as r:
            err = (await r.json())["error"]
            assert r.status == 400 and err["param"] == "tools"


async def test_router_streams_n_choices_each_to_its_end():
    async with scripted_post(
        prompt="ab", max_tokens=3, temperature=0, n=2, **STREAM_WITH_USAGE
    ) as (post, _, daemons, _):
        subs = await submits(daemons["prefill"], 2)
        assert [s.seed for s in subs] == [None, None]  # greedy: both choices alike
        await send_tokens(daemons["relay"], subs[1].request_id, 0, b"xyz")  # choice 1 ends first
        await send_done(daemons["relay"], subs[1].request_id, 3)
        # Choice 1's end reaches the client before choice 0 goes on (RLD's and MD's connections
        # to the router are not ordered with each other).
        resp = await asyncio.wait_for(post, 5)
        head = b""
        while not [c for c in sse_events(head) if c["choices"][0]["finish_reason"] == "length"]:
            more = await asyncio.wait_for(resp.content.readany(), 5)
            assert more, "the stream ended before choice 1 did"
            head += more
        await send_tokens(daemons["relay"], subs[0].request_id, 0, b"xy")
        await send_tokens(daemons["main_decode"], subs[0].request_id, 2, b"z", "main_decode")
        await send_done(daemons["main_decode"], subs[0].request_id, 3, "main_decode")
        chunks = sse_events(head + await resp.read())
        texts = {0: "", 1: ""}
        for c in chunks[:-1]:
            (choice,) = c["choices"]
            texts[choice["index"]] += choice["text"]
        assert texts == {0: "xyz", 1: "xyz"}
        finals = [
            c["choices"][0]["index"]
            for c in chunks[:-1]
            if c["choices"][0]["finish_reason"] == "length"
        ]
        assert finals == [1, 0]
        assert chunks[-1]["usage"]["completion_tokens"] == 6
