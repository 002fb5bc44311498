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

from pddnet.model.tokenizer import ByteTokenizer
from pddnet.roles.openai_api import (
    ApiError,
    IncrementalDetokenizer,
    ModelInfo,
    completion_chunk,
    completion_response,
    models_response,
    parse_completion_request,
)

TOK = ByteTokenizer()
MODEL = ModelInfo(name="tiny", vocab_size=259, max_position=4096, eos_token_id=257,
                  aliases=("tiny-alias",))


def parse(body, limit=4096):
    return parse_completion_request(body, MODEL, lambda t: TOK.encode(t, add_bos=True), limit)


def test_text_prompt_defaults():
    r = parse({"model": "tiny", "prompt": "hi"})
    assert r.prompt_token_ids == (256, ord("h"), ord("i")) and r.prompt_text == "hi"
    assert (r.max_tokens, r.temperature, r.top_p, r.top_k) == (16, 1.0, 1.0, 0)
    assert r.seed is None and r.needs_seed and not r.stream and not r.ignore_eos
    assert parse({"model": "tiny-alias", "prompt": "x", "temperature": 0}).needs_seed is False


@pytest.mark.parametrize("prompt, ids", [
    ([1, 2, 3], (1, 2, 3)),
    (["ab"], (256, 97, 98)),
    ([[5, 6]], (5, 6)),
    ("", (256,)),
])
def test_prompt_forms(prompt, ids):
    assert parse({"model": "tiny", "prompt": prompt}).prompt_token_ids == ids


def test_full_body():
    r = parse({"model": "tiny", "prompt": [1, 2], "max_tokens": 7, "temperature": 0.7,
               "top_p": 0.9, "top_k": -1, "seed": 2**64 - 1, "stream": True,
               "stream_options": {"include_usage": True}, "return_token_ids": True,
               "ignore_eos": True, "stop_token_ids": [10], "handoff_mode": "streaming",
               "n": 1, "echo": False, "logprobs": None, "stop": [], "user": "u"})
    assert (r.max_tokens, r.top_k, r.seed, r.stream, r.include_usage) == (7, 0, 2**64 - 1, True,
                                                                         True)
    assert r.return_token_ids and r.ignore_eos and r.stop_token_ids == (10,)
    assert r.handoff_mode == "streaming" and not r.needs_seed


@pytest.mark.parametrize("body, param, fragment", [
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
    ({"model": "tiny", "prompt": [1] * 4000, "max_tokens": 100}, "max_tokens",
     "maximum context length is 4096"),
    ({"model": "tiny", "prompt": "x", "temperature": "hot"}, "temperature", "must be a number"),
    ({"model": "tiny", "prompt": "x", "temperature": 3}, "temperature", "[0, 2]"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, "top_p", "(0, 1]"),
    ({"model": "tiny", "prompt": "x", "top_p": 1.5}, "top_p", "[0, 1]"),
    ({"model": "tiny", "prompt": "x", "top_k": -2}, "top_k", "top_k must be"),
    ({"model": "tiny", "prompt": "x", "seed": -1}, "seed", "seed must be"),
    ({"model": "tiny", "prompt": "x", "seed": 2**64}, "seed", "seed must be"),
    ({"model": "tiny", "prompt": "x", "stream": "yes"}, "stream", "stream must be true or false"),
    ({"model": "tiny", "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", "only allowed when stream"),
    ({"model": "tiny", "prompt": "x", "n": 2}, "n", "not supported"),
    ({"model": "tiny", "prompt": "x", "logprobs": 3}, "logprobs", "not supported"),
    ({"model": "tiny", "prompt": "x", "stop": ["\n"]}, "stop", "not supported"),
    ({"model": "tiny", "prompt": "x", "echo": True}, "echo", "not supported"),
    ({"model": "tiny", "prompt": "x", "stop_token_ids": [300]}, "stop_token_ids", "[0, 259)"),
    ({"model": "tiny", "prompt": "x", "handoff_mode": "fast"}, "handoff_mode", "one-shot"),
    ({"model": "tiny", "prompt": "x", "bogus": 1}, "bogus", "Unrecognized request argument"),
])
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

        self.server = Server("127.0.0.1", 0, role=self.role, instance_id=f"test-{self.role}",
                             secret=b"s3cret", on_connection=self._on_conn)
        return await self.server.start()

    async def _on_conn(self, conn) -> None:
        self.conns.append(conn)
        with contextlib.suppress(Exception):
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
        for d in daemons.values():
            while not d.conns:
                await asyncio.sleep(0.01)
        yield router, daemons
    finally:
        await router.close()
        for d in daemons.values():
            await d.server.close()


async def test_router_assembles_out_of_order_tokens_from_two_producers():
    from pddnet.protocol import messages as m

    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        post = asyncio.ensure_future(http.post(
            router.url + "/v1/completions",
            json={"model": "tiny", "prompt": "ab", "max_tokens": 5, "temperature": 0.5,
                  "return_token_ids": True}))
        sub = await daemons["prefill"].wait_for(m.Submit)
        assert sub.prompt_token_ids == (256, 97, 98) and sub.seed is not None  # seed fixed
        rid = sub.request_id
        md, rld = daemons["main_decode"], daemons["relay"]
        await md.send(m.TokenEvent(request_id=rid, index=3, token_ids=(100, 101),
                                   producer="main_decode", time=time.time()))
        await rld.send(m.Timeline(request_id=rid, event="handoff_end", time=time.time(),
                                  producer="main_decode", detail_int=40, detail_str="one-shot"))
        await rld.send(m.TokenEvent(request_id=rid, index=0, token_ids=(72, 105, 33),
                                    producer="relay", time=time.time()))
        await md.send(m.RequestDone(request_id=rid, reason="length", num_prompt_tokens=3,
                                    num_output_tokens=5, producer="main_decode", time=time.time()))
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
    from pddnet.protocol import messages as m

    async with scripted_router() as (router, daemons), aiohttp.ClientSession() as http:
        post = asyncio.ensure_future(http.post(
            router.url + "/v1/completions",
            json={"model": "tiny", "prompt": [1, 2], "max_tokens": 4, "temperature": 0}))
        rid = (await daemons["prefill"].wait_for(m.Submit)).request_id
        await daemons["relay"].send(m.TokenEvent(request_id=rid, index=0, token_ids=(5, 6),
                                                 producer="relay", time=1.0))
        await daemons["main_decode"].send(m.TokenEvent(request_id=rid, index=1, token_ids=(7,),
                                                       producer="main_decode", time=1.1))
        resp = await post
        body = await resp.json()
        assert resp.status == 500 and "conflict at token index 1" in body["error"]["message"]
        for d in daemons.values():
            assert (await d.wait_for(m.Cancel)).request_id == rid


async def test_router_overload_disconnect_and_http_errors():
    from pddnet.protocol import messages as m

    async with scripted_router(max_concurrent_requests=1, max_body_bytes=4096) as (
            router, daemons), aiohttp.ClientSession() as http:
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
        first = await http.post(url, json={"model": "tiny", "prompt": "x", "stream": True,
                                           "max_tokens": 50, "temperature": 0})
        rid = (await daemons["prefill"].wait_for(m.Submit)).request_id
        await daemons["relay"].send(m.TokenEvent(request_id=rid, index=0, token_ids=(65,),
                                                 producer="relay", time=1.0))
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


async def test_router_health_is_503_without_its_daemons():
    from pddnet.cluster.wan_setup import free_port
    from pddnet.config import load_config
    from pddnet.roles.router import Router

    ports = {f"{r}.port": free_port() for r in ("prefill", "main_decode")}
    router = Router(load_config(None, {"secret": "s", "router.port": 0, "mode": "cross-dc",
                                       **ports}))
    await router.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.get(router.url + "/health") as r:
                body = await r.json()
                assert r.status == 503 and body["peers"] == {"prefill": False,
                                                             "main_decode": False}
            async with http.post(router.url + "/v1/completions",
                                 json={"model": "tiny", "prompt": "x"}) as r:
                assert r.status == 503 and "not connected" in (await r.json())["error"]["message"]
    finally:
        await router.close()
