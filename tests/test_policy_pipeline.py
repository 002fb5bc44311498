import pytest

from pddnet.policy.admission import RelayAdmission
from pddnet.policy.pipeline import Pipeline, PipelinePolicy
from tests.samples import pipeline_inputs

# pipeline_inputs() unless overridden: 4096 uncached prompt tokens, 256 out, 16384 KV bytes per
# token, 125 MB/s at 30 ms RTT, 20 ms per token on RLD, RLD admits, nothing queued ahead.


def test_high_hit_goes_direct_to_md():
    d = PipelinePolicy(direct_budget_s=0.2).decide(pipeline_inputs(hit_tokens=4000))
    assert d.pipeline is Pipeline.P_MD
    assert d.incremental_bytes == 96 * 16384


def test_low_hit_long_prompt_goes_through_rld():
    d = PipelinePolicy().decide(pipeline_inputs(prompt_tokens=32768, hit_tokens=0))
    assert d.pipeline is Pipeline.P_RLD_MD
    assert d.wan_transfer_s == pytest.approx(0.03 + 32768 * 16384 / 125e6)


def test_long_input_short_output_stays_on_rld():
    d = PipelinePolicy().decide(pipeline_inputs(prompt_tokens=32768, max_tokens=8))
    assert d.pipeline is Pipeline.RLD_ONLY
    off = PipelinePolicy(singular_filter=False).decide(
        pipeline_inputs(prompt_tokens=32768, max_tokens=8)
    )
    assert off.pipeline is Pipeline.P_RLD_MD


def test_rld_full_means_wait_on_md():
    d = PipelinePolicy().decide(
        pipeline_inputs(prompt_tokens=32768, max_tokens=8, rld_admits=False)
    )
    assert d.pipeline is Pipeline.P_MD and "refused" in d.reason
    rec = d.record(pipeline_inputs(rld_admits=False))
    assert rec["pipeline"] == "p_md" and rec["inputs"]["rld_admits"] is False


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="hit_tokens"):
        PipelinePolicy().decide(pipeline_inputs(hit_tokens=5000))
    with pytest.raises(ValueError, match="bandwidth"):
        PipelinePolicy().decide(pipeline_inputs(bandwidth_bps=0))


def test_admission_never_exceeds_limits_under_a_flood():
    adm = RelayAdmission(max_running_tokens=10_000, max_blocks=500, max_requests=8)
    admitted, total = [], 0
    for i in range(1000):
        if adm.try_admit(f"r{i}", tokens=3000, blocks=100).admitted:
            admitted.append(f"r{i}")
            total += 1
        assert adm.num_requests <= 8 and adm.load <= 1.0
        if i % 7 == 0 and admitted:
            adm.release(admitted.pop(0))
    # 3 requests fill the 10k-token limit; only releases make room again
    assert adm.refused == 1000 - total and total < 200
    for rid in admitted:
        assert adm.release(rid)
    assert adm.load == 0 and adm.num_requests == 0
    assert not adm.release("never")
    with pytest.raises(ValueError):
        RelayAdmission(max_running_tokens=0, max_blocks=1)


def test_pipeline_wire_names_round_trip():
    for p in Pipeline:
        assert Pipeline.from_wire(p.wire) is p
    assert Pipeline.P_RLD_MD.wire == "p_rld_md"
    with pytest.raises(ValueError, match="unknown pipeline"):
        Pipeline.from_wire("p_x")


def test_admission_keeps_high_water_marks():
    adm = RelayAdmission(max_running_tokens=100, max_blocks=10, max_requests=2)
    assert adm.try_admit("a", 40, 3).admitted
    assert adm.try_admit("b", 40, 3).admitted
    assert not adm.try_admit("c", 1, 1).admitted  # third request: over max_requests
    adm.release("a")
    assert adm.try_admit("c", 10, 1).admitted
    c = adm.counters()
    assert (c["peak_requests"], c["peak_tokens"], c["peak_blocks"]) == (2, 80, 6)
    assert (c["admitted"], c["refused"], c["requests"]) == (3, 1, 2)


def test_singular_traffic_gets_only_its_share_of_rld():
    adm = RelayAdmission(
        max_running_tokens=1000, max_blocks=100, max_requests=4, singular_share=0.5
    )
    assert adm.try_admit("s1", 100, 10, singular=True).admitted
    assert adm.try_admit("s2", 100, 10, singular=True).admitted
    third = adm.try_admit("s3", 100, 10, singular=True)
    assert not third.admitted and "singular share" in third.reason
    assert adm.try_admit("relayed", 100, 10).admitted  # relayed traffic still fits
    adm.release("s1")
    assert adm.try_admit("s3", 100, 10, singular=True).admitted
    assert adm.counters()["singular_requests"] == 2
    big = adm.try_admit("s4", 10, 1, singular=True)
    assert not big.admitted
    with pytest.raises(ValueError, match="singular_share"):
        RelayAdmission(10, 10, singular_share=1.5)


def test_the_bytes_queued_ahead_push_a_request_past_the_direct_budget():
    # 96 uncached tokens * 16384 B = 1,572,864 B at 125 MB/s = 12.58 ms, + 30 ms RTT = 42.6 ms:
    # direct. Behind 20 MB P has not seen acknowledged: 42.6 + 160 ms = 202.6 ms > 200 ms.
    policy = PipelinePolicy(direct_budget_s=0.2)
    alone = policy.decide(pipeline_inputs(hit_tokens=4000))
    assert alone.pipeline is Pipeline.P_MD
    assert alone.wan_transfer_s == pytest.approx(0.03 + 96 * 16384 / 125e6)
    assert "behind" not in alone.reason
    queued = policy.decide(pipeline_inputs(hit_tokens=4000, wan_backlog_bytes=20_000_000))
    assert queued.pipeline is Pipeline.P_RLD_MD
    assert queued.wan_transfer_s == pytest.approx(0.03 + (20_000_000 + 96 * 16384) / 125e6)
    assert queued.incremental_bytes == alone.incremental_bytes == 96 * 16384
    assert "behind 20.0 MB" in queued.reason
    rec = queued.record(pipeline_inputs(hit_tokens=4000, wan_backlog_bytes=20_000_000))
    assert rec["wan_backlog_bytes"] == rec["inputs"]["wan_backlog_bytes"] == 20_000_000
    # a backlog that still fits leaves it direct: 19 MB -> 194.6 ms
    assert (
        policy.decide(pipeline_inputs(hit_tokens=4000, wan_backlog_bytes=19_000_000)).pipeline
        is Pipeline.P_MD
    )
    # RLD refusing: the request waits for its KV on MD, backlog or not
    assert (
        policy.decide(
            pipeline_inputs(hit_tokens=4000, wan_backlog_bytes=20_000_000, rld_admits=False)
        ).pipeline
        is Pipeline.P_MD
    )


def test_the_singular_filter_compares_with_the_requests_own_crossing_time():
    # 4096 uncached tokens: 536.9 ms + 30 ms alone. RLD needs 8 * 20 ms = 160 ms for the output
    # (RLD alone either way); 40 tokens = 800 ms: through the relay even behind 1 GB (8.6 s).
    policy = PipelinePolicy()
    assert policy.decide(pipeline_inputs(max_tokens=8)).pipeline is Pipeline.RLD_ONLY
    assert policy.decide(pipeline_inputs(max_tokens=40)).pipeline is Pipeline.P_RLD_MD
    behind = policy.decide(pipeline_inputs(max_tokens=40, wan_backlog_bytes=1 << 30))
    assert behind.pipeline is Pipeline.P_RLD_MD
    assert behind.wan_transfer_s == pytest.approx(0.03 + ((1 << 30) + 4096 * 16384) / 125e6)


def test_a_negative_backlog_is_refused():
    with pytest.raises(ValueError, match="wan_backlog_bytes"):
        PipelinePolicy().decide(pipeline_inputs(wan_backlog_bytes=-1))
