"""The official `openai` Python client, pointed at the router of a real cluster, streams a
completion token-exact with the reference engine; models, non-streaming and errors work too.
And the chat API on a checkpoint folder with a chat template, with vLLM's sampling extensions
(issue 24)."""

from __future__ import annotations

import json
from pathlib import Path

import aiohttp
import pytest

from pddnet.cluster.local import LocalCluster
from pddnet.engine.engine import Engine
from pddnet.engine.sampling import SamplingParams, choice_seed
from pddnet.model.loader import load_model
from tests.test_chat_template import CHATML
from tests.test_cluster_e2e import wait_kv_free

openai = pytest.importorskip("openai")

PROMPT = "The WAN between two datacenters"


def _reference(max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> list[int]:
    model, tok = load_model("tiny")
    engine = Engine(model, tok, num_blocks=64, block_size=16)
    try:
        return engine.generate(
            tok.encode(PROMPT, add_bos=True),
            max_tokens,
            SamplingParams(temperature=temperature, seed=seed),
            ignore_eos=True,
        )
    finally:
        engine.close()


@pytest.mark.timeout(120)
async def test_official_client_streams_from_the_router():
    greedy = _reference(40)
    seeded = _reference(24, temperature=0.8, seed=1234)
    _, tok = load_model("tiny")
    async with LocalCluster(mode="pdd", wan="proxy", rtt_ms=30, bw_mbit=4) as cluster:
        client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]

            stream = await client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=40,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            text, ids, finish, pdd, usage = "", [], None, None, None
            chunks = 0
            async for chunk in stream:
                chunks += 1
                if chunk.usage is not None:
                    usage = chunk.usage
                if not chunk.choices:
                    continue
                choice = chunk.choices[0]
                text += choice.text
                ids += (choice.model_extra or {}).get("token_ids", [])
                finish = choice.finish_reason or finish
                pdd = (chunk.model_extra or {}).get("pdd", pdd)
            assert chunks > 2, "a stream of several chunks"
            assert ids == greedy
            assert text == tok.decode(greedy)
            assert finish == "length"
            assert usage is not None and usage.completion_tokens == 40
            assert pdd is not None and pdd["ttft_s"] > 0
            assert pdd["relay_tokens"] + pdd["main_tokens"] == 40
            events = [e["event"] for e in pdd["timeline"]]
            assert events[0] == "arrival" and "prefill_start" in events and events[-1] == "done"

            whole = await client.completions.create(
                model="tiny",
                prompt=PROMPT,
                max_tokens=24,
                temperature=0.8,
                seed=1234,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            assert whole.choices[0].model_extra["token_ids"] == seeded
            assert whole.choices[0].text == tok.decode(seeded)

            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
            assert "max_tokens must be an integer >= 1" in str(info.value)
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="gpt-4", prompt=PROMPT)
        finally:
            await client.close()


# -- chat completions on a real checkpoint folder, and vLLM's sampling extensions (issue 24) -----


def chat_checkpoint(folder: Path) -> Path:
    """The tiny preset's weights (seed 0) in Hugging Face layout, with SmolLM2-Instruct's chat
    template in tokenizer_config.json (the byte tokenizer: no tokenizer.json)."""
    from pddnet.model.config import ModelConfig
    from pddnet.model.loader import init_random, save_hf

    save_hf(init_random(ModelConfig.preset("tiny"), 0), folder)
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHATML, "bos_token": "<bos>", "eos_token": "<eos>"})
    )
    return folder


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.timeout(180)
async def test_chat_and_sampling_extensions_on_a_pdd_cluster(tmp_path):
    """One pdd cluster serving a checkpoint folder with a chat template: the official client's
    chat API streams token-exact (n = 2 with derived seeds too), AIPerf-style requests are
    served, a stop string ends a stream and frees the KV everywhere, turn 2 of a conversation
    ships only its new tokens' KV to MD, and unsupported fields get a 400 naming them."""
    from pddnet.model.chat_template import load_chat_template
    from pddnet.model.weights import load_hf

    folder = chat_checkpoint(tmp_path / "SmolTiny-Instruct")
    model, tok = load_hf(folder), load_model("tiny")[1]
    template = load_chat_template(folder, tok)

    def prompt_of(messages):
        return tok.encode(template.render(messages), add_bos=False)

    def ref(prompt, max_tokens, **sampling):
        ignore_eos = sampling.pop("_ignore_eos", False)
        engine = Engine(model, tok, num_blocks=128, block_size=16)
        try:
            return engine.generate(prompt, max_tokens, SamplingParams(**sampling), ignore_eos)
        finally:
            engine.close()

    chat = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Tell me about the WAN."},
    ]
    p1 = prompt_of(chat)
    greedy = ref(p1, 48)
    seeded = [ref(p1, 24, temperature=0.8, seed=choice_seed(99, i)) for i in range(2)]
    assert seeded[0] != seeded[1]
    # turn 1 of the conversation: >= 100 tokens, all ASCII but the last (it stops at the first
    # byte >= 128 once min_tokens is reached): its reply text reads back as the same tokens
    ascii_stop = list(range(128, 259))
    turn1 = ref(p1, 160, min_tokens=100, stop_token_ids=tuple(ascii_stop))
    assert len(turn1) > 100 and max(turn1[:-1]) < 128
    # a stop string from the middle of a long greedy reply
    long_prompt = prompt_of([{"role": "user", "content": "Write a long story."}])
    story = ref(long_prompt, 400, _ignore_eos=True)
    story_text = tok.decode(story)
    cut = next(
        i
        for i in range(len(tok.decode(story[:150])), len(story_text) - 2)
        if story_text[i : i + 2].isalnum() and story_text.find(story_text[i : i + 2]) == i
    )
    stop = story_text[cut : cut + 2]

    async with LocalCluster(
        mode="pdd",
        model=str(folder),
        wan="proxy",
        rtt_ms=30,
        overrides={"policy.pipeline": "p_rld_md"},
    ) as cluster:
        client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
        name = folder.name
        try:
            # (1) the official client's chat API, streamed, token-exact
            stream = await client.chat.completions.create(
                model=name,
                messages=chat,
                max_tokens=48,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True},
            )
            text, ids, roles, finish, usage, prompt_ids = "", [], [], None, None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                prompt_ids = (chunk.model_extra or {}).get("prompt_token_ids", prompt_ids)
                for choice in chunk.choices:
                    roles += [choice.delta.role] if choice.delta.role else []
                    text += choice.delta.content or ""
                    ids += (choice.model_extra or {}).get("token_ids", [])
                    finish = choice.finish_reason or finish
            assert prompt_ids == p1 and ids == greedy and text == tok.decode(greedy)
            assert roles == ["assistant"] and finish in ("stop", "length")
            assert usage.prompt_tokens == len(p1) and usage.completion_tokens == len(greedy)

            # n = 2: two completions, each with its own seed (seed + i), token-exact
            both = await client.chat.completions.create(
                model=name,
                messages=chat,
                max_tokens=24,
                temperature=0.8,
                seed=99,
                n=2,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            assert [c.index for c in both.choices] == [0, 1]
            assert [c.model_extra["token_ids"] for c in both.choices] == seeded
            assert [c.message.content for c in both.choices] == [tok.decode(s) for s in seeded]
            assert both.usage.completion_tokens == 48

            # (2) AIPerf-style: min_tokens, ignore_eos, stream_options.include_usage
            async with aiohttp.ClientSession() as http:
                for path, body in (
                    (
                        "/v1/chat/completions",
                        {
                            "messages": [
                                {
                                    "role": "user",
                                    "content": [{"type": "text", "text": "benchmark prompt"}],
                                }
                            ],
                            "max_completion_tokens": 40,
                        },
                    ),
                    ("/v1/completions", {"prompt": "benchmark prompt", "max_tokens": 40}),
                ):
                    body.update(
                        model=name,
                        stream=True,
                        min_tokens=40,
                        ignore_eos=True,
                        stream_options={"include_usage": True},
                    )
                    async with http.post(cluster.url + path, json=body) as r:
                        assert r.status == 200, await r.text()
                        events = [
                            json.loads(line[6:])
                            for line in (await r.read()).split(b"\n\n")
                            if line.startswith(b"data: {")
                        ]
                    assert (
                        events[-1]["choices"] == []
                        and events[-1]["usage"]["completion_tokens"] == 40
                    ), events[-1]

                # (4) a stop string: excluded from the text, finish_reason stop, KV freed
                body = {
                    "model": name,
                    "messages": [{"role": "user", "content": "Write a long story."}],
                    "max_tokens": 400,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stop": [stop],
                    "return_token_ids": True,
                    "stream": True,
                }
                async with http.post(cluster.url + "/v1/chat/completions", json=body) as r:
                    chunks = [
                        json.loads(line[6:])
                        for line in (await r.read()).split(b"\n\n")
                        if line.startswith(b"data: {")
                    ]
                got = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
                got_ids = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
                assert got == story_text[:cut] and stop not in got
                assert got_ids == story[: len(got_ids)] and len(got_ids) < 400
                assert stop in tok.decode(got_ids) and stop not in tok.decode(got_ids[:-1])
                assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
                assert chunks[-1]["choices"][0]["stop_reason"] == stop
                await wait_kv_free(cluster, ["prefill", "relay", "main_decode"])

            # (5) a conversation: turn 2 moves only its new tokens' KV over the WAN
            r1 = await client.chat.completions.create(
                model=name,
                messages=chat,
                max_tokens=160,
                temperature=0,
                extra_body={
                    "min_tokens": 100,
                    "stop_token_ids": ascii_stop,
                    "return_token_ids": True,
                },
            )
            out1 = r1.choices[0].model_extra["token_ids"]
            pdd1 = r1.model_extra["pdd"]
            assert out1 == turn1 and pdd1["main_tokens"] > 0, pdd1  # MD computed the reply
            chat2 = chat + [
                {"role": "assistant", "content": r1.choices[0].message.content},
                {"role": "user", "content": "And the relay?"},
            ]
            r2 = await client.chat.completions.create(  # long enough for MD to take it
                model=name,
                messages=chat2,
                max_tokens=100,
                temperature=0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            p2, pdd2 = r2.model_extra["prompt_token_ids"], r2.model_extra["pdd"]
            assert p2 == prompt_of(chat2)
            assert "md_kv_complete" in [e["event"] for e in pdd2["timeline"]], pdd2
            cached = common_prefix(p2, p1 + out1[:-1])  # what MD's radix tree holds of p2
            assert cached >= len(p1) + len(out1) - 1  # the whole first turn
            block = cluster.config.main_decode.block_size
            assert pdd2["prefix_hit_tokens"] == min(cached, len(p2) - 1) // block * block
            # the KV of turn 2's new tokens (plus the cached run's unfinished last block)
            shipped = len(p2) - pdd2["prefix_hit_tokens"]
            assert len(p2) - cached <= shipped < len(p2) - cached + block
            assert pdd2["wan_kv_bytes"] == shipped * 1024 < len(p2) * 1024 // 3

            # (6) unsupported fields: a 400 that names them
            for kwargs, field in (
                ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
                ({"logit_bias": {"5": 3}}, "logit_bias"),
                ({"extra_body": {"echo": True}}, "echo"),
            ):
                with pytest.raises(openai.BadRequestError) as info:
                    await client.chat.completions.create(
                        model=name, messages=chat, max_tokens=2, **kwargs
                    )
                assert info.value.body["param"] == field and field in info.value.message
            with pytest.raises(openai.BadRequestError, match="suffix"):
                await client.completions.create(model=name, prompt="x", suffix="y")
        finally:
            await client.close()
