"""`pdd bench handoff`: MD's side of both handoff transports fed frames by hand (no sockets),
and the --quick run through the emulated WAN as a smoke test: it completes, writes its JSON and
plots, and its numbers agree with each other (never with a clock)."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import pytest
import torch

from pddnet.bench import handoff, handoff_setup, handoff_sides, handoff_summary
from pddnet.bench.handoff_setup import KV_DIRECT, PATHS, TOKEN_ID
from pddnet.engine.sampling import SamplingParams
from pddnet.kv.transfer import export_kv
from pddnet.model.loader import load_model
from pddnet.protocol import Handoff, KvChunk, decode_bytes, encode_bytes

KVB = 1024  # the tiny model's KV bytes per token


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny")


@pytest.fixture(scope="module")
def prep(tiny):
    model, tok = tiny
    prompt = handoff_setup.make_prompts(
        1, 32, model.config.vocab_size, model.config.bos_token_id, 3
    )[0]
    p = handoff_setup.prepare_prompt(
        model, tok, 0, prompt, 12, SamplingParams(temperature=0.8, seed=5)
    )
    yield p
    p.rld_engine.close()


def wire(msg):
    """Through the codec, as the frame would cross."""
    return decode_bytes(encode_bytes(msg))


def cut(prep, n: int, rid: str) -> Handoff:
    return Handoff(
        request_id=rid,
        start_index=1,
        token_ids=tuple(prep.relay[1 : n + 1]),
        final=True,
        mode="one-shot",
    )


def kv_chunks(prep, n: int, rid: str, per: int) -> list[KvChunk]:
    engine = prep.rld_engine
    table = engine.get_sequence(prep.rld_request).block_table
    start = len(prep.prompt)
    ranges = [(s, min(start + n, s + per)) for s in range(start, start + n, per)]
    return [
        handoff_sides.kv_chunk(rid, i, s, e, export_kv(engine.pool, table, s, e).kv)
        for i, (s, e) in enumerate(ranges)
    ]


async def test_both_transports_leave_md_token_exact(tiny, prep):
    from concurrent.futures import ThreadPoolExecutor

    model, tok = tiny
    n = 9
    with ThreadPoolExecutor(1) as md:
        tid = handoff_sides.MainTrial(TOKEN_ID, "t-tok", n, prep, model, tok, md)
        await tid.setup()
        await tid.on_handoff(wire(cut(prep, n, "t-tok")), 0.0)
        got = await tid.done
        await tid.close()
        assert got["tokens"] == prep.reference[n + 1 : n + 3]
        assert got["forward_tokens"] == n + 1  # P's first token + n relay tokens, one extend

        kvd = handoff_sides.MainTrial(KV_DIRECT, "t-kv", n, prep, model, tok, md)
        await kvd.setup()
        chunks = [wire(c) for c in kv_chunks(prep, n, "t-kv", 4)]
        early = asyncio.create_task(kvd.on_chunk(chunks[-1], 1.0))  # it overtook the ids
        await asyncio.sleep(0.05)  # a deliberately idle period: the chunk must still wait
        assert not early.done() and not kvd.done.done()  # it waits for MD's reservation
        await kvd.on_handoff(wire(cut(prep, n, "t-kv")), 2.0)
        await early
        for c in chunks[:-1]:
            await kvd.on_chunk(c, 3.0)
        got = await kvd.done
        await kvd.close()
        assert got["tokens"] == prep.reference[n + 1 : n + 3]
        assert got["forward_tokens"] == 1  # MD only decodes the last relay token
        assert kvd.kv_bytes == n * KVB and got["t_arrived"] == 3.0


async def test_md_rejects_a_handoff_that_is_not_the_cut(tiny, prep):
    from concurrent.futures import ThreadPoolExecutor

    model, tok = tiny
    with ThreadPoolExecutor(1) as md:
        trial = handoff_sides.MainTrial(TOKEN_ID, "t-bad", 5, prep, model, tok, md)
        await trial.setup()
        with pytest.raises(ValueError, match="is not RLD's cut at 5"):
            await trial.on_handoff(cut(prep, 4, "t-bad"), 0.0)
        with pytest.raises(ValueError, match="KV_CHUNK on a token-id handoff"):
            await trial.on_chunk(kv_chunks(prep, 5, "t-bad", 8)[0], 0.0)
        await trial.close()
        kvd = handoff_sides.MainTrial(KV_DIRECT, "t-bad2", 5, prep, model, tok, md)
        await kvd.setup()
        outside = kv_chunks(prep, 9, "t-bad2", 8)[1]  # positions past the cut at 5
        with pytest.raises(ValueError, match="outside"):
            await kvd.on_chunk(outside, 0.0)
        await kvd.close()


def test_summaries_and_ratios_from_trials():
    def t(cond, path, n, lat, payload):
        return {
            "condition": cond,
            "path": path,
            "relay_tokens": n,
            "latency_s": lat,
            "wire_s": lat / 2,
            "md_s": lat / 2,
            "forward_s": lat / 3,
            "import_s": 0.0,
            "payload_bytes": payload,
            "kv_bytes_received": 0,
            "forward_tokens": 1,
            "token_exact": True,
        }

    trials = [t("quiet", TOKEN_ID, 10, x, 100) for x in (1.0, 1.0, 1.0, 1.0)]
    trials += [t("quiet", KV_DIRECT, 10, x, 5000) for x in (1.0, 1.0, 1.0, 5.0)]
    trials += [t("quiet", p, 120, 2.0, 200) for p in PATHS]
    trials += [t("jitter", TOKEN_ID, n, 2.0, 200) for n in (10, 120)]
    trials += [t("jitter", KV_DIRECT, n, 6.0, 200) for n in (10, 120)]
    rows = handoff_summary.summarise(trials, ["quiet", "jitter"], [120, 10])
    (r10, r120) = rows["quiet"]
    assert [r10["relay_tokens"], r120["relay_tokens"]] == [10, 120]
    assert r10[TOKEN_ID]["max_over_mean"] == 1.0
    assert r10[KV_DIRECT]["max_over_mean"] == pytest.approx(5.0 / 2.0)
    # vLLM's stat keys, in ms: KV-direct's 1, 1, 1, 5 s
    kv10 = r10[KV_DIRECT]
    assert kv10["mean_handoff_latency_ms"] == pytest.approx(2000.0)
    assert kv10["median_handoff_latency_ms"] == pytest.approx(1000.0)
    assert kv10["std_handoff_latency_ms"] == pytest.approx(3**0.5 * 1000.0)  # population
    assert kv10["p99_handoff_latency_ms"] == pytest.approx(1000.0 + 0.97 * 4000.0)
    assert kv10["max_handoff_latency_ms"] == 5000.0 and kv10["mean_wire_ms"] == 1000.0
    q = r10["kv_direct_over_token_id"]
    assert q["payload"] == 50 and q["mean_handoff_latency_ms"] == pytest.approx(2.0)
    assert q["max_handoff_latency_ms"] == 5.0 and q["max_wire_ms"] == 5.0
    head = handoff_summary.headline(rows)
    assert head["relay_tokens"] == 120  # nearest to the source's 100 tokens
    assert head["conditions"]["quiet"]["kv_direct_over_token_id"]["mean_handoff_latency_ms"] == 1.0
    grew = head["conditions"]["jitter"]["over_quiet"]  # what the disturbance added
    assert grew[TOKEN_ID]["mean_handoff_latency_ms"] == 1.0
    assert grew[KV_DIRECT]["max_handoff_latency_ms"] == 3.0
    assert "over_quiet" not in head["conditions"]["quiet"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--prompt-len", "40"], "multiple of 16"),
        (["--relay-tokens", "0"], "counts >= 1"),
        (["--bulk-load", "1"], "bulk-load"),
        (["--conditions", "quiet", "quiet"], "twice"),
    ],
)
def test_bad_options_are_refused(argv, message):
    p = argparse.ArgumentParser()
    handoff.add_arguments(p)
    with pytest.raises(ValueError, match=message):
        handoff.check_args(p.parse_args(argv))


@pytest.mark.timeout(120)
async def test_quick_run_is_consistent(tmp_path):
    p = argparse.ArgumentParser()
    handoff.add_arguments(p)
    args = p.parse_args(["--quick", "--out", str(tmp_path), "--no-progress"])
    r = await handoff.run(args)
    data = json.loads(Path(r["path"]).read_text())
    assert data["machine"]["cores"] >= 1 and data["machine"]["torch"]
    assert data["config"]["quick"] is True and data["threads_per_daemon"] == 1
    assert data["kv_bytes_per_token"] == KVB
    assert all(
        data["consistency"][k]
        for k in (
            "all_token_exact",
            "token_id_payload_below_kv_direct",
            "kv_bytes_received_match",
            "token_id_extends_in_one_forward",
            "kv_direct_forward_is_one_token",
        )
    )
    assert data["consistency"]["unexpected_frames"] == []
    counts, reps = data["config"]["relay_tokens"], data["config"]["repeats"]
    assert set(data["conditions"]) == {"quiet", "jitter+bulk"}
    for c in data["conditions"].values():
        assert [row["relay_tokens"] for row in c["rows"]] == sorted(counts)
        for row in c["rows"]:
            n, tok, kv = row["relay_tokens"], row["token-id"], row["kv-direct"]
            assert tok["payload_bytes"] < kv["payload_bytes"]
            assert kv["payload_bytes"] > n * KVB  # the KV itself, plus framing and ids
            assert kv["kv_bytes_received"] == n * KVB and tok["kv_bytes_received"] == 0
            assert tok["forward_tokens"] == [n + 1] and kv["forward_tokens"] == [1]
            assert row["kv_direct_over_token_id"]["payload"] == pytest.approx(
                kv["payload_bytes"] / tok["payload_bytes"]
            )
            for s in (tok, kv):
                assert s["token_exact"] and s["n"] == reps
                assert (
                    0
                    < s["median_handoff_latency_ms"]
                    <= s["p99_handoff_latency_ms"]
                    <= s["max_handoff_latency_ms"]
                )
                assert s["mean_handoff_latency_ms"] <= s["max_handoff_latency_ms"]
                assert s["max_over_mean"] >= 1.0
        pay = [row["token-id"]["payload_bytes"] for row in c["rows"]]
        assert pay == sorted(pay)  # more ids, more bytes
    jb, quiet = data["conditions"]["jitter+bulk"], data["conditions"]["quiet"]
    assert quiet["bulk"] is None and quiet["effects"]["jitter_ms"] == 0
    assert jb["effects"]["jitter_ms"] == data["config"]["jitter_ms"] > 0
    assert jb["bulk"]["bytes"] > 0 and jb["bulk"]["received_bytes"] == jb["bulk"]["bytes"]
    trials = data["trials"]
    assert len(trials) == 2 * len(counts) * reps * 2
    assert all(t["tokens"] == t["expected"] and len(t["tokens"]) == 2 for t in trials)
    assert all(t["wire_s"] + t["md_s"] == pytest.approx(t["latency_s"]) for t in trials)
    head = data["headline"]
    assert head["relay_tokens"] == max(counts) and head["payload_ratio"] > 1
    assert r["plots"] and all(Path(png).stat().st_size > 0 for png in r["plots"])


async def test_the_machines_cut_md_takes_over_token_exact(tiny, prep):
    """The bench's sides as the daemons: MD's machine asks (TAKEOVER), RLD's machine cuts with
    one final one-shot HANDOFF from index 0 (P's first token and the relay tokens), and MD's
    machine applies it and emits from the cut on."""
    from concurrent.futures import ThreadPoolExecutor

    from pddnet.lifecycle.actions import SendHandoff

    model, tok = tiny
    n = 7
    with ThreadPoolExecutor(1) as md:
        trial = handoff_sides.MainTrial(TOKEN_ID, "t-fsm", n, prep, model, tok, md)
        takeover = await trial.setup()
        assert takeover.ready_position == len(prep.prompt)
        relay = handoff_sides.relay_machine(prep, n)
        actions = relay.takeover(takeover.ready_position, takeover.chunk_tokens, 0.0)
        (send,) = [a for a in actions if isinstance(a, SendHandoff)]
        assert (send.start_index, send.final, send.mode) == (0, True, "one-shot")
        assert list(send.token_ids) == prep.relay[: n + 1]
        msg = Handoff(
            request_id="t-fsm",
            start_index=send.start_index,
            token_ids=send.token_ids,
            final=send.final,
            mode=send.mode,
        )
        await trial.on_handoff(wire(msg), 0.0)
        got = await trial.done
        await trial.close()
        assert got["tokens"] == prep.reference[n + 1 : n + 3]
        assert trial.fsm.next_index == n + 1 and trial.fsm.known[: n + 1] == prep.relay[: n + 1]
