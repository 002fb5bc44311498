"""The official `openai` Python client, pointed at the router of a real cluster, streams a
completion token-exact with the reference engine; models, non-streaming and errors work too."""

from __future__ import annotations

import pytest

from pddnet.cluster.local import LocalCluster
from pddnet.engine.engine import Engine
from pddnet.engine.sampling import SamplingParams
from pddnet.model.loader import load_model

openai = pytest.importorskip("openai")

PROMPT = "The WAN between two datacenters"


def _reference(max_tokens: int, temperature: float = 0.0, seed: int | None = None) -> list[int]:
    model, tok = load_model("tiny")
    engine = Engine(model, tok, num_blocks=64, block_size=16)
    try:
        return engine.generate(tok.encode(PROMPT, add_bos=True), max_tokens,
                               SamplingParams(temperature=temperature, seed=seed),
                               ignore_eos=True)
    finally:
        engine.close()


@pytest.mark.timeout(120)
async def test_official_client_streams_from_the_router():
    greedy = _reference(40)
    seeded = _reference(24, temperature=0.8, seed=1234)
    _, tok = load_model("tiny")
    async with LocalCluster(mode="pdd", wan="proxy", rtt_ms=30, bw_mbit=4) as cluster:
        client = openai.AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused",
                                    max_retries=0)
        try:
            models = await client.models.list()
            assert [m.id for m in models.data] == ["tiny"]

            stream = await client.completions.create(
                model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, stream=True,
                stream_options={"include_usage": True},
                extra_body={"return_token_ids": True, "ignore_eos": True})
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
                model="tiny", prompt=PROMPT, max_tokens=24, temperature=0.8, seed=1234,
                extra_body={"return_token_ids": True, "ignore_eos": True})
            assert whole.choices[0].model_extra["token_ids"] == seeded
            assert whole.choices[0].text == tok.decode(seeded)

            with pytest.raises(openai.BadRequestError) as info:
                await client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0)
            assert "max_tokens must be an integer >= 1" in str(info.value)
            with pytest.raises(openai.NotFoundError):
                await client.completions.create(model="gpt-4", prompt=PROMPT)
        finally:
            await client.close()
