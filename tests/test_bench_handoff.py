"""`pdd bench handoff`: MD's side of both handoff transports fed frames by hand (no sockets),
and the --quick run through the emulated WAN as a smoke test, unpaced and on emulated devices
(the source's figure): it completes, writes its JSON and plots, and its numbers agree with each
other (never with a clock)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import root_netns_missing_reason

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


N_MAX = 12  # the largest cut the tests make


@pytest.fixture(scope="module")
def prep(tiny):
    model, tok = tiny
    prompt = handoff_setup.make_prompts(
        1, 32, model.config.vocab_size, model.config.bos_token_id, 3
    )[0]
    rld = handoff_setup.engine_for(
        model, tok, "relay", handoff_setup.relay_tokens_needed(32, N_MAX)
    )
    yield handoff_setup.prepare_prompt(
        model, tok, 0, prompt, N_MAX, SamplingParams(temperature=0.8, seed=5), rld
    )
    rld.close()


@pytest.fixture
def md_engine(tiny):
    """MD's engine, as the bench builds it: one for every trial in turn."""
    model, tok = tiny
    engine = handoff_setup.engine_for(model, tok, "main_decode", 32 + 2 * N_MAX + 8)
    yield engine
    engine.close()


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


async def test_both_transports_leave_md_token_exact(md_engine, prep):
    from concurrent.futures import ThreadPoolExecutor

    n = 9
    with ThreadPoolExecutor(1) as md:
        tid = handoff_sides.MainTrial(TOKEN_ID, "t-tok", n, prep, md_engine, md)
        await tid.setup()
        await tid.on_handoff(wire(cut(prep, n, "t-tok")), 0.0)
        got = await tid.done
        await tid.close()
        assert got["tokens"] == prep.reference[n + 1 : n + 3]
        assert got["forward_tokens"] == n + 1  # P's first token + n relay tokens, one extend
        assert_empty(md_engine)  # the next trial starts where this one did

        kvd = handoff_sides.MainTrial(KV_DIRECT, "t-kv", n, prep, md_engine, md)
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
        assert_empty(md_engine)


def assert_empty(engine) -> None:
    """Every block free, nothing claimed, nothing cached: the state each trial starts from."""
    assert engine.allocator.num_free == engine.num_blocks
    assert engine.blocks.claimed == 0 and engine.prefix_cache.num_cached_blocks == 0


async def test_md_engine_is_reset_after_every_trial_also_a_failed_one(md_engine, prep):
    """One warm MD engine for every trial: a trial that failed half-way (MD refused the
    HANDOFF) still leaves it empty, and the next trial then finds nothing of the prompt cached
    (a cold copy, as the figure needs) and is token-exact."""
    from concurrent.futures import ThreadPoolExecutor

    n = 6
    with ThreadPoolExecutor(1) as md:
        bad = handoff_sides.MainTrial(TOKEN_ID, "t-fail", n, prep, md_engine, md)
        await bad.setup()
        assert md_engine.allocator.num_free < md_engine.num_blocks  # it holds the prompt
        with pytest.raises(ValueError):
            await bad.on_handoff(cut(prep, n - 1, "t-fail"), 0.0)
        await bad.close()
        assert_empty(md_engine)
        for rid in ("t-again-1", "t-again-2"):
            trial = handoff_sides.MainTrial(TOKEN_ID, rid, n, prep, md_engine, md)
            await trial.setup()
            await trial.on_handoff(wire(cut(prep, n, rid)), 0.0)
            got = await trial.done
            await trial.close()
            assert got["tokens"] == prep.reference[n + 1 : n + 3]
            assert_empty(md_engine)


def test_prompts_share_rlds_engine_without_touching_each_other(tiny):
    """RLD's one engine holds every prompt's sequence: preparing the second prompt must not
    step the first one's (held), whose relay tokens' KV KV-direct still sends."""
    model, tok = tiny
    prompts = handoff_setup.make_prompts(2, 32, model.config.vocab_size, 256, 4)
    need = handoff_setup.relay_tokens_needed(32, 8)
    rld = handoff_setup.engine_for(model, tok, "relay", need, need)
    try:
        sp = SamplingParams(temperature=0.8, seed=2)
        first = handoff_setup.prepare_prompt(model, tok, 0, prompts[0], 8, sp, rld)
        kv_before = export_kv(
            rld.pool, rld.get_sequence(first.rld_request).block_table, 32, 40
        ).kv.clone()
        tokens_before = list(rld.get_sequence(first.rld_request).token_ids)
        second = handoff_setup.prepare_prompt(model, tok, 1, prompts[1], 8, sp, rld)
        seq = rld.get_sequence(first.rld_request)
        assert seq.token_ids == tokens_before and not seq.is_finished
        assert torch.equal(export_kv(rld.pool, seq.block_table, 32, 40).kv, kv_before)
        assert second.relay == second.reference[:9] and first.relay == first.reference[:9]
    finally:
        rld.close()


async def test_md_rejects_a_handoff_that_is_not_the_cut(md_engine, prep):
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as md:
        trial = handoff_sides.MainTrial(TOKEN_ID, "t-bad", 5, prep, md_engine, md)
        await trial.setup()
        with pytest.raises(ValueError, match="is not RLD's cut at 5"):
            await trial.on_handoff(cut(prep, 4, "t-bad"), 0.0)
        with pytest.raises(ValueError, match="KV_CHUNK on a token-id handoff"):
            await trial.on_chunk(kv_chunks(prep, 5, "t-bad", 8)[0], 0.0)
        await trial.close()
        kvd = handoff_sides.MainTrial(KV_DIRECT, "t-bad2", 5, prep, md_engine, md)
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
            "payload_target_bytes": payload,
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
    # how many handoffs reach each multiple of the mean the target names: the 5 s one alone
    assert kv10["at_least_x_mean"] == {"1.1": 1, "2": 1}
    assert r10[TOKEN_ID]["at_least_x_mean"] == {"1.1": 0, "2": 0}
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
        (["--bulk-stripes", "0"], "bulk-stripes must be >= 1"),
        (["--tcp-cc", "cubic"], "needs --wan packet"),
        (["--wan", "packet", "--tcp-cc", "no-such-cc"], "not offered by this kernel"),
    ],
)
def test_bad_options_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        handoff.check_args(parsed(argv))


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
    # striped over P's wan.stripes lanes, as P sends KV to MD; every lane carried some
    lanes = jb["bulk"]["lane_bytes"]
    assert len(lanes) == data["config"]["bulk_stripes"] == 4 and sum(lanes) == jb["bulk"]["bytes"]
    assert min(lanes) > 0
    trials = data["trials"]
    assert len(trials) == 2 * len(counts) * reps * 2
    assert all(t["tokens"] == t["expected"] and len(t["tokens"]) == 2 for t in trials)
    assert all(t["wire_s"] + t["md_s"] == pytest.approx(t["latency_s"]) for t in trials)
    head = data["headline"]
    assert head["relay_tokens"] == max(counts) and head["payload_ratio"] > 1
    assert r["plots"] and all(Path(png).stat().st_size > 0 for png in r["plots"])


@pytest.mark.root
@pytest.mark.skipif(
    root_netns_missing_reason() is not None, reason=str(root_netns_missing_reason())
)
@pytest.mark.timeout(180)
async def test_quick_run_over_the_packet_shell_loses_nothing_to_tail_drops(tmp_path):
    """RLD's and MD's sockets in the testbed's two namespaces, real TCP through the packet
    shell; a buffer of 2 ms makes the bulk traffic overflow it, so packets are dropped and TCP
    recovers them: every handoff still token-exact, every bulk byte received, and the testbed
    gone afterwards."""
    from emulation import netns

    before = set(netns.list_netns())
    argv = ["--quick", "--wan", "packet", "--queue-ms", "2", "--repeats", "2"]
    args = parsed([*argv, "--relay-tokens", "40", "--out", str(tmp_path), "--no-progress"])
    r = await handoff.run(args)
    data = json.loads(Path(r["path"]).read_text())
    assert data["link"]["shell"] == "packet" and data["link"]["mtu"] == 1500
    assert data["link"]["tcp_congestion_control"] == "cubic"
    assert data["link"]["tcp_rto_min_ms"] == 200.0  # undilated (--quick): the kernel's own
    assert data["consistency"]["all_token_exact"]
    assert data["consistency"]["kv_bytes_received_match"]
    assert data["consistency"]["unexpected_frames"] == []
    jb = data["conditions"]["jitter+bulk"]
    assert jb["link_a_to_b"]["drops"]["queue_full"] > 0  # the buffer did overflow
    assert jb["bulk"]["bytes"] > 0 and jb["bulk"]["received_bytes"] == jb["bulk"]["bytes"]
    assert jb["link_a_to_b"]["packets_in"] > jb["link_a_to_b"]["packets_out"]  # the drops
    assert len(data["trials"]) == 2 * 2 * 2
    for t in data["trials"]:  # RLD's lanes' TCP counters, per handoff
        assert all(t["tcp"][lane]["retrans_segments"] >= 0 for lane in ("control", "bulk"))
    row = jb["rows"][0]["kv-direct"]
    assert 0 <= row["handoffs_retransmitting"] <= row["n"]
    # the testbed's namespaces are gone (this process's: another test worker may hold its own)
    mine = f"pddho{os.getpid()}"
    assert not [ns for ns in set(netns.list_netns()) - before if ns.startswith(mine)]


async def test_the_machines_cut_md_takes_over_token_exact(md_engine, prep):
    """The bench's sides as the daemons: MD's machine asks (TAKEOVER), RLD's machine cuts with
    one final one-shot HANDOFF from index 0 (P's first token and the relay tokens), and MD's
    machine applies it and emits from the cut on."""
    from concurrent.futures import ThreadPoolExecutor

    from pddnet.lifecycle.actions import SendHandoff

    n = 7
    with ThreadPoolExecutor(1) as md:
        trial = handoff_sides.MainTrial(TOKEN_ID, "t-fsm", n, prep, md_engine, md)
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


# -- emulated devices -------------------------------------------------------------------------

EMULATED = [
    "--target-model",
    "llama-3-70b",
    "--device",
    "relay=h100-sxm:8",
    "--device",
    "main-decode=h200-sxm:8",
]
TARGET_KVB = 327_680  # llama-3-70b's KV bytes per token


def parsed(argv):
    p = argparse.ArgumentParser()
    handoff.add_arguments(p)
    args = p.parse_args(argv)
    handoff.apply_defaults(args)
    return args


def test_defaults_quick_and_emulated_and_given_options_win():
    full, quick = parsed([]), parsed(["--quick"])
    assert (full.model, full.bw_mbit, full.relay_tokens) == ("small", 100.0, [10, 25, 50, 100, 200])
    assert (quick.model, quick.bw_mbit, quick.repeats) == ("tiny", 20.0, 3)
    emulated = parsed([*EMULATED, "--quick"])  # the modelled line is the source's
    assert (emulated.model, emulated.bw_mbit, emulated.bulk_mib) == ("tiny", 10000.0, 32.0)
    assert parsed(EMULATED).bulk_mib == 256.0
    given = parsed(["--quick", "--relay-tokens", "100", "--repeats", "2", "--bw-mbit", "7"])
    assert (given.relay_tokens, given.repeats, given.bw_mbit) == ([100], 2, 7.0)


def test_handoff_devices_pace_relay_and_md_and_say_when_not_valid(capsys):
    """The pacers are the daemons' (the target on each role's chip, k), P is not paced, and a
    run whose forwards overran says NOT VALID, naming the k to use."""
    from pddnet.bench.devices import print_validity
    from pddnet.bench.handoff_devices import setup_handoff_devices
    from pddnet.device.cost import InstanceCost
    from pddnet.device.profiles import load_chip
    from pddnet.device.profiles import load_model as load_profile

    devices = setup_handoff_devices(parsed([*EMULATED, "--quick", "--dilation", "3"]))
    assert devices.k == 3.0 and set(devices.pacers) == {"relay", "main_decode"}
    assert set(devices.setup.devices) == {"relay", "main_decode"}
    assert devices.setup.wire_scale == pytest.approx(KVB / TARGET_KVB)
    assert devices.target_bytes(10 * KVB) == 10 * TARGET_KVB
    md = devices.pacer("main_decode")
    h200 = InstanceCost(load_chip("h200-sxm"), load_profile("llama-3-70b"), gpus=8)
    assert md.modelled([(64, 165)]) == h200.prefill_step_time([(64, 165)])
    fine = md.modelled([(64, 165)]) * 3
    md.pace([(64, 165)], 0.0, fine / 2)  # kept pace: waits the other half
    report = devices.report()
    assert report["emulated"] and report["valid"] and report["steps"] == 1
    assert print_validity({"": report}, "handoff") == []
    md.pace([(64, 165)], 0.0, fine * 10)  # 10x over its modelled time at k = 3
    report = devices.report()
    assert (report["steps"], report["overruns"], report["valid"]) == (2, 1, False)
    assert report["roles"]["main_decode"]["chip"] == "h200-sxm"
    (warning,) = print_validity({"": report}, "handoff")
    assert "NOT VALID" in warning and "NOT VALID" in capsys.readouterr().out
    assert report["dilation_needed"] >= 30
    unpaced = setup_handoff_devices(parsed(["--quick"]))
    assert not unpaced.emulated and unpaced.pacers == {} and unpaced.report() == {"emulated": False}
    with pytest.raises(ValueError, match="no-such-chip"):
        setup_handoff_devices(parsed([*EMULATED, "--device", "relay=no-such-chip"]))
    md_only = ["--target-model", "llama-3-70b", "--device", "main-decode=h200-sxm:8", "--quick"]
    with pytest.raises(ValueError, match="relay has no device"):  # P's is not asked for
        setup_handoff_devices(parsed(md_only))


@pytest.mark.timeout(120)
async def test_source_figure_on_emulated_devices(tmp_path):
    """The source's figure (100 relay tokens, quiet and jitter+bulk with and without the control
    class, both paths) as `pdd bench
    reproduce` runs it, --quick on llama-3-70b devices at k = 2: the forwards and the link are
    the modelled ones, the payload is also given in the target's bytes, tokens stay exact."""
    from pddnet.device.cost import InstanceCost
    from pddnet.device.profiles import load_chip
    from pddnet.device.profiles import load_model as load_profile

    k, n = 2.0, 100
    fig = await handoff.source_figure(
        [*EMULATED, "--dilation", "2", "--quick", "--repeats", "2"]
        + ["--out", str(tmp_path), "--no-progress"]
    )
    data = json.loads(Path(fig["path"]).read_text())
    assert fig == {**data["figure"], "path": fig["path"]}
    conditions = {"quiet", "jitter+bulk", "jitter+bulk+priority"}
    assert fig["relay_tokens"] == n and set(fig["conditions"]) == conditions
    assert fig["emulated"] and fig["dilation"] == k and fig["valid"] == data["devices"]["valid"]
    # decided on both lines, whatever the box's load
    assert {c: type(v) for c, v in fig["target"]["met"].items()} == {
        "jitter+bulk": bool,
        "jitter+bulk+priority": bool,
    }
    for c in fig["conditions"].values():
        for s in c.values():
            assert s["max_over_mean"] == pytest.approx(s["max_ms"] / s["mean_ms"])
            # the handoffs behind the max/mean: how many reach the target's multiples
            tail = s["at_least_x_mean"]
            assert s["handoffs"] == 2 and s["handoffs"] >= tail["1.1"] >= tail["2"]
            assert (tail["2"] > 0) == (s["max_over_mean"] >= 2.0)
    # the HANDOFFs (control lane, marked) crossed in the priority class only where it was on
    link = {c: data["conditions"][c]["link_a_to_b"]["priority"] for c in conditions}
    assert link["jitter+bulk+priority"]["bytes"] > 0
    assert link["jitter+bulk"]["bytes"] == link["quiet"]["bytes"] == 0
    # payload: the ids as they are, KV-direct's KV as llama-3-70b's
    real, target = fig["payload_bytes"], fig["payload_target_bytes"]
    assert target[TOKEN_ID] == real[TOKEN_ID]
    assert target[KV_DIRECT] == real[KV_DIRECT] + n * (TARGET_KVB - KVB)
    assert fig["payload_target_ratio"] == pytest.approx(target[KV_DIRECT] / target[TOKEN_ID])

    assert data["config"]["dilation_k"] == k and data["emulation"]["target_model"] == "llama-3-70b"
    assert data["link"]["initial"]["rate_mbit"] == pytest.approx(10000 * KVB / TARGET_KVB / k)
    assert data["link"]["initial"]["delay_ms"] == pytest.approx(10 / 2 * k)
    assert data["conditions"]["jitter+bulk"]["effects"]["jitter_ms"] == pytest.approx(5 * k)
    bulk = data["conditions"]["jitter+bulk"]["bulk"]
    assert bulk["target_bytes"] == bulk["bytes"] * TARGET_KVB // KVB
    assert all(data["consistency"][c] for c in ("all_token_exact", "kv_bytes_received_match"))
    assert data["consistency"]["forwards_last_their_modelled_time"]
    trials = data["trials"]
    assert len(trials) == len(conditions) * 2 * 2 and all(t["token_exact"] for t in trials)
    # MD's sampling forward, paced: the extend of P's first token and the relay tokens, or
    # KV-direct's one decode, at their modelled time on 8 H200s
    h200 = InstanceCost(load_chip("h200-sxm"), load_profile("llama-3-70b"), gpus=8)
    prompt = data["config"]["prompt_len"]
    for t in trials:
        (chunk,) = [tuple(c) for c in t["forward_chunks"]]
        want = (prompt, prompt + n + 1) if t["path"] == TOKEN_ID else (prompt + n, prompt + n + 1)
        assert chunk == want and t["dilation"] == k
        assert t["forward_modelled_s"] == pytest.approx(h200.prefill_step_time([want]))
        assert t["forward_s"] >= t["forward_modelled_s"] - 1e-6  # wall / k
        assert t["wire_s"] + t["md_s"] == pytest.approx(t["latency_s"])
    dev = data["devices"]
    assert dev["emulated"] and set(dev["roles"]) == {"relay", "main_decode"}
    md, rld = dev["roles"]["main_decode"], dev["roles"]["relay"]
    assert md["steps"] == len(trials) + 2  # and the two warm-up handoffs
    # each trial's engine step is the one the pacer judged: it overran iff it took longer
    overran = sum(t["forward_compute_s"] > t["forward_modelled_s"] for t in trials)
    assert overran <= md["overruns"] <= overran + 2
    assert rld["steps"] == n  # RLD's decode to the cut, once per prompt
    assert (md["chip"], rld["chip"], md["gpus"]) == ("h200-sxm", "h100-sxm", 8)
    assert dev["steps"] == md["steps"] + rld["steps"]
    assert dev["overrun_share"] == pytest.approx(dev["overruns"] / dev["steps"])
